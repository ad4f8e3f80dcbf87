"""The configuration of one encoder instance: a frozen dataclass, validated when built."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import get_args

import torch

from epdserve.api.auth import AuthConfig
from epdserve.api.registration import RegistrationConfig
from epdserve.common.byte_bound import MAX_INFLIGHT_BODY_BYTES
from epdserve.common.dtypes import DType, torch_dtype
from epdserve.common.units import ByteSize
from epdserve.encoder.batcher import BatcherConfig
from epdserve.kernels import KernelChoice
from epdserve.media.limits import MediaLimits
from epdserve.media.pending import PENDING_MEDIA_BYTES
from epdserve.transfer.config import ECConfig


@dataclass(frozen=True)
class EncoderConfig:
    """One encoder instance."""

    model: Path  # checkpoint directory (Hugging Face format); only the vision tower is read
    served_model_name: str = ""  # model name clients and the LM instances use; empty: the directory name
    host: str = "127.0.0.1"  # listen address
    port: int = 8100  # listen port (0: any free port)
    encode_token_budget: int = 8192  # most patch rows per vision forward (items of concurrent requests batch up to it)
    encode_forward_s: float = 0.5  # most seconds (as timed) of one vision forward; 1 item at least; 0: no bound
    batch_wait_ms: float = 0.0  # extra wait for more items before a forward (0: batch what is queued)
    max_queued_items: int = 1024  # items waiting for a forward beyond which requests get 429
    max_pending_media_bytes: ByteSize = PENDING_MEDIA_BYTES  # pixels held for the tower; past it 429 (1 item always)
    max_inflight_body_bytes: ByteSize = MAX_INFLIGHT_BODY_BYTES  # request bodies held, x4 for copies; past it 429
    encoder_cache_bytes: int = 512 << 20  # byte budget of the local embedding cache (0: no cache)
    max_items_per_request: int = 32  # media items one /v1/encode request may carry
    max_request_bytes: int = 64 << 20  # largest request body
    preprocess_threads: int = 0  # threads hashing, decoding and preprocessing media (0: one per core it may run on)
    kernels: KernelChoice = "auto"  # auto: the tower's rotary in the fused C++ kernels (CPU, float32/bfloat16); torch
    threads: int = 0  # torch intra-op threads of the tower (0: every core it may run on for large weights, else 1)
    core_board: str = ""  # core-lending board of the host's roles (up --pin-cores makes one): borrow idle roles' cores
    yield_to_decodes: bool = True  # on a core board: pause forwards, cores lent, while a worker's step holds decodes
    device: str = "cpu"  # torch device of the vision tower
    dtype: DType = "float32"  # weights and activations: float32 | bfloat16 | float16
    warmup: bool = True  # encode one small image of its own before serving
    limits: MediaLimits = field(default_factory=MediaLimits)  # what media clients may send
    ec: ECConfig = field(default_factory=ECConfig)  # EC connector the embeddings are put into
    auth: AuthConfig = field(default_factory=AuthConfig)  # the cluster credential /v1/encode needs
    retry_after_s: int = 1  # Retry-After of a 429 when the queue or the connector is full
    otlp_traces_endpoint: str = ""  # OTLP/HTTP URL to send traces to, e.g. http://collector:4318/v1/traces
    log_stats_interval_s: float = 10.0  # seconds between stats lines while there is traffic (0: none)
    registration: RegistrationConfig = field(default_factory=RegistrationConfig)  # advertised host, router

    def __post_init__(self) -> None:
        torch_dtype(self.dtype)  # raises for an unknown name
        if self.kernels not in get_args(KernelChoice):
            raise ValueError(f"kernels must be one of {', '.join(get_args(KernelChoice))}, got {self.kernels!r}")
        for name in (
            "max_items_per_request",
            "max_request_bytes",
            "max_pending_media_bytes",
            "max_inflight_body_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"EncoderConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("encoder_cache_bytes", "threads", "preprocess_threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"EncoderConfig.{name} must be >= 0, got {getattr(self, name)}")
        self.batcher  # noqa: B018 - validates the batching fields

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    @property
    def batcher(self) -> BatcherConfig:
        return BatcherConfig(
            token_budget=self.encode_token_budget,
            forward_s=self.encode_forward_s,
            max_wait_ms=self.batch_wait_ms,
            max_queued_items=self.max_queued_items,
        )
