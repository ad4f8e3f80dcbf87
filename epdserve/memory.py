"""Memory accounting of a role: what its weights, activations, media and KV cache take, and how
many KV blocks a budget leaves. The one formula of it: a role checks its configuration with it at
start-up (``engine.memory.plan_engine``, the encoder server) and ``epdserve plan --host-memory``
counts instances per host with it.

    language-model role (serve: both / prefill / decode)
        weights         parameters of the parts loaded (language; + vision tower unless --no-vision) x dtype
        activations     the largest step: max_num_batched_tokens rows through one decoder layer,
                        its prefill attention scores, and float32 logits of max_num_seqs rows
        vision          the tower's largest forward (vision loaded): the largest allowed item, or a
                        step's token budget of patches, whichever is larger; and beside it the
                        forward of the largest item paused within a block (an image too large for
                        a step is encoded in slices between steps)
        embeddings      the embedding slab: the largest item's rows plus a step's, all feature levels
        encoder cache   EngineConfig.encoder_cache_bytes
        pending media   media decoded, preprocessed or waiting for the tower (vision loaded): the
                        bound max_pending_media_bytes, or the largest item's where that is larger
                        (a decode role meets no media: none of these four)
        request bodies  max_inflight_body_bytes: the request bodies it holds, their copies counted
        connector       what its connector's producer holds for handles not yet released (an
                        encoder's EC connector, a prefill's KV connector: transfer.factory.producer_bytes)
        decode mirror   the contiguous decode KV (PyTorch attention only): max_num_seqs x max_model_len tokens
        KV cache        blocks x block bytes: from --kv-cache-memory, or what --memory-fraction of the
                        free memory leaves after the rest, or --num-kv-blocks

    encoder role
        weights, vision (its largest forward: encode_token_budget patches or the largest item),
        embeddings (that forward's output), encoder cache, pending media, request bodies, connector

    router (``router.memory``): request bodies; decoding media itself, its decode threads' items
        (as pending media) and its pixel slab (as its connector)

A KV block holds ``block_size`` tokens of every layer's keys and values:
``2 x layers x block_size x kv_heads x head_dim x dtype bytes``. Counted bytes are upper bounds of
what is resident (the KV cache and the mirror are resident only as used on the CPU), never
measurements; the figures are for refusing what cannot fit, not for predicting RSS to the byte.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from epdserve.common.units import format_bytes
from epdserve.models.config import ModelConfig, TextConfig, VisionConfig

if TYPE_CHECKING:
    from epdserve.engine.config import EngineConfig

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
F32 = 4  # logits, rotary angles and pixel values are float32 whatever the model's dtype


class MemoryBudgetError(ValueError):
    """A role's configuration does not fit the memory it has (the message names the figures)."""


# ---- the parts ------------------------------------------------------------------------------------


def parameter_count(model: ModelConfig, parts: frozenset[str]) -> int:
    """Parameters of the model's ``parts`` ("vision", "language"), counted on the meta device from
    the model classes the roles load (tied matrices once): no memory, no weights read."""
    import torch

    from epdserve.models.registry import model_class

    with torch.device("meta"):
        module = model_class(model.architecture)(model, parts=parts)  # type: ignore[call-arg]
    return sum(p.numel() for p in module.parameters())  # parameters() yields a tied one once


def kv_block_bytes(text: TextConfig, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one KV block: keys and values of ``block_size`` tokens in every layer."""
    return 2 * text.num_hidden_layers * block_size * text.num_key_value_heads * text.head_dim * dtype_bytes


def lm_step_bytes(text: TextConfig, tokens: int, seqs: int, max_model_len: int, dtype_bytes: int) -> int:
    """Activations of the largest step: ``tokens`` rows through one decoder layer at its widest
    (the residual, its norm, q/k/v, the attention output, gate+up, the activation and down), the
    float32 scores of one layer's prefill attention over up to ``max_model_len`` keys, and the
    float32 logits of the ``seqs`` rows sampled."""
    t = text
    q, kv = t.num_attention_heads * t.head_dim, 2 * t.num_key_value_heads * t.head_dim
    per_row = 3 * t.hidden_size + q + kv + q + 3 * t.intermediate_size
    scores = t.num_attention_heads * tokens * max_model_len * F32
    return tokens * per_row * dtype_bytes + scores + seqs * t.vocab_size * F32


def vision_forward_bytes(vision: VisionConfig, patches: int, dtype_bytes: int) -> int:
    """Activations of one vision forward over ``patches`` rows at its widest point (the residual,
    its norm, the MLP's hidden and activation; the float32 pixels, rotary angles and rotated q/k
    beside them). Attention runs per frame in a fused kernel: no score matrix."""
    v = vision
    per_row = (3 * v.embed_dim + 2 * v.mlp_hidden_dim) * dtype_bytes
    per_row += (v.patch_dim + 2 * v.head_dim + 2 * v.embed_dim) * F32
    return patches * per_row


def vision_paused_bytes(vision: VisionConfig, patches: int, dtype_bytes: int) -> int:
    """What a vision forward over ``patches`` rows holds paused within a block's attention
    (``models.layers.vision.VisionBlock``'s stages): the residual, the rotated q and k, v, the
    heads attended so far; its input rows and rotary angles, and the DeepStack levels merged so far."""
    v = vision
    per_row = (5 * v.embed_dim + v.patch_dim) * dtype_bytes + 2 * v.head_dim * F32
    per_row += (v.feature_levels - 1) * v.out_hidden_size * dtype_bytes // v.spatial_merge_size**2
    return patches * per_row


def max_item_patches(vision: VisionConfig, max_pixels: int, video_max_pixels: int, video_frames: int) -> int:
    """Patches of the largest item a request may carry: an image of ``max_pixels``, or a video of
    ``video_frames`` frames of ``video_max_pixels`` (0 frames: no videos)."""
    image = max_pixels // vision.patch_size**2
    groups = math.ceil(video_frames / vision.temporal_patch_size) if video_frames else 0
    return max(image, groups * (video_max_pixels // vision.patch_size**2))


def pending_media_bytes(vision: VisionConfig, bound: int, item_patches: int, item_bytes: int = 0) -> int:
    """Media a role holds for its tower, from decoding to the forward (``media.pending``): ``bound``,
    or the largest item's where that is larger (one item is always let through): its float32
    pixels, or ``item_bytes`` (what preprocessing it holds at most); 0 without a bound to count."""
    return max(bound, item_patches * vision.patch_dim * F32, item_bytes) if bound else 0


def embedding_bytes(model: ModelConfig, tokens: int, dtype_bytes: int) -> int:
    """``tokens`` rows of media embeddings, every feature level (DeepStack) side by side."""
    return tokens * model.feature_levels * model.text.hidden_size * dtype_bytes


# ---- a role's account ------------------------------------------------------------------------------


# the figures of an account but the KV cache, as ``RoleMemory`` names them, and as its line says them
FIXED_PARTS = {"weights": "weights", "activations": "activations", "vision": "vision peak"}
FIXED_PARTS |= {"embeddings": "embedding slab", "encoder_cache": "encoder cache", "pending_media": "pending media"}
FIXED_PARTS |= {"request_bodies": "request bodies", "connector": "connector", "decode_mirror": "decode mirror"}


@dataclass(frozen=True)
class RoleMemory:
    """What one role instance takes, by part (bytes), and the KV cache that leaves."""

    role: str  # pd, prefill, decode or encoder
    weights: int
    activations: int = 0
    vision: int = 0  # the vision tower's largest forward
    embeddings: int = 0  # the embedding slab
    encoder_cache: int = 0
    pending_media: int = 0  # media held for the vision tower
    request_bodies: int = 0  # request bodies held at once, with their copies
    connector: int = 0  # what its connector's producer holds for handles not yet released
    decode_mirror: int = 0
    kv_blocks: int = 0
    kv_cache: int = 0
    budget: int = 0  # what the role may use (0: none given)

    @property
    def fixed(self) -> int:
        """Everything but the KV cache."""
        return sum(getattr(self, name) for name in FIXED_PARTS)

    @property
    def total(self) -> int:
        return self.fixed + self.kv_cache

    def parts(self) -> dict[str, int]:
        """Every figure by name (the metric's ``part`` label), and ``total``."""
        return {**{name: getattr(self, name) for name in FIXED_PARTS}, "kv_cache": self.kv_cache, "total": self.total}

    def line(self) -> str:
        """The start-up line: every figure, human-readable (none at 0: a router has no weights)."""
        parts = [
            f"{label} {format_bytes(getattr(self, name))}" for name, label in FIXED_PARTS.items() if getattr(self, name)
        ]
        if self.kv_blocks:
            parts.append(f"KV cache {format_bytes(self.kv_cache)} ({self.kv_blocks} blocks)")
        text = f"{self.role} memory: {', '.join(parts)}; total {format_bytes(self.total)}"
        return text + (f" of a {format_bytes(self.budget)} budget" if self.budget else "")


def engine_memory(
    model: ModelConfig,
    *,
    role: str,
    dtype: str,
    block_size: int,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    encoder_cache_bytes: int,
    item_patches: int,
    vision: bool,
    decode_mirror: bool,
    pending_media: int = 0,
    item_bytes: int = 0,
    sliced: bool = True,
    request_bodies: int = 0,
    connector: int = 0,
    num_kv_blocks: int = 0,
    kv_cache_memory: int = 0,
    budget: int = 0,
    weights: int | None = None,
) -> RoleMemory:
    """A language-model role's account. Its KV blocks: ``kv_cache_memory`` worth, else what
    ``budget`` leaves after the rest, else ``num_kv_blocks``; ``pending_media``: the bound of its
    media held for the tower (``media.pending``; counted where the tower is loaded), ``item_bytes``
    what preprocessing the largest item holds; ``sliced``: a large image's forward may pause
    between steps (``EngineConfig.vision_slice_s``); ``request_bodies``: the bound of the request
    bodies it holds (``api.bodies``); ``connector``: what its KV connector's producer holds
    (``transfer.factory.producer_bytes``, a prefill's). MemoryBudgetError when the rest
    alone exceeds ``budget``, or the KV cache cannot hold one ``max_model_len`` request.
    ``weights``: bytes of the loaded model where known (else counted from the config)."""
    b = DTYPE_BYTES[dtype]
    decode = role == "decode"  # continues from handed-on KV: never meets media
    loaded = vision and model.vision is not None
    parts = frozenset({"language", "vision"} if loaded else {"language"})
    w = weights if weights is not None else parameter_count(model, parts) * b
    merge2 = model.vision.spatial_merge_size**2 if model.vision is not None else 1
    rows = max(item_patches, max_num_batched_tokens * merge2)
    fixed = RoleMemory(
        role=role,
        weights=w,
        activations=lm_step_bytes(model.text, max_num_batched_tokens, max_num_seqs, max_model_len, b),
        vision=vision_forward_bytes(model.vision, rows, b)
        + (vision_paused_bytes(model.vision, item_patches, b) if sliced else 0)
        if loaded and model.vision is not None and not decode
        else 0,
        embeddings=embedding_bytes(model, item_patches // merge2 + max_num_batched_tokens, b)
        if model.vision is not None and not decode
        else 0,
        encoder_cache=0 if decode else encoder_cache_bytes,
        pending_media=pending_media_bytes(model.vision, pending_media, item_patches, item_bytes)
        if loaded and model.vision is not None and not decode
        else 0,
        request_bodies=request_bodies,
        connector=connector,
        decode_mirror=max_num_seqs * max_model_len * kv_block_bytes(model.text, 1, b) if decode_mirror else 0,
        budget=budget,
    )
    block = kv_block_bytes(model.text, block_size, b)
    need = -(-max_model_len // block_size)
    if kv_cache_memory:
        blocks = kv_cache_memory // block
    elif budget:
        if fixed.fixed > budget:
            raise MemoryBudgetError(
                f"{role}: {format_bytes(fixed.fixed)} before any KV cache exceeds the memory budget "
                f"{format_bytes(budget)} ({fixed.line()})"
            )
        blocks = (budget - fixed.fixed) // block
    else:
        blocks = num_kv_blocks
    if blocks < need:
        raise MemoryBudgetError(
            f"{role}: a KV cache of {blocks} blocks ({format_bytes(blocks * block)}) cannot hold one request of "
            f"max_model_len {max_model_len} ({need} blocks of {format_bytes(block)}; {fixed.line()})"
        )
    out = dataclasses.replace(fixed, kv_blocks=blocks, kv_cache=blocks * block)
    if budget and out.total > budget:
        raise MemoryBudgetError(f"{role}: needs {format_bytes(out.total)}, over the budget ({out.line()})")
    return out


def encoder_memory(
    model: ModelConfig,
    *,
    dtype: str,
    encode_token_budget: int,
    encoder_cache_bytes: int,
    item_patches: int,
    pending_media: int = 0,
    item_bytes: int = 0,
    request_bodies: int = 0,
    connector: int = 0,
    budget: int = 0,
    weights: int | None = None,
) -> RoleMemory:
    """An encoder role's account; MemoryBudgetError when it exceeds ``budget`` (0: none).
    ``pending_media``: the bound of its media held for the tower (``media.pending``), ``item_bytes``
    what preprocessing the largest item holds, ``request_bodies`` the bound of the request bodies it
    holds (``api.bodies``), ``connector`` what its EC connector's producer holds."""
    vision = model.vision_config
    b = DTYPE_BYTES[dtype]
    rows = max(encode_token_budget, item_patches)  # an item larger than the budget is encoded alone
    out = RoleMemory(
        role="encoder",
        weights=weights if weights is not None else parameter_count(model, frozenset({"vision"})) * b,
        vision=vision_forward_bytes(vision, rows, b),
        embeddings=embedding_bytes(model, rows // vision.spatial_merge_size**2, b),
        encoder_cache=encoder_cache_bytes,
        pending_media=pending_media_bytes(vision, pending_media, item_patches, item_bytes),
        request_bodies=request_bodies,
        connector=connector,
        budget=budget,
    )
    if budget and out.total > budget:
        raise MemoryBudgetError(f"encoder: needs {format_bytes(out.total)}, over the budget ({out.line()})")
    return out


# ---- from a checkpoint directory and a role's config -------------------------------------------------


def largest_item(model_dir: str | Path, model: ModelConfig) -> tuple[int, int]:
    """Patches of the largest item the checkpoint's processor lets through, and the bytes
    preprocessing the largest item holds at most (0, 0: no vision tower)."""
    if model.vision is None:
        return 0, 0
    # numpy and PIL: only where needed
    from epdserve.media.limits import MediaLimits
    from epdserve.media.processor import ProcessorConfig, largest_footprint

    proc = ProcessorConfig.from_pretrained(model_dir)
    patches = max_item_patches(model.vision, proc.max_pixels, proc.video_max_pixels, proc.video_frames)
    return patches, largest_footprint(proc, MediaLimits().max_image_pixels, proc.video_frames)


def account_engine(
    model_dir: str | Path, config: EngineConfig, role: str, vision: bool, fused: bool, free: int, connector: int = 0
) -> RoleMemory:
    """``engine_memory`` of a language-model role of ``config`` on ``model_dir``; ``fused``: the
    fused kernels attend (no decode mirror), ``free``: the memory ``--memory-fraction`` takes from,
    ``connector``: what its KV connector's producer holds."""
    model = ModelConfig.from_pretrained(model_dir)
    patches, item_bytes = largest_item(model_dir, model)
    return engine_memory(
        model,
        role=role,
        dtype=config.dtype,
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        max_model_len=config.max_model_len,
        encoder_cache_bytes=config.encoder_cache_bytes,
        item_patches=patches,
        vision=vision,
        decode_mirror=not fused,
        pending_media=config.max_pending_media_bytes,
        item_bytes=item_bytes,
        sliced=config.vision_slice_s > 0,
        request_bodies=config.max_inflight_body_bytes,
        connector=connector,
        num_kv_blocks=config.num_kv_blocks,
        kv_cache_memory=config.kv_cache_memory,
        budget=int(config.memory_fraction * free),
    )


def account_encoder(
    model_dir: str | Path,
    dtype: str,
    encode_token_budget: int,
    encoder_cache_bytes: int,
    pending_media: int,
    request_bodies: int,
    connector: int = 0,
) -> RoleMemory:
    """``encoder_memory`` of an encoder on ``model_dir`` (an audio tower: its weights, and what it
    holds beside its tower)."""
    model = ModelConfig.from_pretrained(model_dir)
    if model.vision is None:
        weights = parameter_count(model, frozenset({"vision"})) * DTYPE_BYTES[dtype]
        return RoleMemory(
            role="encoder",
            weights=weights,
            encoder_cache=encoder_cache_bytes,
            request_bodies=request_bodies,
            connector=connector,
        )
    patches, item_bytes = largest_item(model_dir, model)
    return encoder_memory(
        model,
        dtype=dtype,
        encode_token_budget=encode_token_budget,
        encoder_cache_bytes=encoder_cache_bytes,
        item_patches=patches,
        pending_media=pending_media,
        item_bytes=item_bytes,
        request_bodies=request_bodies,
        connector=connector,
    )


def check_free(mem: RoleMemory, free: int) -> None:
    """MemoryBudgetError when ``mem`` needs more than the ``free`` bytes there are."""
    if mem.total > free:
        raise MemoryBudgetError(
            f"{mem.role}: needs {format_bytes(mem.total)}, only {format_bytes(free)} free ({mem.line()})"
        )


# ---- the machine ----------------------------------------------------------------------------------


def available_memory(device: str = "cpu") -> int:
    """Bytes this process may still take: an accelerator's free memory, else the kernel's
    MemAvailable, lowered to what the cgroup's limit leaves."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    avail = _meminfo().get("MemAvailable", 0)
    limit, used = Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")
    try:
        text = limit.read_text().strip()
        if text != "max":
            avail = min(avail, int(text) - int(used.read_text()))
    except (OSError, ValueError):
        pass
    return max(avail, 0)


def resident_bytes(pid: int) -> int:
    """What process ``pid`` holds in memory now (its resident set; 0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def host_memory() -> int:
    """Bytes of memory of this host (MemTotal)."""
    return _meminfo().get("MemTotal", 0)


def host_cores() -> int:
    return len(os.sched_getaffinity(0))


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields = value.split()
            if fields:
                out[key] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out
