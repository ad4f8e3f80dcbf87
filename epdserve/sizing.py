"""Whether a topology fits this machine, checked before ``up`` starts anything.

Each role's memory is estimated from the checkpoint (its parameters, read from the safetensors
headers, in the role's dtype: an encoder holds the media tower, a language-model worker the rest),
its caches (KV blocks, embedding caches) and the cost of a Python process with torch loaded; the
sum is held against the memory the kernel calls available. The model processes (encoders and
language-model engines) are held against the cores. Nothing here imports torch.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from epdserve.models.config import ModelConfig

# a role process with torch and its libraries loaded, before any weights or caches
PROCESS_BYTES = 512 << 20
# model processes per core beyond which each gets too little CPU to load in time and to serve
MAX_PROCESSES_PER_CORE = 4
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# weight names of the media towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: visual; Qwen2-Audio: audio_tower)
MEDIA_PARTS = ("visual.", "audio_tower.", "multi_modal_projector.")


class TooLargeError(ValueError):
    """The topology does not fit this machine (override with ``--force``)."""


@dataclass(frozen=True)
class Caches:
    """The settings that size a role's memory besides its weights (``up`` fills in each role's
    default where a flag was not given)."""

    dtype: str  # weights, activations and KV cache of every model role
    num_kv_blocks: int  # KV blocks of a language-model worker
    block_size: int  # tokens per KV block
    encoder_cache_bytes: int  # an encoder's embedding cache
    engine_cache_bytes: int  # a worker's embedding cache, when it encodes media itself


@dataclass(frozen=True)
class RoleSize:
    kind: str  # encoder, language-model worker, router
    count: int
    bytes_each: int


@dataclass(frozen=True)
class Fit:
    roles: tuple[RoleSize, ...]
    available_bytes: int  # MemAvailable
    cores: int  # cores this process may run on
    processes: int  # model processes (encoders, language-model engines)

    @property
    def need_bytes(self) -> int:
        return sum(r.count * r.bytes_each for r in self.roles)

    def problems(self) -> list[str]:
        out = []
        if self.need_bytes > self.available_bytes:
            parts = ", ".join(f"{r.count} {r.kind} x {gib(r.bytes_each)}" for r in self.roles)
            out.append(f"needs about {gib(self.need_bytes)} of memory ({parts}), {gib(self.available_bytes)} available")
        if self.processes > MAX_PROCESSES_PER_CORE * self.cores:
            out.append(
                f"runs {self.processes} model processes on {self.cores} core(s) "
                f"(at most {MAX_PROCESSES_PER_CORE} per core)"
            )
        return out


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def parameters(model_dir: Path) -> tuple[int, int]:
    """(media tower, language model) parameter counts from the safetensors headers."""
    media = text = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            count = math.prod(t["shape"])
            if any(part in name for part in MEDIA_PARTS):
                media += count
            else:
                text += count
    return media, text


def available_memory(meminfo: Path = Path("/proc/meminfo")) -> int:
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("no MemAvailable in /proc/meminfo")


def estimate(
    model_dir: Path, encoders: int, workers: int, workers_encode: bool, caches: Caches, router: bool
) -> tuple[RoleSize, ...]:
    """Each kind of role's memory. A language-model worker is two processes (front end and engine
    core); one that encodes media itself (no encoders, adaptive dispatch) also holds the tower."""
    width = DTYPE_BYTES.get(caches.dtype, 4)
    media, text = parameters(model_dir)
    t = ModelConfig.from_pretrained(model_dir).text
    kv = caches.num_kv_blocks * caches.block_size * t.num_hidden_layers * 2 * t.num_key_value_heads * t.head_dim
    worker = 2 * PROCESS_BYTES + (text + (media if workers_encode else 0)) * width + kv * width
    worker += caches.engine_cache_bytes if workers_encode else 0
    sizes = [
        RoleSize("encoder", encoders, PROCESS_BYTES + media * width + caches.encoder_cache_bytes),
        RoleSize("language-model worker", workers, worker),
        RoleSize("router", 1 if router else 0, PROCESS_BYTES),
    ]
    return tuple(s for s in sizes if s.count)


def check_fit(model_dir: Path, encoders: int, workers: int, workers_encode: bool, caches: Caches, router: bool) -> Fit:
    """The topology against this machine; ``TooLargeError`` with the numbers when it does not fit."""
    roles = estimate(model_dir, encoders, workers, workers_encode, caches, router)
    fit = Fit(roles, available_memory(), len(os.sched_getaffinity(0)), encoders + workers)
    problems = fit.problems()
    if problems:
        raise TooLargeError(
            "this topology " + "; it ".join(problems) + ": choose a smaller one (or smaller caches), or pass --force"
        )
    return fit
