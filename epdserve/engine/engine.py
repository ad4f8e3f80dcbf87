"""The engine: schedule → execute → update, and its asyncio front running in a thread.

``LLMEngine`` is synchronous and single-threaded. ``AsyncEngine`` runs its step loop in a
dedicated thread so the HTTP event loop stays responsive; requests and aborts cross over through
a locked inbox, outputs come back with one ``call_soon_threadsafe`` per event loop per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from epdserve.engine.config import EngineConfig
from epdserve.engine.detokenizer import IncrementalText
from epdserve.engine.model_runner import ModelRunner
from epdserve.engine.request import Request, Status
from epdserve.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    request_id: str
    text: str  # newly released text
    token_ids: list[int]  # newly generated token ids
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    error_status: int = 500  # HTTP status the error maps to (503: media/embeddings unavailable)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[float] = field(default_factory=list)


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig, dtype: torch.dtype = torch.float32) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.runner = ModelRunner(model, config, dtype, torch.device("cpu"))
        self.scheduler = Scheduler(config)
        self.requests: dict[str, Request] = {}
        self.texts: dict[str, IncrementalText] = {}
        self.num_steps = 0
        self.last_step_idle = False

    @classmethod
    def from_pretrained(
        cls, model_dir: str | Path, config: EngineConfig, vision: bool = True, dtype: torch.dtype = torch.float32
    ) -> LLMEngine:
        from transformers import AutoTokenizer

        from epdserve.models.loader import load_model

        parts = frozenset({"vision", "language"} if vision else {"language"})
        model, _ = load_model(model_dir, parts=parts, dtype=dtype)
        return cls(model, AutoTokenizer.from_pretrained(model_dir), config, dtype)

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"duplicate request id {req.request_id}")
        self.requests[req.request_id] = req
        self.texts[req.request_id] = IncrementalText(req.params.stop)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self.texts.pop(request_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ---- the step ----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.last_step_idle = not plan.scheduled
        if not plan.scheduled:
            return []
        try:
            result = self.runner.execute(plan)
        except Exception as e:  # never let one bad step kill the engine: fail this step's requests
            log.exception("engine step failed")
            return [self._fail(s.request, f"internal error: {e}", 500) for s in plan.scheduled]
        self.num_steps += 1
        outputs = [self._fail(self.requests[rid], msg, 503) for rid, msg in result.failed.items()]
        for s in plan.scheduled:
            req = s.request
            if req.request_id in result.failed:
                continue
            req.num_computed_tokens += s.num_new_tokens
            self.scheduler.blocks.commit(req)
            if req.request_id in result.sampled:
                tok, lp = result.sampled[req.request_id]
                outputs.append(self._append(req, tok, lp))
        return outputs

    def _append(self, req: Request, token: int, logprob: float) -> RequestOutput:
        req.output_token_ids.append(token)
        req.output_logprobs.append(logprob)
        p = req.params
        n_out = len(req.output_token_ids)
        reason = None
        if token in req.eos_token_ids and not p.ignore_eos and n_out > p.min_tokens - 1:
            reason = "stop"
        elif n_out >= p.max_tokens or req.num_tokens >= self.config.max_model_len:
            reason = "length"
        inc = self.texts[req.request_id]
        decoded = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
        delta = inc.update(decoded, final=reason is not None)
        if inc.stopped and n_out >= p.min_tokens and reason is None:
            reason = "stop"
            delta += inc.update(inc.text, final=True)
        out = RequestOutput(
            req.request_id,
            delta,
            [token],
            prompt_tokens=req.prompt_len,
            completion_tokens=n_out,
            cached_tokens=req.num_cached_tokens,
            logprobs=[logprob],
        )
        if reason is not None:
            out.finished, out.finish_reason = True, reason
            self._retire(req, reason)
        return out

    def _fail(self, req: Request, message: str, status: int) -> RequestOutput:
        self._retire(req, "error")
        return RequestOutput(
            req.request_id, "", [], True, "error", message, status, req.prompt_len, len(req.output_token_ids)
        )

    def _retire(self, req: Request, reason: str) -> None:
        if req.status is not Status.FINISHED:
            self.scheduler.finish(req, reason)
        self.requests.pop(req.request_id, None)
        self.texts.pop(req.request_id, None)


class AsyncEngine:
    """Runs ``LLMEngine.step`` in its own thread; ``generate`` is an async stream of outputs."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cv = threading.Condition()
        self._inbox: list[tuple[str, object]] = []
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="epd-engine", daemon=True)
        self.started = time.time()
        self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=10)

    def _post(self, kind: str, payload: object) -> None:
        with self._cv:
            self._inbox.append((kind, payload))
            self._cv.notify()

    async def generate(self, req: Request) -> AsyncGenerator[RequestOutput, None]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[req.request_id] = (loop, queue)
        self._post("add", req)
        finished = False
        try:
            while not finished:
                out = await queue.get()
                finished = out.finished
                yield out
        finally:
            self._streams.pop(req.request_id, None)
            if not finished:  # client went away: free the request's blocks
                self._post("abort", req.request_id)

    def _loop(self) -> None:
        if self.engine.config.threads:
            torch.set_num_threads(self.engine.config.threads)
        eng = self.engine
        while True:
            with self._cv:
                while not self._inbox and not eng.has_work and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                inbox, self._inbox = self._inbox, []
            for kind, payload in inbox:
                if kind == "add":
                    assert isinstance(payload, Request)
                    try:
                        eng.add_request(payload)
                    except Exception as e:
                        self._deliver([RequestOutput(payload.request_id, "", [], True, "error", str(e))])
                elif kind == "abort":
                    eng.abort(str(payload))
            if eng.has_work:
                self._deliver(eng.step())
                if eng.last_step_idle:  # only requests still waiting for their embeddings
                    with self._cv:
                        self._cv.wait(0.002)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)


def _put_all(items: list[tuple[asyncio.Queue[RequestOutput], RequestOutput]]) -> None:
    for q, out in items:
        q.put_nowait(out)
