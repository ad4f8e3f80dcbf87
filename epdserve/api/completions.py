"""``POST /v1/completions``: OpenAI's text completions, for clients and tools that send a raw
prompt (no chat template, no media). The sampling fields are chat's (``SamplingRequest``) and are
validated the same way; the answer is a ``text_completion`` (streamed as chunks of the same shape)."""

from __future__ import annotations

from typing import Literal

import msgspec

from epdserve.api.errors import BadRequest
from epdserve.api.protocol import SamplingRequest, decode_request
from epdserve.api.responses import Usage

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


class CompletionRequest(SamplingRequest, kw_only=True):
    prompt: str | list[int]  # text, or token ids
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    echo: bool | None = False
    logprobs: int | None = None  # refused: logprobs are returned by chat completions


def decode_completion_request(body: bytes, max_prompt_chars: int) -> CompletionRequest:
    req = decode_request(body, CompletionRequest)
    if isinstance(req.prompt, str) and len(req.prompt) > max_prompt_chars:
        raise BadRequest(f"The prompt has more than {max_prompt_chars} characters.", param="prompt")
    if not req.prompt:
        raise BadRequest("The prompt is empty.", param="prompt")
    if req.echo:
        raise BadRequest("echo is not supported.", param="echo")
    if req.logprobs is not None:
        raise BadRequest("logprobs are supported on /v1/chat/completions, not here.", param="logprobs")
    return req


class CompletionChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class Completion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
