"""``POST /v1/completions``: OpenAI's text completions, for clients and tools that send a raw
prompt (no chat template, no media). The sampling fields are chat's and are validated the same way
(``as_chat``); the answer is a ``text_completion`` (streamed as chunks of the same shape)."""

from __future__ import annotations

from typing import Literal

import msgspec

from epdserve.api.errors import BadRequest
from epdserve.api.protocol import ChatRequest, StreamOptions, Usage, param_of

DEFAULT_MAX_TOKENS = 16  # OpenAI's and vLLM's default for completions


class CompletionRequest(msgspec.Struct, kw_only=True):
    model: str = ""  # optional: the served model
    prompt: str | list[int]  # text, or token ids
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = False
    n: int | None = 1
    echo: bool | None = False
    logprobs: int | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def as_chat(self) -> ChatRequest:
        """The same sampling fields as a chat request, for the one validation of them."""
        return ChatRequest(
            model=self.model,
            messages=[],
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            ignore_eos=self.ignore_eos,
            n=self.n,
        )


def decode_completion_request(body: bytes, max_prompt_chars: int) -> CompletionRequest:
    try:
        req = msgspec.json.decode(body, type=CompletionRequest)
    except msgspec.ValidationError as e:
        msg = str(e)
        raise BadRequest(f"Invalid request: {msg}", param=param_of(msg)) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"Request body is not valid JSON: {e}") from None
    if isinstance(req.prompt, str) and len(req.prompt) > max_prompt_chars:
        raise BadRequest(f"The prompt has more than {max_prompt_chars} characters.", param="prompt")
    if not req.prompt:
        raise BadRequest("The prompt is empty.", param="prompt")
    if req.n is not None and req.n != 1:
        raise BadRequest(f"Only n=1 is supported, got n={req.n}.", param="n")
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
