"""The flags of ``EngineConfig`` (``engine.config``) that ``epdserve serve`` offers."""

from __future__ import annotations

from epdserve.config_flags import Flag

ENGINE = "epdserve.engine.config:EngineConfig"
ENGINE_FLAGS = (
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_kv_blocks",
    "kv_cache_memory",
    "memory_fraction",
    "enable_prefix_caching",
    "media_max_wait_s",
    "vision_step_s",
    "vision_slice_s",
    "max_pending_media_bytes",
    "max_inflight_body_bytes",
    "kernels",
    Flag("cpus", "--engine-cpus"),
    "threads",
    "core_board",
    "device",
    "dtype",
)
