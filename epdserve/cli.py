"""The ``epdserve`` command line: one subcommand per role or tool.

A role's flags are fields of its config dataclasses (``epdserve.config_flags``): default, help
and choices are read from the dataclass; the tables below only say which fields a command offers,
and under which name where the flag is older than the field. ``main`` builds the flags of the
chosen command alone, so a light command (``up``, ``bench``, ``--help``) never imports a role's
modules, torch among them.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from epdserve.allocator import keep_freed_memory
from epdserve.assets import default_model_dir
from epdserve.config_flags import Flag, add_flags, to_argv, values
from epdserve.models.config import ConfigError
from epdserve.models.registry import UnknownArchitectureError
from epdserve.security.credentials import ADMIN_KEY_ENV, API_KEY_ENV

if TYPE_CHECKING:
    from epdserve.api.registration import RegistrationConfig
    from epdserve.encoder.server import EncoderConfig
    from epdserve.media.limits import MediaLimits
    from epdserve.pd.config import ServerConfig
    from epdserve.router.server import RouterConfig
    from epdserve.security.credentials import ClusterCredential
    from epdserve.up import Deployment

T = TypeVar("T")

# the config classes, named rather than imported: building a command's flags imports only its own
SERVER = "epdserve.pd.config:ServerConfig"
ENGINE = "epdserve.engine.config:EngineConfig"
ENCODER = "epdserve.encoder.server:EncoderConfig"
ROUTER = "epdserve.router.server:RouterConfig"
FRONTEND = "epdserve.router.frontend_decode:FrontendDecodeConfig"
EC = "epdserve.transfer.config:ECConfig"
MEDIA = "epdserve.media.limits:MediaLimits"
AUTH = "epdserve.api.auth:AuthConfig"
STORE = "epdserve.store.config:StoreConfig"
REGISTRATION = "epdserve.api.registration:RegistrationConfig"
REGISTRATION_FLAGS = ("advertise_host", "register_with", "heartbeat_s")

MODEL = Flag("model", default=None, default_help="the embedded model")
STATS_INTERVAL = Flag("log_stats_interval_s", "--log-stats-interval")
OTLP = "otlp_traces_endpoint"
SERVER_FLAGS = ("served_model_name", "host", "port", Flag("vision", "--vision-tower"), "role", STATS_INTERVAL, OTLP)
PUBLIC_FLAGS = ("max_prompt_chars", "enable_mm_embeds")  # of ServerConfig and RouterConfig alike
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
    "contiguous_decode_kv",
    "kernels",
    Flag("cpus", "--engine-cpus"),
    "threads",
    "device",
    "dtype",
)
ENCODER_FLAGS = (
    "served_model_name",
    "host",
    "port",
    "encode_token_budget",
    Flag("batch_wait_ms", "--encode-batch-wait-ms"),
    "encoder_cache_bytes",
    "kernels",
    "threads",
    "device",
    "dtype",
    STATS_INTERVAL,
    OTLP,
)
EC_PREFIX = "--ec-"
EC_PRODUCER_FLAGS = (
    "connector",
    "shm_bytes",
    "fs_dir",
    "tcp_port",
    "mooncake_protocol",
    "mooncake_device",
    Flag("instance", default=None, default_help="encoder-<port>"),
)
EC_CONSUMER_FLAGS = ("fs_dir", "mooncake_protocol", "mooncake_device")
STORE_PREFIX = "--store-"
STORE_FLAGS = (
    "url",
    "username",
    "ttl_s",
    "max_item_bytes",
    "timeout_s",
    "down_s",
    "claim_ttl_s",
    "wait_s",
    "local_host",
    "segment_bytes",
    "protocol",
    "device",
)
STORE_CONSUMER_FLAGS = ("url", "username", "timeout_s", "local_host", "protocol", "device")
KV_PREFIX = "--kv-"
KV_FLAGS = (
    "connector",
    "shm_bytes",
    "shm_dir",
    "tcp_host",
    "tcp_port",
    Flag("instance", default=None, default_help="<role>-<port>"),
)
ROUTER_FLAGS = (
    "host",
    "port",
    "encoders",
    "pds",
    "prefills",
    "decodes",
    "policy",
    "kv_load_tokens",
    "encoder_policy",
    Flag("probe_interval_s", "--probe-interval"),
    "dns_interval_s",
    "dispatch",
    "dispatch_interference",
    "directory_entries",
    "max_inflight_text",
    "max_inflight_media",
    "admission_wait_s",
    "text_ttft_target_ms",
    STATS_INTERVAL,
    OTLP,
    Flag("model", default_help="the embedded model"),
)
FRONTEND_PREFIX = "--frontend-decode-"
FRONTEND_FLAGS = (Flag("enabled", "--frontend-decode"), "workers", "max_queued", "shm_bytes")
API_KEY = Flag("api_key", default=None, default_help=f"${API_KEY_ENV}; unset: no key needed")
ADMIN_KEY = Flag("admin_key", default=None, default_help=f"${ADMIN_KEY_ENV}; unset: registration is off")
MEDIA_FLAGS = (
    "allowed_media_domains",
    Flag("allow_private_addresses", "--allow-private-media"),
    Flag("fetch_timeout_s", "--media-fetch-timeout"),
    "max_audio_seconds",
)
# what ``up`` hands on to the roles it starts, when given: (the config documenting the flags, the
# flags, which roles get them)
UP_FORWARDED = (
    (ROUTER, ("policy", "kv_load_tokens", "encoder_policy", "directory_entries", "dispatch_interference"), "router"),
    (ROUTER, ("max_inflight_text", "max_inflight_media", "admission_wait_s", "text_ttft_target_ms"), "router"),
    (SERVER, PUBLIC_FLAGS, "public"),
    (SERVER, ("served_model_name",), "models"),
    (ENGINE, ("kernels", "threads", "device", "dtype"), "models"),
    (ENGINE, ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size"), "lm"),
    (ENGINE, ("enable_prefix_caching", "media_max_wait_s", "kv_cache_memory", "memory_fraction"), "lm"),
    (ENCODER, ("encode_token_budget", "encoder_cache_bytes"), "encoders"),
    (MEDIA, MEDIA_FLAGS, "all"),
    (SERVER, (STATS_INTERVAL, OTLP), "all"),
)
UP_ROLES = {
    "router": "passed to the router (unset: its default)",
    "public": "passed to the public endpoint and the language-model instances (unset: their default)",
    "encoders": "passed to every encoder (unset: the encoder's default)",
    "models": "passed to every encoder and language-model instance (unset: each role's default)",
    "lm": "passed to every language-model instance (unset: serve's default)",
    "all": "passed to every role (unset: each role's default)",
}


def _log_to_stderr(args: argparse.Namespace) -> None:
    """One log format for every long-running role (``--log-format``); the engine core process it
    starts logs the same way (``EPD_LOG_FORMAT``, inherited)."""
    import os

    from epdserve.api import logs

    os.environ[logs.LOG_FORMAT_ENV] = args.log_format
    logs.setup(args.log_format)


def _usage_error(message: str) -> NoReturn:
    print(f"epdserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _checked(build: Callable[[], T]) -> T:
    """A config built from flags; a value its dataclass refuses is a usage error, as argparse's own are."""
    try:
        return build()
    except ValueError as e:
        _usage_error(str(e))


def _model_path(args: argparse.Namespace) -> int:
    print(default_model_dir())
    return 0


def _demo(args: argparse.Namespace) -> int:
    from epdserve.shapes import ShapesWorld, render_images

    world = ShapesWorld(args.seed)
    ask = _server_asker(args.url) if args.url else _local_asker(args.model)
    right = 0
    for _ in range(args.n):
        sample = world.sample()
        answer = ask(sample.question, render_images(sample), sample.frames)
        media = "video" if sample.video is not None else f"{len(sample.scenes)} image(s)"
        right += answer == sample.answer
        mark = "ok" if answer == sample.answer else "WRONG"
        print(f"[{media}] {sample.question} -> {answer!r} (expected {sample.answer!r}) {mark}")
    print(f"{right}/{args.n} exact")
    return 0


def _local_asker(model: str | None):
    from epdserve.hf_reference import HFReference

    ref = HFReference(model or default_model_dir())
    return lambda q, images, frames: ref.answer(q, images=images or None, video=frames or None)


def _server_asker(url: str):
    import openai

    from epdserve.bench.workload import gif_data_url, image_data_url
    from epdserve.security.credentials import api_key_from

    # the server's API key from the environment, as every client of the deployment reads it
    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key_from(None) or "none")
    model = client.models.list().data[0].id

    def ask(q: str, images: list, frames: list) -> str:
        parts: list[dict] = [{"type": "image_url", "image_url": {"url": image_data_url(im)}} for im in images]
        if frames:
            parts.append({"type": "video_url", "video_url": {"url": gif_data_url(frames)}})
        messages: Any = [{"role": "user", "content": [*parts, {"type": "text", "text": q}]}]
        r = client.chat.completions.create(model=model, temperature=0, messages=messages)
        return r.choices[0].message.content or ""

    return ask


def _eval_shapes(args: argparse.Namespace) -> int:
    from epdserve.evaluate import main as eval_main

    return eval_main(args)


def _train_shapes(args: argparse.Namespace) -> int:
    from epdserve.training.train import train

    train(args)
    return 0


# ---- roles -----------------------------------------------------------------------------------------


def _model(args: argparse.Namespace) -> Path:
    return Path(args.model) if args.model else default_model_dir()


def _cluster_credential(args: argparse.Namespace) -> ClusterCredential | None:
    from epdserve.security.credentials import ClusterCredential, CredentialError

    try:
        return ClusterCredential.load(args.cluster_secret_file)
    except CredentialError as e:
        _usage_error(str(e))


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The ``MediaLimits`` of the flags ``add_media_args`` defines."""
    from epdserve.media.limits import MediaLimits

    per_prompt = args.limit_mm_per_prompt or {}
    counts = {f"max_{m}s_per_prompt": n for m, n in per_prompt.items()}
    return _checked(lambda: MediaLimits(**values(args, MEDIA_FLAGS), **counts))


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The ``ServerConfig`` of ``epdserve serve``'s flags."""
    from epdserve.api.auth import AuthConfig
    from epdserve.engine.config import EngineConfig
    from epdserve.models.precision import check_device
    from epdserve.pd.config import ServerConfig
    from epdserve.security.credentials import api_key_from
    from epdserve.store.config import StoreConfig
    from epdserve.transfer.config import ECConfig

    cluster = _cluster_credential(args)
    secret = cluster.secret.decode() if cluster else ""
    engine = _checked(lambda: EngineConfig(**values(args, ENGINE_FLAGS)))
    registration = registration_config(args, args.kv_connector if args.role == "prefill" else None)
    kv = None
    if args.role != "both":  # the KV connector: a prefill instance's producer, a decode instance's consumer
        from epdserve.transfer.kv import kv_config

        if cluster is None:
            _usage_error(
                f"a {args.role} instance needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file"
            )
        fields = values(args, KV_FLAGS, KV_PREFIX)
        fields.setdefault("tcp_host", args.host)
        fields.setdefault("tcp_advertise_host", registration.advertise_host)
        connector = fields.pop("connector", "shm")
        instance = fields.pop("instance", f"{args.role}-{args.port}")
        kv = _checked(lambda: kv_config(ECConfig(**fields, secret=secret), connector, instance, engine.dtype))
    config = _checked(
        lambda: ServerConfig(
            model=_model(args),
            **values(args, SERVER_FLAGS),
            **values(args, PUBLIC_FLAGS),
            engine=engine,
            kv=kv,
            limits=media_limits(args),
            ec=ECConfig(
                **values(args, EC_CONSUMER_FLAGS, EC_PREFIX),
                tcp_host=args.host,  # where a mooncake consumer's engine lives (tcp consumers only dial)
                tcp_advertise_host=registration.advertise_host,
                secret=secret,
                store=StoreConfig(**values(args, STORE_CONSUMER_FLAGS, STORE_PREFIX)),
            ),
            auth=AuthConfig(api_key=api_key_from(args.api_key), cluster=cluster, internal_only=args.internal_only),
            registration=registration,
        )
    )
    _checked(lambda: check_device(config.engine.device))
    return config


def encoder_config(args: argparse.Namespace) -> EncoderConfig:
    """The ``EncoderConfig`` of ``epdserve encoder``'s flags."""
    from epdserve.api.auth import AuthConfig
    from epdserve.encoder.server import EncoderConfig
    from epdserve.models.precision import check_device
    from epdserve.store.config import StoreConfig
    from epdserve.transfer.config import ECConfig

    cluster = _cluster_credential(args)
    if cluster is None:
        _usage_error("the encoder needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file")
    ec = values(args, EC_PRODUCER_FLAGS, EC_PREFIX)
    ec.setdefault("instance", f"encoder-{args.port}")
    registration = registration_config(args, ec.get("connector"))
    # the tcp connector listens where the role does, and hands out the address peers use
    ec.update(tcp_host=args.host, tcp_advertise_host=registration.advertise_host)
    config = _checked(
        lambda: EncoderConfig(
            model=_model(args),
            **values(args, ENCODER_FLAGS),
            limits=media_limits(args),
            ec=ECConfig(
                **ec, secret=cluster.secret.decode(), store=StoreConfig(**values(args, STORE_FLAGS, STORE_PREFIX))
            ),
            auth=AuthConfig(cluster=cluster),
            registration=registration,
        )
    )
    _checked(lambda: check_device(config.device))
    return config


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The ``RouterConfig`` of ``epdserve router``'s flags."""
    from epdserve.api.auth import AuthConfig
    from epdserve.router.frontend_decode import FrontendDecodeConfig
    from epdserve.router.server import RouterConfig
    from epdserve.security.credentials import api_key_from

    cluster = _cluster_credential(args)
    if cluster is None:
        _usage_error("the router needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file")
    auth = AuthConfig(
        api_key=api_key_from(args.api_key), admin_key=api_key_from(args.admin_key, ADMIN_KEY_ENV), cluster=cluster
    )
    return _checked(
        lambda: RouterConfig(
            **values(args, ROUTER_FLAGS),
            **values(args, PUBLIC_FLAGS),
            limits=media_limits(args),
            frontend=FrontendDecodeConfig(**values(args, FRONTEND_FLAGS, FRONTEND_PREFIX)),
            auth=auth,
        )
    )


def _serve(args: argparse.Namespace) -> int:
    from epdserve.pd.launch import launch_core

    config = serve_config(args)
    _log_to_stderr(args)
    core = launch_core(config)  # loads the model while the front end imports (nothing heavy so far)
    from epdserve.pd.server import serve

    serve(config, core)
    return 0


def _encoder(args: argparse.Namespace) -> int:
    from epdserve.encoder.server import serve

    config = encoder_config(args)
    _log_to_stderr(args)
    serve(config)
    return 0


def _router(args: argparse.Namespace) -> int:
    from epdserve.router.server import serve_router

    config = router_config(args)
    _log_to_stderr(args)
    serve_router(config)
    return 0


def up_deployment(args: argparse.Namespace) -> Deployment:
    """The ``Deployment`` of ``epdserve up``'s flags (nothing started yet)."""
    from epdserve.security.credentials import ClusterCredential, CredentialError, api_key_from
    from epdserve.up import Deployment

    try:
        # a fresh secret per run unless given: never one inherited from the shell's environment
        cluster = ClusterCredential.from_file(args.cluster_secret_file) if args.cluster_secret_file else None
    except CredentialError as e:
        _usage_error(str(e))

    if args.mooncake_master and args.store_url:
        _usage_error("--mooncake-master starts the deployment's own store: leave out --store-url")

    def forwarded(roles: str) -> list[str]:
        return [arg for _, flags, to in UP_FORWARDED if to == roles for arg in to_argv(args, flags)]

    return Deployment(
        args.topology,
        args.model,
        host=args.host,
        port=args.port,
        pin=args.pin_cores,
        ec_connector=args.ec_connector,
        kv_connector=args.kv_connector,
        extra_pd_args=[
            *forwarded("models"),
            *forwarded("lm"),
            *forwarded("public"),
            *to_argv(args, STORE_CONSUMER_FLAGS, STORE_PREFIX),
        ],
        extra_encoder_args=[*forwarded("models"), *forwarded("encoders"), *to_argv(args, STORE_FLAGS, STORE_PREFIX)],
        extra_router_args=[*forwarded("router"), *forwarded("public"), *to_argv(args, FRONTEND_FLAGS, FRONTEND_PREFIX)],
        extra_args=[*forwarded("all"), *(["--log-format", args.log_format] if args.log_format else [])],
        log_dir=Path(args.log_dir) if args.log_dir else None,
        api_key=api_key_from(args.api_key),
        admin_key=api_key_from(args.admin_key, ADMIN_KEY_ENV),
        cluster=cluster or ClusterCredential.generate(),
        verbose=True,
        mooncake_master=args.mooncake_master,
        **({"dispatch": args.dispatch} if args.dispatch else {}),
    )


def _up(args: argparse.Namespace) -> int:
    from epdserve.up import run_up

    return run_up(up_deployment(args))


# ---- flags -----------------------------------------------------------------------------------------


def add_engine_args(s: argparse.ArgumentParser) -> None:
    """Flags of a language-model instance, named as in vLLM where vLLM has them."""
    add_flags(s, SERVER, [MODEL, *SERVER_FLAGS, *PUBLIC_FLAGS])
    add_flags(s.add_argument_group("engine"), ENGINE, ENGINE_FLAGS)
    add_flags(s.add_argument_group("EC connector (consumer)"), EC, EC_CONSUMER_FLAGS, EC_PREFIX)
    add_flags(_store_group(s), STORE, STORE_CONSUMER_FLAGS, STORE_PREFIX)
    kv = s.add_argument_group("KV connector (--role prefill: producer; decode: consumer)")
    add_flags(kv, EC, KV_FLAGS, KV_PREFIX)
    credentials = s.add_argument_group("credentials")
    add_flags(credentials, AUTH, [API_KEY, "internal_only"])
    add_cluster_args(credentials)
    add_registration_args(s)
    add_media_args(s)
    add_log_args(s)


def add_encoder_args(s: argparse.ArgumentParser) -> None:
    """Flags of an encoder-only instance."""
    add_flags(s, ENCODER, [MODEL, *ENCODER_FLAGS])
    add_flags(s.add_argument_group("EC connector (producer)"), EC, EC_PRODUCER_FLAGS, EC_PREFIX)
    add_flags(_store_group(s), STORE, STORE_FLAGS, STORE_PREFIX)
    add_cluster_args(s.add_argument_group("credentials"))
    add_registration_args(s)
    add_media_args(s)
    add_log_args(s)


def add_router_args(s: argparse.ArgumentParser) -> None:
    """Flags of the router."""
    add_flags(s, ROUTER, [*ROUTER_FLAGS, *PUBLIC_FLAGS])
    add_flags(s.add_argument_group("frontend media decoding"), FRONTEND, FRONTEND_FLAGS, FRONTEND_PREFIX)
    credentials = s.add_argument_group("credentials")
    add_flags(credentials, AUTH, [API_KEY, ADMIN_KEY])
    add_cluster_args(credentials)
    add_media_args(s)
    add_log_args(s)


def add_cluster_args(s: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The internal credential every role of one deployment shares."""
    s.add_argument(
        "--cluster-secret-file",
        default=None,
        help="file holding the deployment's internal secret (default: $EPD_CLUSTER_SECRET; 'up' makes one)",
    )


def add_registration_args(s: argparse.ArgumentParser) -> None:
    group = s.add_argument_group(
        "multi-host",
        "Where peers reach this instance, and its registration with a router (the router's admin key "
        "is read from EPD_ADMIN_KEY).",
    )
    add_flags(group, REGISTRATION, REGISTRATION_FLAGS)


def registration_config(args: argparse.Namespace, connector: str | None) -> RegistrationConfig:
    """The ``RegistrationConfig`` of a worker's flags; a tcp connector needs an address peers can
    dial (``--advertise-host`` when listening on every interface)."""
    from epdserve.api.registration import RegistrationConfig, is_wildcard
    from epdserve.security.credentials import api_key_from

    reg = _checked(
        lambda: RegistrationConfig(**values(args, REGISTRATION_FLAGS), admin_key=api_key_from(None, ADMIN_KEY_ENV))
    )
    _checked(lambda: reg.advertised(args.host))
    if connector == "tcp" and is_wildcard(reg.advertise_host or args.host):
        _usage_error(f"listening on {args.host}: set --advertise-host, the address peers dial for tcp transfers")
    return reg


def add_log_args(s: argparse.ArgumentParser, default: str | None = "text") -> None:
    s.add_argument(
        "--log-format",
        choices=("text", "json"),
        default=default,
        help="log lines as text or as one JSON object each (default: text)",
    )


def _per_prompt(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``'s JSON: ``{"image": N, "video": N, "audio": N}``, every key optional."""
    import json

    try:
        counts = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(counts, dict) or not set(counts) <= {"image", "video", "audio"}:
        raise argparse.ArgumentTypeError('expected {"image": N, "video": N, "audio": N}')
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()):
        raise argparse.ArgumentTypeError("counts must be whole numbers >= 0")
    return counts


def add_media_args(s: argparse.ArgumentParser) -> None:
    """Flags limiting client media, shared by every role that fetches and decodes media."""
    from epdserve.media.limits import MediaLimits

    media = s.add_argument_group("client media")
    d = MediaLimits()
    media.add_argument(
        "--limit-mm-per-prompt",
        type=_per_prompt,
        default=None,
        help=f'media items per request, as JSON (default: {{"image": {d.max_images_per_prompt}, '
        f'"video": {d.max_videos_per_prompt}, "audio": {d.max_audios_per_prompt}}}; 0 refuses the modality)',
    )
    add_flags(media, MEDIA, MEDIA_FLAGS)


def add_up_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve up``: its own, and role flags it hands on (read from the roles' configs
    without importing them: the supervisor stays free of torch)."""
    from epdserve.up import TOPOLOGIES_HELP, topology_arg

    s.add_argument("--topology", type=topology_arg, default="1e+1pd", help=f"{TOPOLOGIES_HELP} (default 1e+1pd)")
    add_flags(s, SERVER, [MODEL], defaults=False)
    s.add_argument("--host", default="127.0.0.1", help="public interface; internal roles always use 127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="public port (router or aggregated server)")
    s.add_argument("--pin-cores", action="store_true", help="pin encoders and PD workers to separate cores")
    add_flags(s, EC, ["connector"], EC_PREFIX)
    s.add_argument(
        "--kv-connector",
        choices=("shm", "tcp"),
        default="shm",
        help="how prefill instances hand KV to decode instances in <N>e+<P>p+<D>d (default: shm)",
    )
    add_log_args(s, default=None)  # unset: each role logs text
    s.add_argument("--log-dir", default=None, help="write each role's log here")
    credentials = s.add_argument_group("credentials")
    add_flags(credentials, AUTH, [API_KEY, ADMIN_KEY], defaults=False)
    credentials.add_argument(
        "--cluster-secret-file", default=None, help="secret shared by the roles (default: a new one per run)"
    )
    add_flags(s, ROUTER, [Flag("dispatch", default_help="always")], defaults=False)
    groups = {roles: s.add_argument_group(description=text) for roles, text in UP_ROLES.items()}
    for config, flags, roles in UP_FORWARDED:
        add_flags(groups[roles], config, flags, defaults=False)
    add_flags(groups["router"], FRONTEND, FRONTEND_FLAGS, FRONTEND_PREFIX, defaults=False)
    store = _store_group(s)
    store.add_argument(
        "--mooncake-master",
        action="store_true",
        help="start a Mooncake master with the deployment and share encoder outputs through it "
        "(instead of --store-url)",
    )
    add_flags(store, STORE, STORE_FLAGS, STORE_PREFIX, defaults=False)


def _store_group(s: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    return s.add_argument_group(
        "shared embedding store",
        "Encoders share what they compute through Redis (pip install 'epdserve[store]'; its password "
        "is read from EPD_STORE_PASSWORD) or Mooncake Store (pip install 'epdserve[mooncake]').",
    )


def _bench(args: argparse.Namespace) -> int:
    from epdserve.bench.loadgen import run_cli

    return run_cli(args)


def add_bench_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve bench``."""
    from epdserve.bench.loadgen import add_cli_flags

    add_cli_flags(s)


def _sweep(args: argparse.Namespace) -> int:
    from epdserve.bench.sweep import run_cli

    return run_cli(args)


def add_sweep_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve sweep``."""
    from epdserve.bench.sweep import add_cli_flags

    add_cli_flags(s)


def _plan(args: argparse.Namespace) -> int:
    from epdserve.plan.planner import run_cli

    return run_cli(args)


def add_plan_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve plan``."""
    from epdserve.plan.planner import add_cli_flags

    add_cli_flags(s)


def add_demo_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", default=None, help="model directory (default: embedded)")
    s.add_argument("--seed", type=int, default=7, help="seed of the generated images and questions")
    s.add_argument("-n", type=int, default=5, help="number of questions")
    s.add_argument("--url", default=None, help="ask a running server (e.g. http://127.0.0.1:8000) instead")


def add_eval_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--model", default=None, help="model directory (default: embedded)")
    s.add_argument("--per-type", type=int, default=60, help="questions per question type")
    s.add_argument("--seed", type=int, default=20261130, help="held-out seed (training uses other seeds)")
    s.add_argument("--ablations", action="store_true", help="also run with zeroed and swapped vision embeddings")
    s.add_argument("--json", default=None, help="write the report as JSON to this file")
    s.add_argument(
        "--no-vision-ids",
        action="store_true",
        help="render prompts with add_vision_id=False (no 'Picture N: ' before each image)",
    )


def add_train_args(s: argparse.ArgumentParser) -> None:
    from epdserve.training.args import add_arguments

    add_arguments(s)


# ---- commands --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    help: str  # one line in ``epdserve --help``
    run: Callable[[argparse.Namespace], int]
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | None = None  # ``epdserve <command> --help``'s text (default: help)


COMMANDS = {
    "model-path": Command("print the directory of the embedded model", _model_path),
    "demo": Command("ask the embedded model questions about generated shapes images", _demo, add_demo_args),
    "eval-shapes": Command(
        "exact-match accuracy per question type (transformers, greedy)", _eval_shapes, add_eval_args
    ),
    "serve": Command(
        "one language-model instance: the whole model behind an OpenAI-compatible API, or a worker behind a router",
        _serve,
        add_engine_args,
    ),
    "encoder": Command(
        "one encoder instance: turns images and videos into embeddings for the workers", _encoder, add_encoder_args
    ),
    "router": Command(
        "the public OpenAI-compatible endpoint in front of encoders and workers", _router, add_router_args
    ),
    "up": Command(
        "start a whole topology locally (aggregated, 1e+1pd, 1e+1p+1d, ...) and keep it running",
        _up,
        add_up_args,
        description="Start every role, restart any that dies (same port, back-off 0.5 s doubling to 10 s), "
        "stop all on SIGINT/SIGTERM/SIGHUP (a second signal kills at once). Exit codes: 0 stopped by a "
        "signal, 1 a role failed to start, 2 bad flags or the public port is in use.",
    ),
    "bench": Command(
        "load-test an OpenAI-compatible chat endpoint: latency (time to first token, per token, end to end), "
        "throughput, and where each request's time went",
        _bench,
        add_bench_args,
    ),
    "sweep": Command(
        "measure when separate encoders pay on this machine: a grid of workloads against each topology",
        _sweep,
        add_sweep_args,
    ),
    "plan": Command(
        "recommend a topology and E:PD ratio for a workload, with its expected TTFT, throughput and goodput, "
        "from measured stage costs",
        _plan,
        add_plan_args,
    ),
    "train-shapes": Command("train the shapes-world model (see docs/model.md)", _train_shapes, add_train_args),
}


class DefaultsShown(argparse.HelpFormatter):
    """Every option's help ends with its default, where it has one worth showing (not a flag that
    is off, not an unset or empty value) and the help does not say it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = default not in (None, False, "", [], (), argparse.SUPPRESS)
        if shown and "default" not in text and "%(default)" not in text and action.option_strings:
            text += " (default: %(default)s)"
        return text


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser of every command. With ``only``, flags are added to that command alone: building
    another command's flags would import its role for nothing."""
    from epdserve import __version__

    p = argparse.ArgumentParser(
        prog="epdserve",
        description="Serve vision-language models with an OpenAI-compatible API, the image/video encoder, "
        "the prompt's prefill and the token-by-token decode in separate instances that batch and scale on "
        "their own. Start with 'epdserve up'; 'epdserve <command> --help' shows a command's options.",
    )
    p.add_argument("--version", action="version", version=f"epdserve {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="command")
    for name, command in COMMANDS.items():
        s = sub.add_parser(
            name, help=command.help, description=command.description or command.help, formatter_class=DefaultsShown
        )
        if command.add_args is not None and only in (None, name):
            command.add_args(s)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(only=argv[0] if argv else "")
    args = parser.parse_args(argv)
    if args.cmd is None:  # a bare ``epdserve``: what it can do
        parser.print_help()
        return 0
    keep_freed_memory()  # before the command allocates anything large
    try:
        return COMMANDS[args.cmd].run(args)
    except (ConfigError, UnknownArchitectureError) as e:  # a checkpoint no role can serve: one line, not a traceback
        print(f"epdserve {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
