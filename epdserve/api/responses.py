"""What the OpenAI-compatible endpoints answer: chat completions, streamed chunks, token logprobs
and the model list, with their JSON and server-sent-event encoding and the ids and timestamps they
carry. The requests and their validation are ``api.protocol``'s."""

from __future__ import annotations

import time
import uuid
from typing import Any, Final, Literal

import msgspec

from epdserve.api.errors import ApiError

FinishReason = Literal["stop", "length"]


class Usage(msgspec.Struct, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class TopLogprob(msgspec.Struct, kw_only=True):
    """One of the most likely tokens at a position (OpenAI's ``top_logprobs`` entries)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(msgspec.Struct, kw_only=True):
    """The chosen token at a position: its text, logprob, UTF-8 bytes and the alternatives."""

    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's own bytes: those of a split character join up
    top_logprobs: list[TopLogprob] = msgspec.field(default_factory=list)


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    """A choice's ``logprobs``; the choice carries ``"logprobs": null`` when they were not asked."""

    content: list[TokenLogprob] | None = None


class ResponseMessage(msgspec.Struct, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class Choice(msgspec.Struct, kw_only=True):
    index: int = 0
    message: ResponseMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletion(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: Usage | None = None


class PrefillCompletion(ChatCompletion, kw_only=True):
    """A prefill instance's answer to ``do_remote_decode`` (internal): the first token as a
    completion, and ``{"kv_handle", "first_token_id"}`` when a decode instance is to continue
    (None when the answer is already complete)."""

    kv_transfer_params: dict[str, Any] | None = None


class Delta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Streamed message increment; unset fields are left out, as in OpenAI's chunks."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(msgspec.Struct, kw_only=True):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None  # only on the final chunk when stream_options.include_usage is set


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "epdserve"
    max_model_len: int | None = None


class ModelList(msgspec.Struct, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelCard]


SSE_DONE: Final = b"data: [DONE]\n\n"  # the last event of every stream


def new_completion_id(prefix: str = "chatcmpl") -> str:
    """OpenAI's style of id: ``chatcmpl-…`` for chat, ``cmpl-…`` for text completions."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """OpenAI's ``created`` field: Unix seconds."""
    return int(time.time())


def encode_json(obj: msgspec.Struct) -> bytes:
    return msgspec.json.encode(obj)


def sse_event(obj: msgspec.Struct) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


def sse_error(err: ApiError) -> bytes:
    """An error reported inside an already-started stream (the HTTP status is already sent)."""
    return b"data: " + err.to_json() + b"\n\n"
