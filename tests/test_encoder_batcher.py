"""The encoder's batcher: token-budget batching, coalescing, cache hits, failure isolation."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from epdserve.cache.embedding_cache import EmbeddingCache
from epdserve.encoder.batcher import Abandoned, BatcherClosed, BatcherConfig, EncodeBatcher, EncodeError, QueueFull

torch.set_num_threads(1)

PATCH_DIM = 3
MERGE = 2


class FakeTower:
    """Merges each 4 consecutive patch rows into one embedding; records every call's grids.

    ``gate`` holds the first forward until the test releases it, so later submissions queue up.
    """

    def __init__(self, fail_when: int | None = None) -> None:
        self.calls: list[list[tuple[int, int, int]]] = []
        self.gate = threading.Event()
        self.fail_when = fail_when  # a grid height that makes the forward raise

    def __call__(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        grids = [tuple(int(x) for x in g) for g in grid.tolist()]
        self.calls.append(grids)  # type: ignore[arg-type]
        self.gate.wait(10)
        if self.fail_when is not None and any(h == self.fail_when for _, h, _ in grids):
            raise RuntimeError("boom")
        return pixels.reshape(-1, MERGE * MERGE * PATCH_DIM)


def item(seed: int, grid: tuple[int, int, int] = (1, 2, 2)) -> tuple[tuple[int, int, int], torch.Tensor]:
    rows = grid[0] * grid[1] * grid[2]
    return grid, torch.full((rows, PATCH_DIM), float(seed))


def expected(pixels: torch.Tensor) -> torch.Tensor:
    return pixels.reshape(-1, MERGE * MERGE * PATCH_DIM)


def make(tower: FakeTower, cache_bytes: int = 1 << 20, **kw) -> EncodeBatcher:
    return EncodeBatcher(
        tower, BatcherConfig(**kw), EmbeddingCache(cache_bytes), rows_of=lambda g: g[0] * g[1] * g[2] // (MERGE * MERGE)
    )


async def _wait_for(pred, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise TimeoutError


def test_concurrent_items_share_a_forward_within_the_budget() -> None:
    async def main() -> None:
        tower = FakeTower()
        b = make(tower, token_budget=8)  # two 4-row items per forward
        b.start()
        first = asyncio.ensure_future(b.encode("u0", *item(0)))
        await _wait_for(lambda: len(tower.calls) == 1)  # u0 is running, the rest queue behind it
        rest = [asyncio.ensure_future(b.encode(f"u{i}", *item(i))) for i in range(1, 6)]
        await _wait_for(lambda: b.queue_depth == 5)
        tower.gate.set()
        results = await asyncio.gather(first, *rest)
        b.close()
        assert [len(c) for c in tower.calls] == [1, 2, 2, 1]
        for i, r in enumerate(results):
            assert torch.equal(r.embeddings, expected(item(i)[1]))
            assert not r.cache_hit
        assert b.batches == 4

    asyncio.run(main())


def test_a_slow_tower_runs_what_fits_its_time_bound_per_forward() -> None:
    """Once a forward was timed, a batch takes the rows that fit ``forward_s`` at that rate (the
    oldest job always runs): a large tower answers a burst's items in turn."""

    class SlowTower(FakeTower):
        def __call__(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
            time.sleep(0.01 * pixels.shape[0])  # 10 ms a row at least: 4-row items take 40 ms
            return super().__call__(pixels, grid)

    async def main(forward_s: float) -> list[int]:
        tower = SlowTower()
        b = make(tower, token_budget=8, forward_s=forward_s)
        b.start()
        first = asyncio.ensure_future(b.encode("u0", *item(0)))
        await _wait_for(lambda: len(tower.calls) == 1)
        rest = [asyncio.ensure_future(b.encode(f"u{i}", *item(i))) for i in range(1, 6)]
        await _wait_for(lambda: b.queue_depth == 5)
        tower.gate.set()
        results = await asyncio.gather(first, *rest)
        b.close()
        for i, r in enumerate(results):
            assert torch.equal(r.embeddings, expected(item(i)[1]))
        return [len(c) for c in tower.calls]

    assert asyncio.run(main(0.06)) == [1, 1, 1, 1, 1, 1]  # 6 rows fit 60 ms; two items are 8
    assert asyncio.run(main(0.0)) == [1, 2, 2, 1]  # no time bound: the token budget alone


def test_an_item_larger_than_the_budget_runs_alone() -> None:
    async def main() -> None:
        tower = FakeTower()
        tower.gate.set()
        b = make(tower, token_budget=4)
        b.start()
        big = item(1, (1, 4, 4))  # 16 rows
        r = await b.encode("big", *big)
        b.close()
        assert tower.calls == [[(1, 4, 4)]]
        assert torch.equal(r.embeddings, expected(big[1]))

    asyncio.run(main())


def test_same_uuid_in_flight_is_computed_once_then_served_from_cache() -> None:
    async def main() -> None:
        tower = FakeTower()
        b = make(tower)
        b.start()
        blocker = asyncio.ensure_future(b.encode("other", *item(9)))
        await _wait_for(lambda: len(tower.calls) == 1)
        a1 = asyncio.ensure_future(b.encode("same", *item(1)))
        a2 = asyncio.ensure_future(b.encode("same", *item(1)))
        await _wait_for(lambda: b.coalesced == 1)
        tower.gate.set()
        r1, r2, _ = await asyncio.gather(a1, a2, blocker)
        assert torch.equal(r1.embeddings, r2.embeddings)
        assert [len(c) for c in tower.calls] == [1, 1]  # "same" ran once
        again = await b.encode("same", *item(1))
        assert again.cache_hit and torch.equal(again.embeddings, r1.embeddings)
        cached = b.lookup("same")
        assert cached is not None and cached.grid_thw == (1, 2, 2)
        assert b.lookup("never") is None
        assert len(tower.calls) == 2
        b.close()

    asyncio.run(main())


def test_a_failing_forward_fails_only_its_batch_and_the_worker_keeps_running() -> None:
    async def main() -> None:
        tower = FakeTower(fail_when=6)
        b = make(tower, token_budget=64)
        b.start()
        blocker = asyncio.ensure_future(b.encode("ok0", *item(0)))
        await _wait_for(lambda: len(tower.calls) == 1)
        bad = asyncio.ensure_future(b.encode("bad", *item(1, (1, 6, 2))))
        mate = asyncio.ensure_future(b.encode("mate", *item(2)))
        await _wait_for(lambda: b.queue_depth == 2)
        tower.gate.set()
        await blocker
        for fut in (bad, mate):  # same batch: both fail, with the cause in the message
            with pytest.raises(EncodeError, match="RuntimeError: boom"):
                await fut
        assert b.lookup("mate") is None
        r = await b.encode("mate", *item(2))  # not cached, recomputed in a new batch
        assert not r.cache_hit and torch.equal(r.embeddings, expected(item(2)[1]))
        assert b.alive
        b.close()

    asyncio.run(main())


def test_full_queue_refuses_and_close_fails_queued_items() -> None:
    async def main() -> None:
        tower = FakeTower()
        b = make(tower, max_queued_items=1)
        b.start()
        running = asyncio.ensure_future(b.encode("r", *item(0)))
        await _wait_for(lambda: len(tower.calls) == 1)
        queued = asyncio.ensure_future(b.encode("q", *item(1)))
        await _wait_for(lambda: b.queue_depth == 1)
        with pytest.raises(QueueFull):
            await b.encode("x", *item(2))
        tower.gate.set()
        await running
        await queued
        # close while an item is queued behind a held forward
        tower.gate.clear()
        held = asyncio.ensure_future(b.encode("h", *item(3)))
        await _wait_for(lambda: len(tower.calls) == 3)
        late = asyncio.ensure_future(b.encode("l", *item(4)))
        await _wait_for(lambda: b.queue_depth == 1)
        threading.Timer(0.1, tower.gate.set).start()
        b.close()
        with pytest.raises(BatcherClosed):
            await late
        await held  # the running batch still completes
        with pytest.raises(BatcherClosed):
            await b.encode("after", *item(5))

    asyncio.run(main())


def test_cancelled_waiters_skip_the_compute() -> None:
    async def main() -> None:
        tower = FakeTower()
        b = make(tower)
        b.start()
        running = asyncio.ensure_future(b.encode("r", *item(0)))
        await _wait_for(lambda: len(tower.calls) == 1)
        gone = asyncio.ensure_future(b.encode("gone", *item(1)))
        await _wait_for(lambda: b.queue_depth == 1)
        gone.cancel()
        tower.gate.set()
        await running
        r = await b.encode("next", *item(2))
        assert not r.cache_hit
        assert tower.calls == [[(1, 2, 2)], [(1, 2, 2)]]  # "gone" never ran
        b.close()

    asyncio.run(main())


def test_config_is_validated() -> None:
    with pytest.raises(ValueError, match="token_budget"):
        BatcherConfig(token_budget=0)
    with pytest.raises(ValueError, match="max_wait_ms"):
        BatcherConfig(max_wait_ms=-1)


class LayeredTower(torch.nn.Module):
    """A tower of layers in a module list (as the vision towers are), merging rows like FakeTower;
    ``gate`` holds each forward before its first layer until the test releases it."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([torch.nn.Identity(), torch.nn.Identity()])
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.layers_run = 0

    def forward(self, pixels: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        self.gate.wait(10)
        for block in self.blocks:
            pixels = block(pixels)
            self.layers_run += 1
        return pixels.reshape(-1, MERGE * MERGE * PATCH_DIM)


def test_a_forward_nobody_waits_for_stops_and_one_a_caller_joined_runs_again() -> None:
    async def main() -> None:
        tower = LayeredTower()
        b = EncodeBatcher(tower, BatcherConfig(), EmbeddingCache(1 << 20), rows_of=lambda g: g[0] * g[1] * g[2] // 4)
        b.stop_abandoned(tower)
        b.start()
        gone = asyncio.ensure_future(b.encode("u0", *item(0)))
        await _wait_for(tower.entered.is_set)
        gone.cancel()  # its only caller leaves while it is in the tower
        await asyncio.sleep(0)
        tower.gate.set()
        await _wait_for(lambda: b.abandoned == 1)
        assert tower.layers_run == 0 and b.lookup("u0") is None  # stopped before its first layer, nothing kept

        # the check and a caller joining race: a forward stopped while a caller waits on it runs again
        tower.gate.clear()
        tower.entered.clear()
        once = [True]

        def stop_once(module: torch.nn.Module, args: object) -> None:
            if once.pop() if once else False:
                raise Abandoned("as if every caller had left")

        tower.blocks[0].register_forward_pre_hook(stop_once)
        waiting = asyncio.ensure_future(b.encode("u1", *item(1)))
        await _wait_for(tower.entered.is_set)
        tower.gate.set()
        result = await asyncio.wait_for(waiting, 10)
        assert torch.equal(result.embeddings, expected(item(1)[1])) and b.abandoned == 2
        b.close()

    asyncio.run(main())
