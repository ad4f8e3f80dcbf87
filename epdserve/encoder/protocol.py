"""Wire messages of ``POST /v1/encode``: the router asks an encoder instance to encode media items.

One request carries the media items of one (or several) chat requests that the router sent to
this encoder; the response carries, per item and in request order, the layout metadata the
language model needs and the EC-connector handle of the embeddings::

    → {"version": 4, "model": "shapes-qwen2vl",
       "items": [{"modality": "image", "url": "data:image/png;base64,..."}],
       "context": {"max_model_len": 4096, "completion_tokens": 64}}
    ← {"version": 4,
       "items": [{"uuid": "<sha256>", "modality": "image", "grid_thw": [1, 8, 8], "num_embeddings": 16,
                  "dtype": "float32", "shape": [16, 256], "ec_handle": {"connector": "shm", ...},
                  "status": "computed",
                  "timings": {"fetch_ms": 0.1, "preprocess_ms": 1.2, "queue_ms": 0.0,
                              "encode_ms": 9.8, "put_ms": 0.1}}]}

An item may carry ``pixels`` instead of ``url``: a signed handle on its decoded frames in the
router's slab (``transfer.pixels``), when the router decodes media itself (``--frontend-decode``).

``context`` is the room of the prompt the items go into: the model's context length less the
completion the client asked for. Items whose placeholder tokens together exceed it are refused
(400, ``context_length_exceeded``) once all of them are counted and before any is encoded, so a
request the language model would refuse costs the encoder its preprocessing only; a call with a
context carries the items of one chat request. Without it (a caller that does not know the
context) nothing is counted.

A video item also carries ``second_per_grid``, the seconds of video one temporal patch spans
(from the clip's own timing, ``media.decode``), which the language model's prompt depends on
(Qwen2.5-VL's positions, Qwen3-VL's timestamps). It is optional and a response's unknown fields
are ignored, so peers without it still talk: a router that gets none leaves it out,
and the worker falls back to the processor's fps.

Every message goes through the ``encode_*`` / ``decode_*`` functions below, which check the
protocol version first: a peer speaking another version gets a clear error, not a field error.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

import msgspec

from epdserve.api.errors import BadRequest, context_too_long
from epdserve.api.protocol import SecondPerGrid, param_of

ENCODER_PROTOCOL_VERSION: Final = 4  # bump on any incompatible change of the messages below (4: "context")

MAX_RELEASE_HANDLES: Final = 1024  # handles one /v1/release call may carry
MAX_LEASES: Final = 2  # handles one item may be given
Modality = Literal["image", "video", "audio"]
ItemStatus = Literal["computed", "cache_hit", "store_hit"]
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]


class EncoderProtocolError(ValueError):
    """A peer sent a message of another protocol version or of the wrong shape."""


class _Envelope(msgspec.Struct):
    """Read before the full message so a version mismatch is reported as such."""

    version: int


# --------------------------------------------------------------------------- request


class EncodeItem(msgspec.Struct, forbid_unknown_fields=True):
    """One media item to encode: a URL, or its decoded pixels (exactly one of the two). An audio
    is a ``data:audio/<format>;base64,`` URL (the router's form of an ``input_audio`` part)."""

    modality: Modality
    url: Annotated[str, msgspec.Meta(min_length=1)] | None = None  # data: URL or http(s) URL
    # a signed pixel handle (``transfer.pixels``): the router fetched, decoded and resized the item
    pixels: dict[str, Any] | None = None


class Context(msgspec.Struct, forbid_unknown_fields=True):
    """The room of the prompt an encode call's items go into."""

    max_model_len: PositiveInt  # the language model's context length (prompt + completion)
    completion_tokens: NonNegativeInt = 0  # the completion the client asked for (0: none asked)

    @property
    def prompt_tokens(self) -> int:
        """The most tokens the prompt may hold: with a completion asked for, what it leaves;
        else all but the one token a completion needs (the language-model worker's own rule)."""
        return self.max_model_len - self.completion_tokens if self.completion_tokens else self.max_model_len - 1

    def refuse(self, tokens: int) -> BadRequest:
        """The client's answer when the items hold ``tokens`` placeholder tokens, too many."""
        return context_too_long(self.max_model_len, tokens, self.completion_tokens)


class EncodeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/encode."""

    model: str  # served model name; part of every item's uuid
    items: Annotated[list[EncodeItem], msgspec.Meta(min_length=1)]
    # handles per item: 2 when a decode instance may need the embeddings too (P/D: it recomputes
    # the prefill when the KV cannot be loaded); the second is a lease on the same stored payload
    leases: Annotated[int, msgspec.Meta(ge=1, le=MAX_LEASES)] = 1
    context: Context | None = None  # the prompt's room: the items' placeholder tokens are counted against it
    version: int = ENCODER_PROTOCOL_VERSION


# --------------------------------------------------------------------------- response


class ItemTimings(msgspec.Struct, kw_only=True):
    """Where one item's time went on the encoder, in milliseconds."""

    fetch_ms: float = 0.0  # data URL decode or http(s) download
    preprocess_ms: float = 0.0  # hashing, image/video decode, resize and patchify
    queue_ms: float = 0.0  # waiting for the vision forward
    encode_ms: float = 0.0  # the vision forward of the batch the item ran in
    put_ms: float = 0.0  # handing the embeddings to the EC connector


def ms(seconds: float) -> float:
    """``seconds`` as an ``ItemTimings`` field holds them."""
    return round(seconds * 1000, 3)


class EncodedItem(msgspec.Struct, kw_only=True):
    """Metadata of one encoded item; the embeddings themselves travel through ``ec_handle``."""

    uuid: str  # media content hash (model, modality, bytes, processor settings)
    modality: Modality
    grid_thw: tuple[PositiveInt, PositiveInt, PositiveInt]  # patches (t, h, w) before merging
    num_embeddings: NonNegativeInt  # rows of the tensor = placeholder tokens in the prompt
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[NonNegativeInt, NonNegativeInt]  # (num_embeddings, embedding width)
    ec_handle: dict[str, Any]  # EC-connector handle (see epdserve.transfer.base)
    more_handles: list[dict[str, Any]] = []  # further leases on the same embeddings (``leases`` > 1)
    store_handle: dict[str, Any] | None = (
        None  # a handle on its shared-store entry (no lease; while the store keeps it)
    )
    status: ItemStatus  # "computed": a vision forward ran for it; "cache_hit": this encoder's cache; "store_hit": the shared store
    timings: ItemTimings = msgspec.field(default_factory=ItemTimings)
    second_per_grid: SecondPerGrid | None = None  # a video's seconds per temporal patch (None: not a video)

    def embeds_part(self, handle: dict[str, Any] | None = None) -> dict[str, Any]:
        """The metadata-only chat content part that replaces this item's URL part (with
        ``ec_handle``, or another of the item's leases)."""
        key = f"{self.modality}_embeds"
        meta: dict[str, Any] = {f"{self.modality}_grid_thw": list(self.grid_thw)}
        if self.modality == "video" and self.second_per_grid is not None:
            meta["second_per_grid"] = self.second_per_grid
        return {
            "type": key,
            key: meta,
            "uuid": self.uuid,
            "ec_handle": self.ec_handle if handle is None else handle,
        }


class EncodeResponse(msgspec.Struct, kw_only=True):
    """Answer to an ``EncodeRequest``: one item per requested item, in the same order."""

    items: list[EncodedItem]
    version: int = ENCODER_PROTOCOL_VERSION


class ReleaseRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """POST /v1/release: the router gives back the leases of a request that will not consume them
    (rejected by the PD worker, retried elsewhere, or abandoned by its client)."""

    handles: Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_RELEASE_HANDLES)]
    version: int = ENCODER_PROTOCOL_VERSION


# --------------------------------------------------------------------------- encoding


def _version(body: bytes) -> int:
    return msgspec.json.decode(body, type=_Envelope).version


def encode_request(req: EncodeRequest) -> bytes:
    return msgspec.json.encode(req)


def decode_request(body: bytes, max_items: int) -> EncodeRequest:
    """Parse and validate a request body; every failure is a ``BadRequest`` (HTTP 400)."""
    try:
        version = _version(body)
    except msgspec.ValidationError as e:
        raise BadRequest(f"Invalid encode request: {e}", param="version") from None
    except msgspec.DecodeError as e:
        raise BadRequest(f"Request body is not valid JSON: {e}") from None
    if version != ENCODER_PROTOCOL_VERSION:
        raise BadRequest(
            f"Unsupported encoder protocol version {version}; this encoder speaks version {ENCODER_PROTOCOL_VERSION}.",
            param="version",
            code="unsupported_protocol_version",
        )
    try:
        req = msgspec.json.decode(body, type=EncodeRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise BadRequest(f"Invalid encode request: {e}", param=param_of(str(e))) from None
    if len(req.items) > max_items:
        raise BadRequest(
            f"At most {max_items} items may be encoded in one request, got {len(req.items)}.", param="items"
        )
    for i, item in enumerate(req.items):
        if (item.url is None) == (item.pixels is None):
            raise BadRequest(f"Item {i} must carry exactly one of url and pixels.", param=f"items[{i}]")
    return req


def encode_release(req: ReleaseRequest) -> bytes:
    return msgspec.json.encode(req)


def decode_release(body: bytes) -> ReleaseRequest:
    try:
        req = msgspec.json.decode(body, type=ReleaseRequest)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise BadRequest(f"Invalid release request: {e}", param=param_of(str(e))) from None
    if req.version != ENCODER_PROTOCOL_VERSION:
        raise BadRequest(f"Unsupported encoder protocol version {req.version}.", param="version")
    return req


def encode_response(resp: EncodeResponse) -> bytes:
    return msgspec.json.encode(resp)


def decode_response(body: bytes) -> EncodeResponse:
    """Parse an encoder's answer (router side); raises ``EncoderProtocolError``."""
    try:
        version = _version(body)
        if version != ENCODER_PROTOCOL_VERSION:
            raise EncoderProtocolError(
                f"encoder answered with protocol version {version}, expected {ENCODER_PROTOCOL_VERSION}"
            )
        return msgspec.json.decode(body, type=EncodeResponse)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise EncoderProtocolError(f"invalid encode response: {e}") from None
