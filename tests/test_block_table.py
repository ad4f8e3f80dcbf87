"""The runner's block table: rows updated only from the first changed block, rewritten when a
request's block list is replaced (preemption, prefix-cache admission), and slot mappings computed
with tensor ops equal to the slot-by-slot definition."""

from __future__ import annotations

import random

import torch

from epdserve.engine.kv_cache import BlockTable

BS = 4


def naive_slots(blocks: list[int], start: int, end: int) -> list[int]:
    return [blocks[p // BS] * BS + p % BS for p in range(start, end)]


def test_rows_follow_appends_and_replacements() -> None:
    table = BlockTable(rows=2, max_blocks=8, device=torch.device("cpu"))
    a = [5, 2]
    ra = table.row("a", a)
    a.append(7)  # a decode step added a block to the same list
    assert table.row("a", a) == ra and table.table[ra, :3].tolist() == [5, 2, 7]
    a = [1]  # preempted and readmitted: a new list, rewritten from its start
    assert table.table[table.row("a", a), :1].tolist() == [1]
    b, c = [3], [4]
    rb, rc = table.row("b", b), table.row("c", c)  # a third request grows the table
    assert len({ra, rb, rc}) == 3 and table.table.shape[0] >= 3
    table.release("b")
    assert table.row("d", [6]) == rb  # a released row is reused


def test_slot_mapping_equals_the_definition() -> None:
    rng = random.Random(0)
    table = BlockTable(rows=4, max_blocks=16, device=torch.device("cpu"))
    lists = {f"r{i}": rng.sample(range(100), 10) for i in range(6)}
    rows, starts, ends, want = [], [], [], []
    for rid, blocks in lists.items():
        s = rng.randrange(0, 30)
        e = rng.randrange(s + 1, 40)
        rows.append(table.row(rid, blocks))
        starts.append(s)
        ends.append(e)
        want += naive_slots(blocks, s, e)
    got = table.slots(torch.tensor(rows), torch.tensor(starts), torch.tensor(ends), BS)
    assert got.tolist() == want
