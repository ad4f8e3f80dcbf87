"""The router's configuration: one frozen dataclass, validated when built (a bad value is a
usage error before anything starts)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from epdserve.api.auth import AuthConfig
from epdserve.api.exposure import ExposureConfig
from epdserve.api.protocol import DEFAULT_MAX_PROMPT_CHARS
from epdserve.api.quota import QuotaConfig
from epdserve.common.byte_bound import MAX_INFLIGHT_BODY_BYTES
from epdserve.common.units import ByteSize
from epdserve.media.limits import MediaLimits
from epdserve.router.discovery import split_sources
from epdserve.router.dispatch import Dispatch
from epdserve.router.frontend_decode import FrontendDecodeConfig
from epdserve.router.membership import WorkerNetworks
from epdserve.router.pool import PDPolicy, Policy

Workers = tuple[str, ...]
PDEngine = Literal["epdserve", "vllm"]  # what the prefill+decode workers run


@dataclass(frozen=True)
class RouterConfig:
    host: str = "127.0.0.1"  # listen address
    port: int = 8000  # listen port
    encoders: Workers = ()  # encoder base URLs, or dns+http://name:port for each address (more can register)
    pds: Workers = ()  # prefill+decode worker base URLs (or dns+http://name:port)
    prefills: Workers = ()  # prefill worker base URLs, or dns+http://name:port (P/D, with decodes)
    decodes: Workers = ()  # decode worker base URLs, or dns+http://name:port (P/D, with prefills)
    pd_engine: PDEngine = "epdserve"  # what the PD workers run: epdserve, or vllm (docs/vllm.md)
    policy: PDPolicy = "least_outstanding"  # PD worker selection; kv_aware: where the prompt's prefix is cached
    kv_load_tokens: int = 256  # kv_aware: cached prompt tokens one more outstanding request on a worker is worth
    model: str = ""  # kv_aware: checkpoint directory whose chat template and tokenizer the workers use ("" = embedded)
    encoder_policy: Policy = "affinity"  # encoder selection; affinity: the same media to the same encoder (cache hits)
    probe_interval_s: float = 2.0  # health probe period
    encode_timeout_s: float = 120.0  # one /v1/encode call
    request_timeout_s: float = 600.0  # one forwarded chat request, end to end
    max_request_bytes: int = 64 << 20  # largest request body
    max_inflight_body_bytes: ByteSize = MAX_INFLIGHT_BODY_BYTES  # request bodies held, x4 for copies; past it 429
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # most characters of text in one request's messages
    limits: MediaLimits = field(default_factory=MediaLimits)  # same validation as the PD workers
    frontend: FrontendDecodeConfig = field(default_factory=FrontendDecodeConfig)  # decode media here
    dispatch: Dispatch = "always"  # media to encoders; never: raw to workers; adaptive: by cost (router.dispatch)
    dispatch_interference: float = 0.0  # adaptive: weight of a decoding request's stall by a raw encode (its TPOT)
    max_items_per_encode: int = 32  # items per /v1/encode call (larger groups are split into calls)
    enable_mm_embeds: bool = False  # accept clients' inline image/video embeddings (never handles)
    retry_after_s: int = 1  # Retry-After of a 429 when every encoder is busy
    encoder_wait_s: float = 5.0  # while no encoder is healthy (starting, restarting), how long media waits for one
    max_inflight_text: int = 0  # text-only requests served at once (0: no limit); more wait in their own queue
    max_inflight_media: int = 0  # requests with images or video served at once (0: no limit); more wait apart
    admission_wait_s: float = 10.0  # longest a request waits for admission; then 429 with Retry-After
    text_ttft_target_ms: float = 0.0  # keep text TTFT p90 under this by lowering the media limit (0: off)
    otlp_traces_endpoint: str = ""  # OTLP/HTTP URL to send traces to, e.g. http://collector:4318/v1/traces
    log_stats_interval_s: float = 10.0  # seconds between stats lines while there is traffic (0: none)
    directory_entries: int = 65536  # media held in the shared store the router remembers, to skip their encode
    dns_interval_s: float = 5.0  # how often dns+http:// worker sources are resolved again
    worker_networks: tuple[str, ...] = ()  # CIDRs registered or DNS-found workers may be in (default: the router's own)
    auth: AuthConfig = field(default_factory=AuthConfig)  # API key, admin key, cluster credential
    quota: QuotaConfig = field(default_factory=QuotaConfig)  # per-key limits: requests in flight, tokens per minute
    exposure: ExposureConfig = field(default_factory=ExposureConfig)  # what /metrics shows without credentials

    def __post_init__(self) -> None:
        for entries in (self.encoders, self.pds, self.prefills, self.decodes):
            split_sources(entries)  # a malformed dns+http:// entry is a configuration error
        if self.policy not in get_args(PDPolicy):
            raise ValueError(f"unknown PD policy {self.policy!r}; choose from {get_args(PDPolicy)}")
        if self.dispatch not in get_args(Dispatch):
            raise ValueError(f"unknown dispatch {self.dispatch!r}; choose from {get_args(Dispatch)}")
        if self.dispatch_interference < 0:
            raise ValueError("dispatch_interference must be >= 0")
        if self.max_inflight_body_bytes < 1:
            raise ValueError("max_inflight_body_bytes must be >= 1")
        if self.encoder_policy not in get_args(Policy):
            raise ValueError(f"unknown encoder policy {self.encoder_policy!r}; choose from {get_args(Policy)}")
        if self.pd_engine not in get_args(PDEngine):
            raise ValueError(f"unknown PD engine {self.pd_engine!r}; choose from {get_args(PDEngine)}")
        if self.pd_engine == "vllm" and (self.prefills or self.policy == "kv_aware"):
            # vLLM workers publish no prefix-cache digest, and its P/D runs through its own KV connectors
            raise ValueError("vLLM workers (--pd-engine vllm) take --pds, with a policy other than kv_aware")
        if bool(self.prefills) != bool(self.decodes):
            raise ValueError("P/D disaggregation needs both prefill and decode workers")
        WorkerNetworks.of(self.worker_networks, self.host)  # a malformed CIDR is a configuration error
        if self.auth.cluster is None:
            raise ValueError(
                "the router needs the cluster credential to call its workers: set EPD_CLUSTER_SECRET "
                "or --cluster-secret-file"
            )
