"""The language-model instance's configuration (frozen; the ``serve`` flags are its fields).

Importing it costs no torch: ``serve`` validates its flags and starts its engine core before the
front end's heavier imports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from epdserve.api.auth import AuthConfig
from epdserve.api.exposure import ExposureConfig
from epdserve.api.protocol import DEFAULT_CHAT_MAX_TOKENS, DEFAULT_MAX_PROMPT_CHARS, DEFAULT_MAX_REQUEST_BYTES
from epdserve.api.quota import QuotaConfig
from epdserve.api.registration import RegistrationConfig
from epdserve.engine.config import EngineConfig, PDRole
from epdserve.media.limits import MediaLimits
from epdserve.transfer.config import KV_HANDLE_PURPOSE, ECConfig

EngineCoreMode = Literal["process", "thread"]


@dataclass(frozen=True)
class ServerConfig:
    model: Path  # checkpoint directory (Hugging Face format)
    served_model_name: str = ""  # name clients use; empty: the directory name
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port (0: any free port)
    default_max_tokens: int = DEFAULT_CHAT_MAX_TOKENS  # max_tokens when the request sets none
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # largest request body
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # most characters of text in one request's messages
    preprocess_threads: int = 0  # threads decoding and preprocessing media (0: media.workers.media_threads)
    template_threads: int = 2  # threads rendering and tokenizing prompts (apart from media work)
    otlp_traces_endpoint: str = ""  # OTLP/HTTP URL to send traces to, e.g. http://collector:4318/v1/traces
    log_stats_interval_s: float = 10.0  # seconds between stats lines while there is traffic (0: none)
    enable_mm_embeds: bool = False  # accept clients' inline image/video embeddings (never handles)
    auth: AuthConfig = field(default_factory=AuthConfig)  # API key, cluster credential, internal-only
    vision: bool = True  # load the vision tower (False: metadata-only requests only)
    warmup: bool = True  # run one short request of its own (with an image where it can) before serving
    engine_core: EngineCoreMode = "process"  # run the engine core in its own process, or in a thread here
    core_ready_timeout_s: float = 600.0  # how long the engine core may take to load the model
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: MediaLimits = field(default_factory=MediaLimits)
    ec: ECConfig = field(default_factory=ECConfig)  # EC consumer for metadata-only media
    role: PDRole = "both"  # both: whole requests; prefill: prompts, KV handed on; decode: continues from KV
    kv: ECConfig | None = None  # KV connector (transfer.kv.kv_config): a prefill's producer, a decode's consumer
    registration: RegistrationConfig = field(default_factory=RegistrationConfig)  # advertised host, router
    quota: QuotaConfig = field(default_factory=QuotaConfig)  # per-key limits when this is the public endpoint
    exposure: ExposureConfig = field(default_factory=ExposureConfig)  # what /metrics shows without credentials

    def __post_init__(self) -> None:
        if self.role not in ("both", "prefill", "decode"):
            raise ValueError(f"role must be both, prefill or decode, got {self.role!r}")
        if self.role != "both" and self.kv is None:
            raise ValueError(f"a {self.role} instance needs a KV connector")
        if self.kv is not None and self.kv.handle_purpose != KV_HANDLE_PURPOSE:
            raise ValueError("the KV connector's config must sign with the KV key (transfer.kv.kv_config)")
        if self.preprocess_threads < 0 or self.template_threads < 1:
            raise ValueError("preprocess_threads must be >= 0 and template_threads >= 1")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model.name
