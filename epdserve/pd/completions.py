"""``POST /v1/completions`` on a language-model instance: a raw prompt (text or token ids)
through the same engine, sampling, detokenization, metrics and access lines as chat."""

from __future__ import annotations

import asyncio
import contextlib
import time

from aiohttp import web

from epdserve.api import logs
from epdserve.api.auth import is_internal
from epdserve.api.completions import Completion, CompletionChoice, CompletionRequest, decode_completion_request
from epdserve.api.errors import ApiError, BadRequest, NotFound, context_too_long
from epdserve.api.http import json_response, read_body
from epdserve.api.logs import request_id
from epdserve.api.protocol import to_sampling_params
from epdserve.api.quota import Quotas, check_max_tokens
from epdserve.api.responses import SSE_DONE, Usage, encode_json, new_completion_id, now_s, sse_error, sse_event
from epdserve.api.tokenizer import TooManyTokens
from epdserve.engine.messages import AddRequest
from epdserve.pd.generation import Generation, Piece, WorkerFailedMidStream
from epdserve.pd.service import ChatService


class CompletionHandlers:
    def __init__(self, service: ChatService) -> None:
        self.s = service

    async def _prepare(self, body: bytes) -> tuple[CompletionRequest, AddRequest]:
        cfg = self.s.config
        req = decode_completion_request(body, cfg.max_prompt_chars)
        if req.model and req.model != cfg.model_name:
            raise NotFound.model(req.model)
        params = to_sampling_params(req, cfg.default_max_tokens, cfg.engine.max_model_len)
        check_max_tokens(req, cfg.quota.max_tokens_limit)
        limit = cfg.engine.max_model_len
        if isinstance(req.prompt, str):
            loop = asyncio.get_running_loop()
            tok, text, budget = self.s.tokenizer, req.prompt, limit - params.max_tokens
            try:
                ids = await loop.run_in_executor(self.s.template_executor, lambda: tok.encode_within(text, budget))
            except TooManyTokens as e:
                raise context_too_long(limit, e.at_least, params.max_tokens, param="prompt") from None
        else:
            ids = list(req.prompt)
            vocab = self.s.model_config.text.vocab_size
            if any(not 0 <= t < vocab for t in ids):
                raise BadRequest(f"prompt token ids must be in [0, {vocab}).", param="prompt")
        if len(ids) + params.max_tokens > limit:
            raise BadRequest(
                f"This model's maximum context length is {limit} tokens, but {len(ids) + params.max_tokens} were "
                f"requested ({len(ids)} in the prompt, {params.max_tokens} in the completion).",
                param="max_tokens",
            )
        add = AddRequest(new_completion_id("cmpl"), ids, params, eos_token_ids=self.s.eos,
                         arrival=time.time())  # fmt: skip
        return req, add

    async def completions(self, request: web.Request) -> web.StreamResponse:
        s = self.s
        t0 = time.perf_counter()
        rid = request_id(request.headers)
        ticket = None
        try:
            if not is_internal(request):  # a client's share (api.quota); the router counted its calls
                ticket = s.quotas.admit(Quotas.client(request))
            req, add = await self._prepare(await read_body(request))
            if ticket is not None:
                ticket.reserve(len(add.prompt_token_ids) + add.params.max_tokens)
            gen, first = await Generation.started(s, add)
        except BaseException as e:
            if ticket is not None:
                ticket.failed()
            if not isinstance(e, ApiError):
                raise
            s.count("text", e.status)
            logs.access(id=rid, status=e.status, kind="text", e2e_ms=1e3 * (time.perf_counter() - t0), error=e.code)
            raise
        s.count("text", 200)
        ttft = time.perf_counter() - t0
        s.ttft.observe(ttft)
        last = first
        used = None  # tokens the answer used, once known (a stream keeps what it reserved)
        try:
            async with contextlib.aclosing(gen.rest()) as rest:
                if req.stream:
                    return await self._stream(request, req, add, first, rest)
                text = [first.text]
                if first.finish_reason is None:
                    async for piece in rest:
                        text.append(piece.text)
                        last = piece
                used = last.prompt_tokens + last.completion_tokens
                return json_response(encode_json(self._answer(add, "".join(text), last)))
        finally:
            if ticket is not None:
                ticket.done(used)
            e2e = time.perf_counter() - t0
            s.e2e.observe(e2e)
            logs.access(id=rid, status=200, kind="text", endpoint="completions", ttft_ms=1e3 * ttft,
                        e2e_ms=1e3 * e2e)  # fmt: skip

    def _answer(self, add: AddRequest, text: str, last: Piece, usage: bool = True) -> Completion:
        return Completion(
            id=add.request_id,
            created=now_s(),
            model=self.s.config.model_name,
            choices=[CompletionChoice(text=text, finish_reason=last.finish_reason)],
            usage=Usage.of(last.prompt_tokens, last.completion_tokens) if usage else None,
        )

    async def _stream(
        self, request: web.Request, req: CompletionRequest, add: AddRequest, first: Piece, rest
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            last = first
            try:
                await resp.write(sse_event(self._answer(add, first.text, first, usage=False)))
                if first.finish_reason is None:
                    async for piece in rest:
                        last = piece
                        if piece.text or piece.finish_reason:
                            await resp.write(sse_event(self._answer(add, piece.text, piece, usage=False)))
                if req.include_usage:
                    done = Completion(id=add.request_id, created=now_s(), model=self.s.config.model_name, choices=[],
                                      usage=Usage.of(last.prompt_tokens, last.completion_tokens))  # fmt: skip
                    await resp.write(sse_event(done))
            except WorkerFailedMidStream as e:
                await resp.write(sse_error(e.error))
            await resp.write(SSE_DONE)
            await resp.write_eof()
        return resp
