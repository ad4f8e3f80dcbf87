"""Engine configuration (frozen, validated)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from epdserve.common.byte_bound import MAX_INFLIGHT_BODY_BYTES
from epdserve.common.dtypes import DType, check_dtype
from epdserve.common.units import ByteSize
from epdserve.kernels import KernelChoice
from epdserve.media.pending import PENDING_MEDIA_BYTES

PDRole = Literal["both", "prefill", "decode"]  # what an instance does of a request (P/D disaggregation)


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16  # tokens per KV-cache block
    num_kv_blocks: int = 2048  # KV-cache blocks (per layer) unless a memory budget sizes them
    kv_cache_memory: ByteSize = 0  # KV-cache bytes, e.g. 4GiB (0: --memory-fraction, else --num-kv-blocks)
    memory_fraction: float = 0.0  # share of the free memory this role may use; the KV cache gets the rest (0: off)
    max_num_seqs: int = 64  # most requests in the running batch
    max_num_batched_tokens: int = 1024  # per-step token budget (prefill chunks + decodes)
    max_model_len: int = 4096  # prompt + output tokens per request
    enable_prefix_caching: bool = True  # reuse full KV blocks across requests by content hash
    media_max_wait_s: float = 1.0  # text-only requests join the batch first; media that waited this long too
    # a large vision tower then gives each request of a burst its first token in turn:
    vision_step_s: float = 0.5  # vision seconds (as timed) of new requests a step admits; past it, one in a step without prompts; 0: no bound
    vision_slice_s: float = 4.0  # an image whose forward takes longer is encoded between steps, a slice a step; 0: no
    encoder_cache_bytes: int = 256 << 20  # byte bound of the per-engine vision-embedding cache
    max_pending_media_bytes: ByteSize = PENDING_MEDIA_BYTES  # pixels held for the tower; past it 429 (1 item always)
    max_inflight_body_bytes: ByteSize = MAX_INFLIGHT_BODY_BYTES  # request bodies held, x4 for copies; past it 429
    kernels: KernelChoice = "auto"  # auto: fused C++ kernels on CPU (float32/bfloat16; built once per machine); torch
    cpus: str = ""  # cores the engine core process runs on, as taskset writes them (1 or 0-3,6); "": the server's
    threads: int = 0  # torch intra-op threads (0: every core it may run on for a model with large weights, else 1)
    core_board: str = ""  # core-lending board of the host's roles (up --pin-cores makes one): borrow idle roles' cores
    device: str = "cpu"  # torch device of the model and KV cache: cpu | cuda | cuda:N
    dtype: DType = "float32"  # weights, activations and KV cache: float32 | bfloat16 | float16

    def __post_init__(self) -> None:
        check_dtype(self.dtype)
        if self.block_size < 1 or self.num_kv_blocks < 1:
            raise ValueError("block_size and num_kv_blocks must be positive")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.kv_cache_memory < 0 or not 0 <= self.memory_fraction <= 1:
            raise ValueError("kv_cache_memory must be >= 0 and memory_fraction between 0 and 1")
        if self.kv_cache_memory and self.memory_fraction:
            raise ValueError("give kv_cache_memory or memory_fraction, not both")
        if not self.sized_by_memory and self.max_model_len > self.block_size * self.num_kv_blocks:
            raise ValueError("max_model_len does not fit in the KV cache")
        if min(self.max_pending_media_bytes, self.max_inflight_body_bytes) < 1:
            raise ValueError("max_pending_media_bytes and max_inflight_body_bytes must be >= 1")
        if min(self.media_max_wait_s, self.vision_step_s, self.vision_slice_s, self.threads) < 0:
            raise ValueError("media_max_wait_s, vision_step_s, vision_slice_s and threads must be >= 0")
        cpu_list(self.cpus)
        if self.kernels not in get_args(KernelChoice):
            raise ValueError(f"kernels must be one of {', '.join(get_args(KernelChoice))}, got {self.kernels!r}")

    @property
    def sized_by_memory(self) -> bool:
        """The KV cache's blocks come from a memory budget (``engine.memory.plan_engine``)."""
        return bool(self.kv_cache_memory or self.memory_fraction)


def cpu_list(spec: str) -> tuple[int, ...]:
    """The cores of a list such as ``0-3,6`` (empty for ""); ValueError for anything else."""
    cores: set[int] = set()
    for part in filter(None, (p.strip() for p in spec.split(","))):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or int(hi or lo) < int(lo):
            raise ValueError(f"cpus must be a core list such as 1 or 0-3,6, got {spec!r}")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return tuple(sorted(cores))
