"""Roles lending idle cores through a core board: how many threads a computing role gets, layer by
layer, and what the board refuses."""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from epdserve.common.core_board import SIZE, Board, make_board
from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore
from epdserve.engine.request import Request
from epdserve.kernels import lending
from epdserve.kernels.lending import GRACE_S, CoreLender
from tests.server_utils import wait_until


@pytest.fixture
def board(tmp_path: Path) -> Iterator[Path]:
    threads = torch.get_num_threads()
    path = make_board(tmp_path)
    yield path
    torch.set_num_threads(threads)  # lenders set this thread's count


def test_a_board_is_private_to_its_user(board: Path) -> None:
    assert board.stat().st_mode & 0o777 == 0o600 and board.stat().st_size == SIZE
    board.chmod(0o644)
    with pytest.raises(ValueError, match="not a core board"):
        Board(board)
    board.chmod(0o600)
    with board.open("ab") as f:
        f.write(b"\0")
    with pytest.raises(ValueError, match="not a core board"):
        Board(board)


def test_a_computing_role_borrows_the_cores_of_idle_ones_only(board: Path) -> None:
    enc, pd = CoreLender(board, 1, cores=8), CoreLender(board, 1, cores=8)
    assert enc.available() == pd.available() == 2  # nobody computes: each may take both
    with pd.computing() as n:
        assert n == 2  # the encoder is idle
        assert enc.available() == 1  # the language model computes: its core is not lent
    assert enc.available() == 1, "a role that just stopped is about to step again"
    assert enc.available(now=time.monotonic() + 2 * GRACE_S) == 2
    pd.close()
    assert enc.available() == 1  # a role that stopped gave its slot back: nothing is on the board to lend


def test_idle_cores_are_shared_by_own_cores_among_the_roles_computing(board: Path) -> None:
    a, b, idle = CoreLender(board, 1, cores=16), CoreLender(board, 3, cores=16), CoreLender(board, 4, cores=16)
    with b.computing():
        assert a.available() == 1 + 4 * 1 // 4  # a's share of the 4 idle cores, beside b's 3
        assert idle.available() == 4 + 1 * 4 // 7  # the idle a's one core, shared with b
    capped = CoreLender(board, 2, cores=3)
    assert capped.available(now=time.monotonic() + 1) == 3  # never more than the process may run on


def test_every_layer_runs_on_the_cores_available_when_it_starts(board: Path) -> None:
    enc, pd = CoreLender(board, 1, cores=2), CoreLender(board, 1, cores=2)
    seen: list[int] = []

    class Layer(nn.Module):
        def __init__(self, i: int) -> None:
            super().__init__()
            self.i = i

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.get_num_threads())
            if self.i == 1:  # an encode starts while the second layer runs
                enc.board.mark(enc.own, True, time.monotonic())
            return x + 1

    model = nn.Sequential(nn.ModuleList([Layer(i) for i in range(4)]))
    pd.attach(model)
    with pd.computing():
        x = torch.zeros(2)
        for layer in model[0]:
            x = layer(x)
    assert seen == [2, 2, 1, 1]
    assert x.tolist() == [4.0, 4.0]


def test_a_loan_names_the_flags_a_kernel_reads_to_hand_cores_back(board: Path) -> None:
    enc, pd, busy = CoreLender(board, 2, cores=4), CoreLender(board, 1, cores=4), CoreLender(board, 1, cores=4)
    busy.board.mark(1, True, time.monotonic())
    with pd.computing() as n:
        assert n == 2 and pd.loan is not None and pd.loan.own == 1  # a share of the encoder's cores
        (address,) = pd.loan.flags.tolist()  # the encoder's flag: the busy role lends nothing
        flag = ctypes.c_int32.from_address(address)  # where a compiled kernel reads it
        assert flag.value == 0
        enc.board.mark(2, True, time.monotonic())
        assert flag.value == 1
        assert pd.refresh() == 1 and pd.loan is None  # nothing is borrowed any more
    enc.board.mark(2, False, 0.0)
    assert pd.refresh() == 2 and pd.loan is not None
    for role in (busy, enc, pd):
        role.close()
    assert pd.loan is None  # its flags' addresses went with the board's map


def test_a_yielding_role_stands_aside_for_the_urgent_step_running_now(board: Path) -> None:
    enc, pd = CoreLender(board, 1, cores=2, yields=True), CoreLender(board, 1, cores=2)
    waited: list[float] = []
    with enc.computing():
        with pd.computing():  # a step no decode waits on: the encoder keeps its core
            assert enc.stand_aside() == 0.0 and pd.available() == 1
        with pd.computing(urgent=True):
            aside = threading.Thread(target=lambda: waited.append(enc.stand_aside()))
            aside.start()
            assert wait_until(lambda: pd.available() == 2, 5), "the urgent step may take the encoder's core"
            time.sleep(0.05)
            assert aside.is_alive(), "the encoder waits for the urgent step to end"
        aside.join(5)
        assert not aside.is_alive() and waited[0] >= 0.05
        assert pd.available() == 1  # computing again: its core is its own
    assert enc.yielded_s == waited[0] == enc.take_yielded() and enc.take_yielded() == 0.0


def test_a_yielding_role_computes_between_two_urgent_steps(board: Path) -> None:
    enc, pd = CoreLender(board, 1, cores=2, yields=True), CoreLender(board, 1, cores=2)
    waited: list[float] = []
    with enc.computing():
        first = pd.computing(urgent=True)
        first.__enter__()
        aside = threading.Thread(target=lambda: waited.append(enc.stand_aside()))
        aside.start()
        assert wait_until(lambda: pd.available() == 2, 5)
        first.__exit__(None, None, None)
        with pd.computing(urgent=True):  # the next step starts at once, urgent too
            aside.join(5)
            assert not aside.is_alive(), "it waited for the step that ran, not for the next"
            assert pd.available() == 1
    assert len(waited) == 1


def test_a_role_stands_aside_half_its_time_at_most(board: Path) -> None:
    enc, pd = CoreLender(board, 1, cores=2, yields=True), CoreLender(board, 1, cores=2)
    waited: list[float] = []
    with enc.computing():
        with pd.computing(urgent=True):
            aside = threading.Thread(target=lambda: waited.append(enc.stand_aside()))
            aside.start()
            time.sleep(0.1)
        aside.join(5)
        with pd.computing(urgent=True):  # the next urgent step: the encoder computes first, as long
            assert enc.stand_aside() == 0.0 and pd.available() == 1
            time.sleep(waited[0])
            aside = threading.Thread(target=lambda: waited.append(enc.stand_aside()))
            aside.start()
            assert wait_until(lambda: pd.available() == 2, 5), "then it stands aside again"
        aside.join(5)
    assert len(waited) == 2 and waited[0] >= 0.1


def test_the_share_of_its_time_a_role_stands_aside_is_one_setting(board: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After standing aside for t seconds a role computes t × (1 − share) / share before it stands
    aside again: at a quarter, three times as long."""
    monkeypatch.setattr(lending, "YIELD_MAX_S", 0.05)
    enc, pd = CoreLender(board, 1, cores=2, yields=True), CoreLender(board, 1, cores=2)
    with enc.computing(), pd.computing(urgent=True):  # an urgent step that never ends
        for share, stands in ((0.5, True), (0.25, False)):
            monkeypatch.setattr(lending, "YIELD_SHARE", share)
            enc._stood, enc._resumed = 1.0, time.monotonic() - 2.0  # stood 1 s, computed 2 s since
            assert (enc.stand_aside() > 0) is stands


def test_a_role_stands_aside_for_a_bounded_time(board: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lending, "YIELD_MAX_S", 0.05)
    enc, pd = CoreLender(board, 1, cores=2, yields=True), CoreLender(board, 1, cores=2)
    with enc.computing(), pd.computing(urgent=True):  # an urgent step that never ends
        assert 0.05 <= enc.stand_aside() < 5
        assert pd.available() == 1


def test_only_a_yielding_role_stands_aside_between_its_layers(board: Path) -> None:
    calls: list[float] = []
    for yields in (False, True):
        enc = CoreLender(board, 1, cores=2, yields=yields)
        enc.stand_aside = lambda: calls.append(1.0) or 0.0  # type: ignore[method-assign]
        model = nn.Sequential(nn.ModuleList([nn.Identity(), nn.Identity()]))
        enc.attach(model)
        for layer in model[0]:
            layer(torch.zeros(1))
        enc.close()
    assert len(calls) == 2  # the yielding one's two layers


def test_a_worker_is_urgent_while_a_prompt_holds_its_decodes(board: Path, model_dir: Path) -> None:
    eng = EngineCore.from_pretrained(model_dir, EngineConfig(max_num_batched_tokens=64, num_kv_blocks=256))
    eng.lender = CoreLender(board, 1, cores=2)  # as a worker of a model with large weights gets
    enc = CoreLender(board, 1, cores=2, yields=True)
    seen: list[tuple[bool, bool]] = []  # per step: a decode waits on a prompt; the encoder sees it urgent
    execute = eng.runner.execute

    def watched(plan):
        seen.append((plan.holds_decodes, bool(enc._urgent_steps())))
        return execute(plan)

    eng.runner.execute = watched  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    eng.add_request(Request("a", list(range(10, 30)), params))
    eng.step()  # a's prompt alone
    eng.step()  # a decodes alone
    eng.add_request(Request("b", list(range(40, 70)), params))
    while eng.has_work:
        eng.step()
    assert seen[:3] == [(False, False), (False, False), (True, True)]  # b's prompt beside a's decode
    assert all(held == urgent for held, urgent in seen) and not enc._urgent_steps()
    eng.lender.close()
    enc.close()


def test_a_killed_role_lends_its_cores_and_its_slot_is_taken_again(board: Path) -> None:
    code = (
        "import sys, time; from epdserve.kernels.lending import CoreLender\n"
        f"l = CoreLender({str(board)!r}, 1, cores=2)\n"
        "l.board.mark(1, True, time.monotonic()); print(l.board.slot, flush=True); time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        slot = int(child.stdout.readline())
        pd = CoreLender(board, 1, cores=2)
        assert pd.available() == 1  # the child computes
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        assert pd.available() == 2  # killed while computing: its core is free
        assert CoreLender(board, 1, cores=2).board.slot == slot  # a restarted role takes the slot
    finally:
        child.kill()
        child.wait()


def test_a_board_is_full_at_its_slots(board: Path) -> None:
    from epdserve.common.core_board import SLOTS

    seats = [Board(board) for _ in range(SLOTS)]
    for s in seats:
        s.claim(1)
    with pytest.raises(ValueError, match="full"):
        Board(board).claim(1)
    with pytest.raises(ValueError, match="between 1 and"):
        Board(board).claim(0)


def test_a_new_board_removes_those_whose_up_was_killed_and_nothing_else(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"epd-cores-{dead.pid}-0123456789ab"
    live = tmp_path / f"epd-cores-{os.getpid()}-0123456789ab"
    unrelated = tmp_path / f"epd-cores-{dead.pid}"  # no random part: still a board name of a dead pid
    other = tmp_path / "epd-slab-1-x"
    for p in (stale, live, unrelated, other):
        p.write_bytes(b"\0" * SIZE)
    linked = tmp_path / f"epd-cores-{dead.pid}-link"
    linked.symlink_to(other)
    made = make_board(tmp_path)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted([live.name, other.name, made.name, linked.name])
