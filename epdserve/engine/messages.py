"""Messages between a server's front end and its engine core: typed, versioned msgspec structs.

The front end validates, renders the prompt and detokenizes; the core schedules, fetches
embeddings and runs the model. They exchange only these structs, as length-prefixed msgpack
frames (``Channel``); tensors travel as raw bytes with dtype and shape, never pickled::

    front end                              engine core
      CoreStart ─────────────────────────▶   (loads the model)
                ◀───────────────────────── CoreReady
      AddRequest / AbortRequests ────────▶
      StatsRequest ──────────────────────▶
                ◀───────────────────────── Outputs (token ids, logprobs, finish, errors)
                ◀───────────────────────── EngineStats
      Shutdown ──────────────────────────▶   (or the socket closes: the core exits)
"""

from __future__ import annotations

import math
import socket
import struct
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import numpy as np

from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.config import EngineConfig, PDRole
from epdserve.transfer.config import ECConfig

if TYPE_CHECKING:
    import torch

# 7: the core's memory account (CoreReady); 6: items encoded in slices (EngineStats); 5: the KV
# cache's touched blocks; 4: placeholder runs
ENGINE_PROTOCOL_VERSION = 7

# "transferred": a prefill instance handed the request's KV to a decode instance after its first token
FinishReason = Literal["stop", "length", "abort", "error", "transferred"]

# why a request failed inside the core; the front end maps each kind to its HTTP answer
ErrorKind = Literal["invalid_handle", "embeddings_unavailable", "media", "invalid_request", "internal"]


class WireTensor(msgspec.Struct, frozen=True):
    """A tensor by value: dtype name, shape and the C-contiguous bytes."""

    dtype: str
    shape: tuple[int, ...]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor | np.ndarray) -> WireTensor:
        """By value from a tensor or (torch-free, for the front end) a numpy array."""
        if isinstance(t, np.ndarray):
            name = t.dtype.name
            if name not in WIRE_DTYPES:
                raise ValueError(f"unsupported array dtype {name!r}")
            return cls(name, tuple(int(d) for d in t.shape), t.tobytes())  # C order, whatever t's strides
        import torch

        t = t.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        if name not in WIRE_DTYPES:
            raise ValueError(f"unsupported tensor dtype {name!r}")
        return cls(name, tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())

    def to_torch(self) -> torch.Tensor:
        import torch

        if self.dtype not in WIRE_DTYPES:
            raise ValueError(f"unsupported tensor dtype {self.dtype!r}")
        dtype = getattr(torch, self.dtype)
        if any(d < 0 for d in self.shape) or math.prod(self.shape) * dtype.itemsize != len(self.data):
            raise ValueError(f"{len(self.data)} bytes do not make a {self.dtype} tensor of shape {list(self.shape)}")
        raw = torch.from_numpy(np.frombuffer(self.data, dtype=np.uint8).copy())
        return raw.view(dtype).reshape(self.shape)


WIRE_DTYPES = frozenset({"float32", "bfloat16", "float16", "int64", "int32"})


class MediaSpec(msgspec.Struct, frozen=True):
    """One media item of a prompt: its placeholder run and where its embeddings come from —
    pixels for the local vision tower, embeddings by value, or a signed EC handle the core fetches."""

    uuid: str
    modality: str
    offset: int
    length: int
    grid_thw: tuple[int, int, int]
    pixels: WireTensor | None = None
    embeddings: WireTensor | None = None
    handle: dict[str, Any] | None = None
    # (prompt offset, rows) of each placeholder run when the item's rows are split over several
    # (a Qwen3-VL video: a run per frame group); empty: one run of ``length`` at ``offset``
    runs: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        """The position after the item's last placeholder."""
        return self.runs[-1][0] + self.runs[-1][1] if self.runs else self.offset + self.length


# ---- front end → core --------------------------------------------------------------------------


class CoreStart(msgspec.Struct, frozen=True, tag="start"):
    """What the core loads and how it runs (the first message on a new channel)."""

    model: str  # checkpoint directory
    model_id: str  # served model name (EC handles are checked against it)
    engine: EngineConfig
    vision: bool
    ec: ECConfig
    role: PDRole = "both"
    kv: ECConfig | None = None  # the KV connector of a prefill (producer) or decode (consumer) instance
    version: int = ENGINE_PROTOCOL_VERSION


class KVTransfer(msgspec.Struct, frozen=True):
    """A request's part in P/D disaggregation.

    On a prefill instance ``produce``: after the first token, put the prompt's KV to the KV
    connector and finish as "transferred" (unless the first token ends the request anyway). On a
    decode instance ``first_token`` (sampled by the prefill instance, already sent to the client)
    with ``handle`` (the prompt's KV): load it and continue decoding; when it cannot be loaded, or
    ``handle`` is None, compute the prefill here (the media items' own handles) and continue the same."""

    produce: bool = False
    first_token: int | None = None
    handle: dict[str, Any] | None = None


class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    media: list[MediaSpec] = []
    mrope_positions: WireTensor | None = None
    mrope_delta: int = 0
    eos_token_ids: list[int] = []
    arrival: float = 0.0
    kv: KVTransfer | None = None

    def sent(self) -> AddRequest:
        """The request as its front end keeps it once the core has it: without its pixels, by far
        its largest part and the core's own from then on."""
        if all(m.pixels is None for m in self.media):
            return self
        return msgspec.structs.replace(self, media=[msgspec.structs.replace(m, pixels=None) for m in self.media])


class AbortRequests(msgspec.Struct, frozen=True, tag="abort"):
    request_ids: list[str]


class ReleaseHandles(msgspec.Struct, frozen=True, tag="release"):
    """Leases of a request the front end rejected before it reached the core: give them back
    (embedding handles, and the KV handle of a decode request)."""

    handles: list[dict[str, Any]]
    kv_handles: list[dict[str, Any]] = []


class StatsRequest(msgspec.Struct, frozen=True, tag="stats?"):
    digest: bool = False  # also send the prefix cache's block hashes (EngineStats.kv_digest)


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


ToCore = CoreStart | AddRequest | AbortRequests | ReleaseHandles | StatsRequest | Shutdown


# ---- core → front end --------------------------------------------------------------------------


class CoreReady(msgspec.Struct, frozen=True, tag="ready"):
    pid: int
    vision: bool  # the vision tower is loaded
    num_kv_blocks: int
    kernels: str = ""  # the layer ops in use and why (kernels_in_use)
    kv_bytes: int = 0  # bytes of the KV cache
    threads: int = 0  # torch intra-op threads of the steps
    lends: bool = False  # on a core board: steps also run on the cores of the host's idle roles
    memory: dict[str, int] = msgspec.field(default_factory=dict)  # its memory account by part (RoleMemory.parts)
    version: int = ENGINE_PROTOCOL_VERSION


class CoreFailed(msgspec.Struct, frozen=True, tag="failed"):
    """The core could not start (bad checkpoint, device, ...); it exits after sending this."""

    message: str


class StageTimes(msgspec.Struct, frozen=True):
    """Where a request's time went inside the engine core until its first output, in seconds."""

    fetch: float = 0.0  # waiting for its embeddings (or KV) to arrive through a connector
    queue: float = 0.0  # waiting in the engine core: for the step running when it came, then ready to be admitted
    prefill: float = 0.0  # admitted, until its first token was sampled


class EngineOutput(msgspec.Struct):
    """What one step produced for one request: new token ids (with logprobs when asked), or its end."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None = None  # the chosen tokens' logprobs (params.logprobs)
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per token: (id, logprob), best first
    finish_reason: FinishReason | None = None
    error: str | None = None  # set with finish_reason "error"
    error_kind: ErrorKind | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    kv_handle: dict[str, Any] | None = None  # with finish_reason "transferred": the prompt's KV
    stages: StageTimes | None = None  # on a request's first output only

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Outputs(msgspec.Struct, frozen=True, tag="outputs"):
    outputs: list[EngineOutput]


class EngineStats(msgspec.Struct, frozen=True, tag="stats"):
    running: int = 0
    waiting: int = 0
    kv_blocks_free: int = 0
    kv_blocks_total: int = 0
    kv_blocks_touched: int = 0  # blocks ever handed out (a CPU cache maps a block's pages on its first write)
    kv_block_bytes: int = 0  # one block's bytes over every layer, K and V
    prefix_cache_hit_tokens: int = 0
    prefix_cache_query_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_bytes: int = 0
    ec_bytes: int = 0  # embedding bytes fetched through the EC connector
    ec_seconds: float = 0.0
    ec_failures: int = 0
    ec_invalid_handles: int = 0  # of the failures: handles that did not verify
    ec_fetches_skipped: int = 0  # metadata-only items not fetched: their placeholders' KV was cached
    kv_transfers_out: int = 0  # prefill: requests whose KV was handed to a decode instance
    kv_transfers_in: int = 0  # decode: requests whose KV was loaded
    kv_fallbacks: int = 0  # decode: requests whose KV could not be loaded (prefill computed here)
    kv_bytes_in: int = 0
    kv_live_handles: int = 0  # prefill: KV leases handed out and not yet released or expired
    vision: bool = False
    vision_patches: int = 0  # patches of raw media encoded here
    vision_seconds: float = 0.0  # seconds of those vision forwards
    vision_sliced_items: int = 0  # of those items, the ones encoded in slices between steps (too large for one)
    block_size: int = 0
    kv_digest: bytes = b""  # asked for: the cached blocks' hashes (prefix_hash.HASH_BYTES each)


FromCore = CoreReady | CoreFailed | Outputs | EngineStats


# ---- framing -----------------------------------------------------------------------------------

_LEN = struct.Struct(">I")
MAX_FRAME = 1 << 30


class ChannelClosed(ConnectionError):
    """The other side closed the channel (or died)."""


class Channel:
    """Blocking length-prefixed msgpack frames over a stream socket (the core's side)."""

    def __init__(self, sock: socket.socket, recv_type: Any) -> None:
        self.sock = sock
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(recv_type)

    def send(self, msg: msgspec.Struct) -> None:
        payload = self._enc.encode(msg)
        self.sock.sendall(_LEN.pack(len(payload)) + payload)

    def recv(self) -> Any:
        (n,) = _LEN.unpack(self._read(_LEN.size))
        if n > MAX_FRAME:
            raise ChannelClosed(f"frame of {n} bytes exceeds the limit")
        return self._dec.decode(self._read(n))

    def _read(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise ChannelClosed("the channel was closed")
            buf += chunk
        return bytes(buf)


def frame(encoder: msgspec.msgpack.Encoder, msg: msgspec.Struct) -> bytes:
    payload = encoder.encode(msg)
    return _LEN.pack(len(payload)) + payload


def frame_length(header: bytes) -> int:
    (n,) = _LEN.unpack(header)
    if n > MAX_FRAME:
        raise ChannelClosed(f"frame of {n} bytes exceeds the limit")
    return int(n)


FRAME_HEADER = _LEN.size
