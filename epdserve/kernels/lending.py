"""Lending idle cores between the roles that share a host.

Pinned, each role of a small E+PD deployment computes on cores of its own, so that a decode step
never waits for an encode. But each is idle much of the time: the encoder between images, the
language model while it waits for them. Through a core board (``common.core_board``) a computing
role borrows the cores of those that are not: it marks itself computing around each unit of work,
and before each layer reads the board and runs on its own cores plus its share of the idle ones.
A role that starts computing takes its cores back at the borrowers' next layer: where a step runs
the whole decoder stack in one call (``kernels.fused``), the compiled stack reads the lenders'
flags on the board itself before each layer (``Loan``).

A role whose work only delays first tokens (an encoder) also stands aside for one whose running
decodes wait: a step that prefills a prompt beside decoding requests is marked urgent, and while
one is, a yielding role pauses between its layers, its cores lent, so that the step runs on every
core and the decodes it holds resume sooner; for half its time at most (``YIELD_SHARE``), so
that a stream of such steps slows its work by half, not more.

The board is advisory: what is read from it only sets a thread count, clamped to the cores the
process may run on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple, ParamSpec, TypeVar

import torch

from epdserve.common.core_board import Board
from epdserve.kernels.parallel import affinity_cores

# a role that stopped computing this recently is about to compute again (the gap between steps)
GRACE_S = 0.02
# a yielding role waits this long at most for an urgent one (whose step may have hung), polling
YIELD_MAX_S = 10.0
YIELD_POLL_S = 0.002
# a yielding role stands aside for this share of its time at most, so that a stream of urgent
# steps slows its work by that share, not more
YIELD_SHARE = 0.5

P = ParamSpec("P")
R = TypeVar("R")


class Loan(NamedTuple):
    """The cores a unit of work runs on beyond its role's own: ``own`` threads without them, and
    ``flags``, the addresses (int64) of the lenders' computing flags in this process's map of the
    board, which a compiled kernel reads to hand the cores back mid-call."""

    own: int
    flags: torch.Tensor


class CoreLender:
    """This process's seat on a board: ``computing`` around each unit of work, ``attach`` to a model
    so that every layer runs on the cores available when it starts."""

    def __init__(self, path: str | Path, own: int, cores: int | None = None, *, yields: bool = False) -> None:
        """Claims a slot of the board at ``path`` for ``own`` cores; ``cores``: the most threads it
        runs on (default: the cores this process may run on); ``yields``: pause between layers
        while another role computes urgently."""
        self.board = Board(path)
        self.board.claim(own)
        self.own = own
        self.cores = cores or affinity_cores()
        self.yields = yields
        self.yielded_s = 0.0  # seconds spent standing aside, in all
        self._yielded_taken = 0.0  # as of the last ``take_yielded``
        self._resumed, self._stood = 0.0, 0.0  # when it last stood aside, and for how long
        self.loan: Loan | None = None  # the cores borrowed as of the last ``refresh``
        self._flags: tuple[int, ...] = ()  # its lenders' flags, as ``_survey`` gives them

    def available(self, now: float | None = None) -> int:
        """Cores to compute on now: this role's own, and its share (by own cores, among the roles
        computing) of those of the roles that are idle."""
        return self._survey(now)[0]

    def _survey(self, now: float | None = None) -> tuple[int, tuple[int, ...]]:
        """``available()``, and the computing flags of the roles idle now (the lenders)."""
        now = time.monotonic() if now is None else now
        idle = busy = 0
        flags = []
        for seat in self.board.others():
            if seat.computing or now - seat.last < GRACE_S:
                busy += seat.own
            else:
                idle += seat.own
                flags.append(seat.flag)
        share = idle * self.own // (self.own + busy)
        return max(1, min(self.own + share, self.cores)), tuple(flags)

    def refresh(self) -> int:
        """Set torch's intra-op threads of the calling thread to ``available()``; ``loan`` says
        which of them are borrowed."""
        n, flags = self._survey()
        if n != torch.get_num_threads():
            torch.set_num_threads(n)
        own = max(1, min(self.own, self.cores))
        if n <= own:
            self.loan = None
        elif self.loan is None or flags != self._flags:
            self.loan, self._flags = Loan(own, torch.tensor(flags, dtype=torch.int64)), flags
        return n

    @contextlib.contextmanager
    def computing(self, urgent: bool = False) -> Iterator[int]:
        """Marks this role computing for the block (its own cores are then not lent; ``urgent``:
        running decodes wait on it), which runs on the cores available at its start (``attach``
        updates them layer by layer)."""
        self.board.mark(self.own, True, time.monotonic(), urgent)
        try:
            yield self.refresh()
        finally:
            self.board.mark(self.own, False, time.monotonic())

    def stand_aside(self) -> float:
        """If other roles compute urgently, mark this one idle (its cores lent at once) until the
        steps they run now end (not later ones), or ``YIELD_MAX_S`` has passed, then computing
        again; the seconds it waited. ``YIELD_SHARE`` of its time at most: after standing aside for t
        seconds it computes t × (1 − share) / share (as long again, at a half) before it does so
        again."""
        if time.monotonic() - self._resumed < self._stood * (1 - YIELD_SHARE) / YIELD_SHARE:
            return 0.0
        steps = self._urgent_steps()
        if not steps:
            return 0.0
        t0 = time.monotonic()
        self.board.mark(self.own, False, t0 - GRACE_S)  # idle now, not "about to compute again"
        try:
            while steps & self._urgent_steps() and time.monotonic() - t0 < YIELD_MAX_S:
                time.sleep(YIELD_POLL_S)
        finally:
            self.board.mark(self.own, True, time.monotonic())
        self._resumed = time.monotonic()
        self._stood = waited = self._resumed - t0
        self.yielded_s += waited
        return waited

    def take_yielded(self) -> float:
        """Seconds spent standing aside since the last call."""
        taken, self._yielded_taken = self.yielded_s - self._yielded_taken, self.yielded_s
        return taken

    def _urgent_steps(self) -> set[tuple[int, float]]:
        """The urgent steps running now, each as its role's flag and when it started."""
        return {(seat.flag, seat.last) for seat in self.board.others() if seat.urgent}

    def wrap(self, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn`` run inside ``computing``."""

        def computing_fn(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.computing():
                return fn(*args, **kwargs)

        return computing_fn

    def attach(self, model: torch.nn.Module) -> None:
        """Refresh the thread count before each layer of ``model`` (every element of its module
        lists: decoder layers, vision blocks), first standing aside if this role yields."""
        for m in model.modules():
            if isinstance(m, torch.nn.ModuleList):
                for layer in m:
                    layer.register_forward_pre_hook(self._before_layer)

    def _before_layer(self, module: torch.nn.Module, args: object) -> None:
        if self.yields:
            self.stand_aside()
        self.refresh()

    def close(self) -> None:
        """Give the slot back (and the loan: its flags' addresses lie in the board's map)."""
        self.loan = None
        self.board.close()
