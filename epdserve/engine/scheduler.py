"""Continuous batching with chunked prefill under a per-step token budget.

Each step: running requests first (a decode token each, or their next prefill chunk), then
waiting requests join while the token budget, the sequence limit and the KV cache allow —
text-only requests before those with media, unless one with media has waited too long — and,
among those whose media the vision tower must encode here, while the step's vision work stays
within ``vision_step_s``. The first of them joins past the bound only in a step that carries no
prompt (the running requests all decode): a prompt whose first token the step gives, or whose
next chunk it runs, never waits for another request's images beyond the bound. One that has
waited long and is held for such a prompt lets no new prompt start ahead of it, so it joins as
soon as the prompts in progress end. A request with an image whose forward alone would take
longer than ``vision_slice_s`` joins no step until that image is encoded, in slices between steps
(``engine.vision_slices``); the plan names the first such request and image. When a running
request cannot get a block, the most recently admitted running request is preempted (blocks
freed, recomputed later) — the engine never crashes for lack of memory.

The plan (``SchedulerOutput``) holds request references and token counts only, no tensors.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from epdserve.engine.block_manager import BlockManager
from epdserve.engine.config import EngineConfig
from epdserve.engine.request import Request, Status


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def end(self) -> int:
        return self.request.num_computed_tokens + self.num_new_tokens

    @property
    def samples(self) -> bool:
        """Whether this step produces a token for the request (its chunk reaches the last token)."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # the first waiting request with an image to encode in slices, and that image (a MediaItem)
    slice: tuple[Request, Any] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def decoding(self) -> bool:
        """Whether some request of the step decodes."""
        return any(s.start >= s.request.prompt_len for s in self.scheduled)

    @property
    def holds_decodes(self) -> bool:
        """Whether a prompt's chunk runs beside requests that are decoding (they wait on it)."""
        return self.decoding and any(s.num_new_tokens > 1 for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # set by the engine core: starts fetching media an admitted request's cached prefix does
        # not cover after all, True when the request must wait for them
        self.media_needed: Callable[[Request], bool] | None = None
        # set by the engine core: seconds the vision tower would spend on a request's prompt
        # positions [start, end)
        self.vision_cost: Callable[[Request, int, int], float] | None = None
        # set by the engine core: the image of a request, at or past a prompt position, to encode
        # in slices between steps (None: none)
        self.sliced_item: Callable[[Request, int], Any] | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.blocks.allocate(req, n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                out.scheduled = [s for s in out.scheduled if s.request is not victim]
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue  # preempted itself; the list shrank
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
            i += 1
        # 2. waiting requests join while everything allows: text-only ones first, so a burst of
        #    image prompts does not hold a short text prompt back; the rest in arrival order. One
        #    that has waited ``media_max_wait_s`` joins the first group (nothing starves).
        now = time.perf_counter()
        order = sorted(self.waiting, key=lambda r: not self._first(r, now))  # stable: FIFO within
        sliced = {id(r): it for r in order if (it := self._sliced(r)) is not None}
        first = next((r for r in order if id(r) in sliced), None)
        out.slice = (first, sliced[id(first)]) if first is not None else None
        vision = sum(self._vision(s.request, s.start, s.end) for s in out.scheduled)
        vision_full = False  # a request was held back for the vision budget: later media wait too
        prompts = any(s.start < s.request.prompt_len for s in out.scheduled)  # a prompt is in this step
        for req in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs or out.preempted:
                break
            if not req.ready or id(req) in sliced:
                continue
            if req.kv_rows is not None:  # its prompt's KV came from a prefill instance
                req.num_computed_tokens = req.prompt_len
            elif not req.block_ids:
                self.blocks.take_cached(req, self.blocks.match_prefix(req))
                if self.media_needed is not None and self.media_needed(req):
                    # blocks it counted on were evicted: it waits for media it skipped fetching
                    self.blocks.free(req)
                    req.num_computed_tokens = req.num_cached_tokens = 0
                    continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            cost = self._vision(req, req.num_computed_tokens, req.num_computed_tokens + n) if req.kv_rows is None else 0
            if cost and (vision_full or ((vision or prompts) and vision + cost > self.config.vision_step_s)):
                # the step's vision work is full, or a prompt of this step would wait for more
                # vision work than the bound: it waits (with the media behind it) for the next
                vision_full = True
                self.blocks.free(req)
                req.num_computed_tokens = req.num_cached_tokens = 0
                if not vision and self._first(req, now):
                    break  # it waited long: no new prompt starts ahead of it, so it joins soon
                continue
            if not self.blocks.allocate(req, n):
                self.blocks.free(req)
                req.num_computed_tokens = 0
                break
            vision += cost
            prompts = prompts or req.num_computed_tokens < req.prompt_len
            self.waiting.remove(req)
            req.status = Status.RUNNING
            req.t_admitted = req.t_admitted or time.perf_counter()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return out

    def _sliced(self, req: Request) -> Any:
        """The image a waiting request waits for, encoded in slices; None when it has none."""
        if self.sliced_item is None or not req.mm_items or not req.ready or req.kv_rows is not None:
            return None
        item = self.sliced_item(req, 0)
        if item is not None and self.blocks.enable_prefix_caching:
            # an image whose KV is cached is not needed again
            item = self.sliced_item(req, self.blocks.match_prefix(req, count=False).num_tokens)
        return item

    def _vision(self, req: Request, start: int, end: int) -> float:
        if self.vision_cost is None or not self.config.vision_step_s or not req.mm_items or start >= req.prompt_len:
            return 0.0  # (a decode token reaches no media)
        return self.vision_cost(req, start, end)

    def _first(self, req: Request, now: float) -> bool:
        """Whether a waiting request is admitted in the first group: text-only, or waited long."""
        return not req.mm_items or now - req.t_added >= self.config.media_max_wait_s

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free(req)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: str) -> None:
        """Retire a request (finished, aborted or failed) and release its blocks."""
        req.status = Status.FINISHED
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.blocks.free(req)
