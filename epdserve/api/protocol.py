"""The requests of the OpenAI-compatible endpoints: their wire schemas, who may send which fields,
and their validation into ``SamplingParams``; ``api.responses`` holds the answers.

Requests decode straight into msgspec Structs (unknown fields are ignored, as OpenAI clients
send extras); every problem becomes a ``BadRequest`` naming the offending field. Besides
OpenAI's ``text`` / ``image_url`` / ``input_audio`` parts we accept ``video_url`` and two
metadata-only parts that refer to embeddings an encoder worker already produced::

    {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, h, w]}, "uuid": "...", "ec_handle": {...}}
    {"type": "video_embeds", "video_embeds": {"video_grid_thw": [t, h, w], "second_per_grid": 1.0},
     "uuid": "...", "ec_handle": {...}}

(``second_per_grid``, optional: the seconds of video one temporal patch spans; absent, the
processor's fps) and, for audio models, ``audio_embeds`` with ``audio_grid_thw = [1, mel frames, 1]``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final, Literal, TypeVar

import msgspec

from epdserve.api.errors import BadRequest, PayloadTooLarge
from epdserve.common.sampling_params import SamplingParams
from epdserve.media.limits import MAX_SECOND_PER_GRID, MediaLimits

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
GridTHW = tuple[PositiveInt, PositiveInt, PositiveInt]
SecondPerGrid = Annotated[float, msgspec.Meta(gt=0, le=MAX_SECOND_PER_GRID)]  # finite: JSON has no NaN

MAX_STOP_STRINGS: Final = 4  # OpenAI's limit on `stop`
MAX_TOP_LOGPROBS: Final = 20  # OpenAI's limit on `top_logprobs`
# Far more text than any context this server is configured for holds, far less than a body that
# would stall templating and tokenization (a 50 MB prompt once held a worker for 38 s).
DEFAULT_MAX_PROMPT_CHARS: Final = 1 << 20
# The largest request body a role reads: room for several inline images or a short video as
# base64, one default for the encoder, the router and the language-model role.
DEFAULT_MAX_REQUEST_BYTES: Final = 64 << 20
DEFAULT_CHAT_MAX_TOKENS: Final = 256  # what a worker generates when a chat request sets no max_tokens
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_GREEDY_EPS: Final = 1e-5  # temperatures below this sample greedily (as vLLM does)

# --------------------------------------------------------------------------- content parts


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class ImageUrl(msgspec.Struct):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(msgspec.Struct, tag_field="type", tag="image_url"):
    image_url: ImageUrl


class VideoUrl(msgspec.Struct):
    url: str


class VideoUrlPart(msgspec.Struct, tag_field="type", tag="video_url"):
    video_url: VideoUrl


class InputAudio(msgspec.Struct):
    data: str  # base64 of the encoded audio (OpenAI's input_audio; no data: URL prefix)
    format: Literal["wav", "mp3", "flac"]


class InputAudioPart(msgspec.Struct, tag_field="type", tag="input_audio"):
    input_audio: InputAudio


EmbedsDtype = Literal["float32", "bfloat16", "float16"]


class ImageEmbeds(msgspec.Struct):
    image_grid_thw: GridTHW  # (1, h, w) in patches
    data: str | None = None  # inline embeddings: base64 of rows x width little-endian values (--enable-mm-embeds)
    dtype: EmbedsDtype = "float32"  # of ``data``


class ImageEmbedsPart(msgspec.Struct, tag_field="type", tag="image_embeds"):
    """An image already encoded elsewhere: its grid, content hash and encoder-cache handle."""

    image_embeds: ImageEmbeds
    uuid: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ec_handle: dict[str, Any] | None = None


class VideoEmbeds(msgspec.Struct):
    video_grid_thw: GridTHW  # (t, h, w) in patches
    data: str | None = None  # inline embeddings, as in ``ImageEmbeds``
    dtype: EmbedsDtype = "float32"
    # seconds of video one temporal patch spans (the sampled frames' spacing x temporal patch
    # size; Qwen2.5-VL's positions and Qwen3-VL's timestamps); None: the processor's fps
    second_per_grid: SecondPerGrid | None = None


class VideoEmbedsPart(msgspec.Struct, tag_field="type", tag="video_embeds"):
    """A video already encoded elsewhere: its grid, content hash and encoder-cache handle."""

    video_embeds: VideoEmbeds
    uuid: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ec_handle: dict[str, Any] | None = None


class AudioEmbeds(msgspec.Struct):
    audio_grid_thw: GridTHW  # (1, frames, 1): the audio's valid log-mel frames (10 ms each)
    data: str | None = None  # inline embeddings, as in ``ImageEmbeds``
    dtype: EmbedsDtype = "float32"


class AudioEmbedsPart(msgspec.Struct, tag_field="type", tag="audio_embeds"):
    """An audio already encoded elsewhere: its extent, content hash and encoder-cache handle."""

    audio_embeds: AudioEmbeds
    uuid: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    ec_handle: dict[str, Any] | None = None


EmbedsPart = ImageEmbedsPart | VideoEmbedsPart | AudioEmbedsPart  # metadata-only media
RawMediaPart = ImageUrlPart | VideoUrlPart | InputAudioPart  # media an encoder must still encode
ContentPart = TextPart | RawMediaPart | EmbedsPart
MediaPart = RawMediaPart | EmbedsPart
Modality = Literal["image", "video", "audio"]


def part_modality(part: MediaPart) -> Modality:
    if isinstance(part, InputAudioPart | AudioEmbedsPart):
        return "audio"
    return "image" if isinstance(part, ImageUrlPart | ImageEmbedsPart) else "video"


RequestKind = Literal["text", "image", "video", "audio"]


def request_kind(req: ChatRequest) -> RequestKind:
    """What a request is, for metrics and logs: "video" if it has a video, else "image" if it has an
    image, else "audio" if it has an audio, else "text"."""
    kinds = {
        part_modality(part)
        for m in req.messages
        if isinstance(m, UserMessage) and not isinstance(m.content, str)
        for part in m.content
        if not isinstance(part, TextPart)
    }
    if "video" in kinds or "image" in kinds:
        return "video" if "video" in kinds else "image"
    return "audio" if "audio" in kinds else "text"


def embeds_of(part: EmbedsPart) -> ImageEmbeds | VideoEmbeds | AudioEmbeds:
    if isinstance(part, AudioEmbedsPart):
        return part.audio_embeds
    return part.image_embeds if isinstance(part, ImageEmbedsPart) else part.video_embeds


def embeds_grid(part: EmbedsPart) -> tuple[int, int, int]:
    """The grid a metadata-only part names (``<modality>_grid_thw``)."""
    e = embeds_of(part)
    if isinstance(e, AudioEmbeds):
        return e.audio_grid_thw
    return e.image_grid_thw if isinstance(e, ImageEmbeds) else e.video_grid_thw


def check_embeds_trust(req: ChatRequest, internal: bool, enable_mm_embeds: bool) -> None:
    """Who may send which metadata-only parts: connector handles only come from the router's
    authenticated internal call; a public client may send inline embeddings, and only where the
    operator switched them on (``--enable-mm-embeds``). Runs before anything acts on a part."""
    for i, m in enumerate(req.messages):
        if not isinstance(m, UserMessage) or isinstance(m.content, str):
            continue
        for j, part in enumerate(m.content):
            if not isinstance(part, EmbedsPart):
                continue
            where, kind = f"messages[{i}].content[{j}]", f"{part_modality(part)}_embeds"
            inline = embeds_of(part).data is not None
            if not internal:
                if not enable_mm_embeds:
                    raise BadRequest(
                        f"{kind} parts are not accepted: send the media as a URL (this server was not started "
                        "with --enable-mm-embeds).",
                        param=where,
                    )
                if part.ec_handle is not None:
                    raise BadRequest(
                        f"ec_handle is internal to the deployment; a client may send {kind} only as inline data.",
                        param=f"{where}.ec_handle",
                    )
            if inline == (part.ec_handle is not None):
                raise BadRequest(f"A {kind} part needs exactly one of inline data or an ec_handle.", param=where)


def check_kv_trust(req: ChatRequest, internal: bool) -> None:
    """``kv_transfer_params`` come only from the router's authenticated call, and make sense."""
    kv = req.kv_transfer_params
    if kv is None:
        return
    if not internal:
        raise BadRequest("kv_transfer_params is internal to the deployment.", param="kv_transfer_params")
    if kv.do_remote_decode == (kv.first_token_id is not None):
        raise BadRequest(
            "kv_transfer_params needs exactly one of do_remote_decode or first_token_id.", param="kv_transfer_params"
        )
    if kv.kv_handle is not None and kv.first_token_id is None:
        raise BadRequest("a kv_handle comes with its first_token_id.", param="kv_transfer_params.kv_handle")
    if kv.completion_id is not None and not COMPLETION_ID_RE.fullmatch(kv.completion_id):
        raise BadRequest("completion_id is not a valid id.", param="kv_transfer_params.completion_id")


# --------------------------------------------------------------------------- messages


class SystemMessage(msgspec.Struct, tag_field="role", tag="system"):
    content: str | Annotated[list[TextPart], msgspec.Meta(min_length=1)]
    name: str | None = None

    @property
    def role(self) -> str:
        return "system"


class UserMessage(msgspec.Struct, tag_field="role", tag="user"):
    content: str | Annotated[list[ContentPart], msgspec.Meta(min_length=1)]
    name: str | None = None

    @property
    def role(self) -> str:
        return "user"


class AssistantMessage(msgspec.Struct, tag_field="role", tag="assistant"):
    content: str | Annotated[list[TextPart], msgspec.Meta(min_length=1)] | None = None
    name: str | None = None

    @property
    def role(self) -> str:
        return "assistant"


Message = SystemMessage | UserMessage | AssistantMessage


# --------------------------------------------------------------------------- request


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False


COMPLETION_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,96}")


class KVTransferParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """P/D disaggregation (vLLM's name for it), internal to a deployment: only the router's
    authenticated call may carry it (``check_kv_trust``).

    To a prefill instance ``do_remote_decode``: answer with the first token and the prompt's KV
    handle. To a decode instance ``first_token_id`` (and ``kv_handle``, absent when the prefill must
    be computed there): continue the answer after that token, under ``completion_id``."""

    do_remote_decode: bool = False
    first_token_id: Annotated[int, msgspec.Meta(ge=0)] | None = None
    kv_handle: dict[str, Any] | None = None
    completion_id: str | None = None


class SamplingRequest(msgspec.Struct, kw_only=True):
    """What chat and text completions share: the model, streaming and the sampling fields. Range
    checks live in ``to_sampling_params``."""

    model: str = ""  # optional, as in vLLM: the served model
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = False
    n: int | None = 1
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatRequest(SamplingRequest, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_completion_tokens: int | None = None  # preferred over max_tokens when both are given
    logprobs: bool | None = False
    top_logprobs: int | None = None  # alternatives per token, 0..20; needs logprobs
    # extra chat-template variables (vLLM's extension), e.g. {"add_vision_id": false}
    chat_template_kwargs: dict[str, Any] | None = None
    kv_transfer_params: KVTransferParams | None = None  # internal: P/D disaggregation

    def media_parts(self) -> list[MediaPart]:
        """Media parts of all messages, in prompt order."""
        return [
            p
            for m in self.messages
            if isinstance(m, UserMessage) and not isinstance(m.content, str)
            for p in m.content
            if not isinstance(p, TextPart)
        ]


_PATH_RE = re.compile(r" - at `\$\.?(.*)`$")
_MISSING_RE = re.compile(r"missing required field `([^`]+)`")


def param_of(message: str) -> str | None:
    """The field a msgspec validation message points at: "... - at `$.messages[0].role`"."""
    m = _PATH_RE.search(message)
    path = m.group(1) if m else ""
    missing = _MISSING_RE.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


def prompt_chars(req: ChatRequest) -> int:
    """Characters of text in every message (what templating and tokenization will work through)."""
    n = 0
    for m in req.messages:
        content = m.content
        if isinstance(content, str):
            n += len(content)
        elif content is not None:
            n += sum(len(p.text) for p in content if isinstance(p, TextPart))
    return n


R = TypeVar("R", bound=SamplingRequest)


def decode_request(body: bytes, kind: type[R]) -> R:
    """A request body as ``kind``; BadRequest (naming the field) when it is not one."""
    try:
        req = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        msg = str(e)
        raise BadRequest(f"Invalid request: {msg}", param=param_of(msg)) from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"Request body is not valid JSON: {e}") from None
    if req.n is not None and req.n != 1:
        raise BadRequest(f"Only n=1 is supported, got n={req.n}.", param="n")
    return req


def decode_chat_request(
    body: bytes, limits: MediaLimits, max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS
) -> ChatRequest:
    """Parse and validate a chat request body; every failure is a ``BadRequest``. The text is bounded
    by characters here, before any templating or tokenization can spend time on it."""
    req = decode_request(body, ChatRequest)

    chars = prompt_chars(req)
    if chars > max_prompt_chars:
        raise PayloadTooLarge(
            f"The messages hold {chars} characters of text; this server accepts at most {max_prompt_chars}.",
            param="messages",
        )
    if req.stream_options is not None and not req.stream:
        raise BadRequest("stream_options is only allowed when stream is true.", param="stream_options")

    counts = {"image": 0, "video": 0, "audio": 0}
    for i, m in enumerate(req.messages):
        if not isinstance(m, UserMessage) or isinstance(m.content, str):
            continue
        for j, part in enumerate(m.content):
            if isinstance(part, TextPart):
                continue
            if isinstance(part, ImageEmbedsPart) and part.image_embeds.image_grid_thw[0] != 1:
                raise BadRequest(
                    f"image_grid_thw must start with 1 (one temporal group), got {list(part.image_embeds.image_grid_thw)}.",
                    param=f"messages[{i}].content[{j}].image_embeds.image_grid_thw",
                )
            counts[part_modality(part)] += 1
    for modality, count in counts.items():
        allowed = limits.max_items(modality)
        if count > allowed:
            raise BadRequest(
                f"At most {allowed} {modality}(s) may be provided in one prompt, got {count}.", param="messages"
            )
    return req


def to_sampling_params(req: SamplingRequest, default_max_tokens: int, max_model_len: int) -> SamplingParams:
    """Validate the sampling fields of ``req`` (OpenAI/vLLM ranges) and build ``SamplingParams``
    (logprobs: chat requests only)."""
    chat = req if isinstance(req, ChatRequest) else None
    temperature = 1.0 if req.temperature is None else req.temperature
    if not 0.0 <= temperature <= 2.0:
        raise BadRequest(f"temperature must be in [0, 2], got {temperature}.", param="temperature")
    if temperature < _GREEDY_EPS:
        temperature = 0.0

    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0.0 < top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {top_p}.", param="top_p")

    top_k = 0 if req.top_k is None else req.top_k
    if top_k < -1:
        raise BadRequest(f"top_k must be -1 or 0 (disabled) or at least 1, got {top_k}.", param="top_k")
    top_k = max(top_k, 0)

    if chat is not None and chat.max_completion_tokens is not None:
        max_tokens, max_param = chat.max_completion_tokens, "max_completion_tokens"
    elif req.max_tokens is not None:
        max_tokens, max_param = req.max_tokens, "max_tokens"
    else:
        max_tokens, max_param = min(default_max_tokens, max_model_len), ""
    if max_tokens < 1:
        raise BadRequest(f"{max_param} must be at least 1, got {max_tokens}.", param=max_param)
    if max_tokens > max_model_len:
        raise BadRequest(
            f"{max_param}={max_tokens} exceeds the model's maximum context length of {max_model_len} tokens.",
            param=max_param,
        )

    min_tokens = 0 if req.min_tokens is None else req.min_tokens
    if min_tokens < 0:
        raise BadRequest(f"min_tokens must be at least 0, got {min_tokens}.", param="min_tokens")
    if min_tokens > max_tokens:
        raise BadRequest(
            f"min_tokens ({min_tokens}) must be less than or equal to max_tokens ({max_tokens}).", param="min_tokens"
        )

    if req.stop is None:
        stop: tuple[str, ...] = ()
    elif isinstance(req.stop, str):
        stop = (req.stop,)
    else:
        stop = tuple(req.stop)
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"At most {MAX_STOP_STRINGS} stop sequences are allowed, got {len(stop)}.", param="stop")
    if any(s == "" for s in stop):
        raise BadRequest("stop sequences must not be empty strings.", param="stop")

    if req.seed is not None and not _INT64_MIN <= req.seed <= _UINT64_MAX:
        raise BadRequest(f"seed must fit in 64 bits, got {req.seed}.", param="seed")

    want_logprobs = bool(chat is not None and chat.logprobs)
    top_logprobs = 0 if chat is None or chat.top_logprobs is None else chat.top_logprobs
    if chat is not None and chat.top_logprobs is not None:
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise BadRequest(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}.", param="top_logprobs"
            )
        if not want_logprobs:
            raise BadRequest("top_logprobs may only be given when logprobs is true.", param="top_logprobs")

    return SamplingParams(
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop,
        ignore_eos=bool(req.ignore_eos),
        logprobs=want_logprobs,
        top_logprobs=top_logprobs,
    )
