"""One request's engine outputs turned into what the client is sent: text pieces (incremental
detokenization, stop strings), logprobs, the finish reason, and the engine's errors as HTTP errors."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.api.errors import EMBEDS_UNAVAILABLE, ApiError, BadRequest, Unavailable
from epdserve.api.responses import FinishReason, TokenLogprob
from epdserve.engine.detokenizer import Detokenizer
from epdserve.engine.messages import AddRequest, EngineOutput, StageTimes

log = logging.getLogger(__name__)


if TYPE_CHECKING:
    from epdserve.pd.service import ChatService


@dataclass
class Piece:
    """What the client is sent for one engine output: text, logprobs, and the end when it came."""

    text: str
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    kv: dict | None = None  # prefill instance: what the decode instance continues from
    stages: StageTimes | None = None  # the engine core's stage times (first piece only)


class Generation:
    """One request's engine outputs turned into text: incremental detokenization, stop strings
    (which end the request in the core), and OpenAI logprobs."""

    def __init__(self, service: ChatService, add: AddRequest) -> None:
        self.s = service
        self.detok = Detokenizer(service.tokenizer, add.params.stop)
        self.completion_tokens = 0
        self.prompt_tokens = len(add.prompt_token_ids)
        if add.kv is not None and add.kv.first_token is not None:
            # a decode instance continues after a token the prefill instance already sent: the
            # detokenizer starts where the prefill instance's stood, its text is not sent again
            self.detok.push([add.kv.first_token])
            self.completion_tokens = 1
        self._outputs = service.core.generate(add)
        self.add = add.sent()  # the core has the pixels now

    async def aclose(self) -> None:
        await self._outputs.aclose()  # type: ignore[attr-defined]

    @classmethod
    async def started(cls, service: ChatService, add: AddRequest) -> tuple[Generation, Piece]:
        """A generation and its first piece (the request is aborted if that fails)."""
        gen = cls(service, add)
        try:
            return gen, await gen.first()
        except BaseException:
            await gen.aclose()
            raise

    async def first(self) -> Piece:
        """The first piece; raises the request's error as an HTTP error (nothing is sent yet)."""
        out = await anext(self._outputs)
        if out.finish_reason == "error":
            raise _engine_error(out)
        return self._piece(out)

    async def rest(self) -> AsyncGenerator[Piece, None]:
        async for out in self._outputs:
            yield self._piece(out)
            if out.finish_reason is not None or self.detok.stopped:
                return

    def _piece(self, out: EngineOutput) -> Piece:
        if out.finish_reason == "error":
            raise WorkerFailedMidStream(_engine_error(out))
        self.completion_tokens += len(out.token_ids)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        finish = out.finish_reason
        if finish == "transferred":  # a decode instance continues the answer: nothing is final yet
            finish = None
        text = self.detok.push(out.token_ids, final=finish is not None)
        p = self.add.params
        if finish is None and self.detok.stopped and self.completion_tokens >= p.min_tokens:
            finish = "stop"  # a stop string: the core is told to stop when this stream closes
            text += self.detok.push([], final=True)
        logprobs = None
        if p.logprobs and out.logprobs is not None:
            logprobs = [
                self.s.tokens.logprob(t, lp, top[i] if (top := out.top_logprobs) else [])
                for i, (t, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True))
            ]
        kv = None
        if out.kv_handle is not None:
            if finish is None:
                kv = {"kv_handle": out.kv_handle, "first_token_id": out.token_ids[0]}
            else:  # a stop string ended the answer with its first token: nobody will read the KV
                self.s.core.release([], [out.kv_handle])
        return Piece(text, logprobs, _finish(finish), self.prompt_tokens, self.completion_tokens, kv, out.stages)


class WorkerFailedMidStream(Exception):
    def __init__(self, error: ApiError) -> None:
        super().__init__(error.message)
        self.error = error


def _finish(reason: str | None) -> FinishReason | None:
    if reason == "stop":
        return "stop"
    if reason == "length":
        return "length"
    return None


def _engine_error(out: EngineOutput) -> ApiError:
    message = out.error or "the request failed"
    if out.error_kind in ("invalid_handle", "invalid_request"):
        return BadRequest(message)
    if out.error_kind == "embeddings_unavailable":
        return Unavailable(message, code=EMBEDS_UNAVAILABLE)
    if out.error_kind == "media":
        return Unavailable(message)
    return ApiError(message)
