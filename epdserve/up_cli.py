"""``epdserve up``'s flags: its own, and the role flags it hands on to the roles it starts (read
from the roles' configs without importing them: the supervisor stays free of torch); the
``Deployment`` they describe."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from epdserve.api.flags import (
    ADMIN_KEY,
    API_KEY,
    AUTH,
    EXPOSURE,
    MODEL,
    OTLP,
    QUOTA,
    QUOTA_FLAGS,
    STATS_INTERVAL,
    add_log_args,
)
from epdserve.config_flags import Flag, add_flags, to_argv, usage_error, values
from epdserve.encoder.flags import ENCODER
from epdserve.engine.flags import ENGINE
from epdserve.media.flags import MEDIA, MEDIA_FLAGS
from epdserve.pd.flags import PUBLIC_FLAGS, SERVER
from epdserve.router.flags import FRONTEND, FRONTEND_FLAGS, FRONTEND_PREFIX, ROUTER
from epdserve.security.credentials import ADMIN_KEY_ENV
from epdserve.store.flags import STORE, STORE_CONSUMER_FLAGS, STORE_FLAGS, STORE_PREFIX, store_group
from epdserve.transfer.flags import EC, EC_PREFIX

if TYPE_CHECKING:
    from epdserve.sizing import Settings
    from epdserve.up import Deployment

# what ``up`` hands on to the roles it starts, when given: (the config documenting the flags, the
# flags, which roles get them)
UP_FORWARDED = (
    (ROUTER, ("policy", "kv_load_tokens", "encoder_policy", "directory_entries", "dispatch_interference"), "router"),
    (ROUTER, ("max_inflight_text", "max_inflight_media", "admission_wait_s", "text_ttft_target_ms"), "router"),
    (ROUTER, ("encoder_wait_s",), "router"),
    (SERVER, PUBLIC_FLAGS, "public"),
    (QUOTA, QUOTA_FLAGS, "public"),
    (EXPOSURE, ("public_metrics",), "public"),
    (SERVER, ("served_model_name",), "models"),
    (ENGINE, ("kernels", "threads", "device", "dtype", "max_pending_media_bytes"), "models"),
    (ENGINE, ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size"), "lm"),
    (ENGINE, ("enable_prefix_caching", "media_max_wait_s", "vision_step_s", "vision_slice_s"), "lm"),
    (ENGINE, ("kv_cache_memory", "memory_fraction"), "lm"),
    (ENCODER, ("encode_token_budget", "encode_forward_s", "encoder_cache_bytes", "yield_to_decodes"), "encoders"),
    (MEDIA, MEDIA_FLAGS, "all"),
    (ENGINE, ("max_inflight_body_bytes",), "all"),
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


def up_deployment(args: argparse.Namespace) -> Deployment:
    """The ``Deployment`` of ``epdserve up``'s flags (nothing started yet)."""
    from epdserve.security.credentials import ClusterCredential, CredentialError, api_key_from
    from epdserve.up import Deployment

    try:
        # a fresh secret per run unless given: never one inherited from the shell's environment
        cluster = ClusterCredential.from_file(args.cluster_secret_file) if args.cluster_secret_file else None
    except CredentialError as e:
        usage_error(str(e))

    if args.mooncake_master and args.store_url:
        usage_error("--mooncake-master starts the deployment's own store: leave out --store-url")

    def forwarded(roles: str) -> list[str]:
        return [arg for _, flags, to in UP_FORWARDED if to == roles for arg in to_argv(args, flags)]

    vllm_args = vllm_args_of(args)
    if args.lm_engine == "vllm" and forwarded("lm"):
        # not translated: vLLM's own flags of the same meaning go in --vllm-args, as the operator knows them
        usage_error(f"{' '.join(forwarded('lm'))}: with --lm-engine vllm, give vLLM's flags in --vllm-args")
    try:
        deployment = Deployment(
            args.topology,
            args.model,
            host=args.host,
            port=args.port,
            pin=args.pin_cores,
            lend_cores=args.lend_cores,
            ec_connector=args.ec_connector,
            kv_connector=args.kv_connector,
            extra_pd_args=[
                *forwarded("models"),
                *forwarded("lm"),
                *forwarded("public"),
                *to_argv(args, STORE_CONSUMER_FLAGS, STORE_PREFIX),
            ],
            extra_encoder_args=[
                *forwarded("models"),
                *forwarded("encoders"),
                *to_argv(args, STORE_FLAGS, STORE_PREFIX),
            ],
            extra_router_args=[
                *forwarded("router"),
                *forwarded("public"),
                *to_argv(args, FRONTEND_FLAGS, FRONTEND_PREFIX),
            ],
            extra_args=[
                *forwarded("all"),
                *(["--log-format", args.log_format] if args.log_format else []),
                *(["--no-access-log"] if args.no_access_log else []),
            ],
            log_dir=Path(args.log_dir) if args.log_dir else None,
            api_key=api_key_from(args.api_key),
            admin_key=api_key_from(args.admin_key, ADMIN_KEY_ENV),
            cluster=cluster or ClusterCredential.generate(),
            verbose=True,
            mooncake_master=args.mooncake_master,
            **({"dispatch": args.dispatch} if args.dispatch else {}),
            sizing=None if args.force else up_sizing(args),
            log_json=args.log_format == "json",
            lm_engine=args.lm_engine,
            vllm_args=vllm_args,
            vllm_ec_extra={"store_url": args.store_url} if getattr(args, "store_url", None) else None,
            served_model_name=args.served_model_name or "",
        )
    except ValueError as e:  # e.g. a topology the language-model engine cannot run
        usage_error(str(e))
    return deployment


def vllm_args_of(args: argparse.Namespace) -> list[str]:
    """``--vllm-args``, split as a shell would (usage error: with another engine, or setting what
    ``up`` sets itself)."""
    from epdserve.integrations.vllm.launch import check_vllm_args

    if args.vllm_args and args.lm_engine != "vllm":
        usage_error("--vllm-args needs --lm-engine vllm")
    try:
        vllm_args = shlex.split(args.vllm_args or "")
        check_vllm_args(vllm_args)
    except ValueError as e:
        usage_error(f"--vllm-args: {e}" if "--vllm-args" not in str(e) else str(e))
    return vllm_args


# the flags that size a role's memory, as ``up`` hands them on (the rest: each role's default)
SIZING_ENGINE_FLAGS: tuple[str, ...] = ("dtype", "kernels", "device", "max_model_len", "max_num_seqs")
SIZING_ENGINE_FLAGS += ("max_num_batched_tokens", "num_kv_blocks", "block_size", "kv_cache_memory", "memory_fraction")
SIZING_ENGINE_FLAGS += ("max_pending_media_bytes", "max_inflight_body_bytes", "vision_slice_s")
SIZING_ENCODER_FLAGS: tuple[str, ...] = ("dtype", "kernels", "device", "encode_token_budget", "encoder_cache_bytes")
SIZING_ENCODER_FLAGS += ("max_pending_media_bytes", "max_inflight_body_bytes")


def up_sizing(args: argparse.Namespace) -> Settings:
    """What sizes ``up``'s roles: the flags given (each role's config supplies the rest)."""
    from epdserve.sizing import Settings

    def given(flags: tuple[str, ...]) -> dict[str, object]:
        return {name: getattr(args, name) for name in flags if getattr(args, name, None) is not None}

    return Settings(
        engine=given(SIZING_ENGINE_FLAGS),
        encoder=given(SIZING_ENCODER_FLAGS),
        router=values(args, FRONTEND_FLAGS, FRONTEND_PREFIX),
        ec_connector=args.ec_connector,
        kv_connector=args.kv_connector,
    )


def run_up_command(args: argparse.Namespace) -> int:
    from epdserve.up import run_up

    return run_up(up_deployment(args))


def add_up_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve up``: its own, and role flags it hands on (read from the roles' configs
    without importing them: the supervisor stays free of torch)."""
    from epdserve.topology import TOPOLOGIES_HELP, topology_arg

    s.add_argument("--topology", type=topology_arg, default="1e+1pd", help=f"{TOPOLOGIES_HELP} (default: 1e+1pd)")
    add_flags(s, SERVER, [MODEL], defaults=False)
    s.add_argument("--host", default="127.0.0.1", help="public interface; internal roles always use 127.0.0.1")
    s.add_argument(
        "--port",
        type=int,
        default=8000,
        help="public port (router or aggregated server); 0: a free one, said in the ready line",
    )
    s.add_argument("--pin-cores", action="store_true", help="pin encoders and PD workers to separate cores")
    s.add_argument(
        "--no-lend-cores",
        dest="lend_cores",
        action="store_false",
        help="with --pin-cores: each role computes on its own cores only (by default a computing encoder or "
        "engine also borrows the cores of the roles that are idle)",
    )
    s.add_argument(
        "--force",
        action="store_true",
        help="start even when the topology's estimated memory or process count exceeds this machine",
    )
    add_flags(s, EC, ["connector"], EC_PREFIX)
    s.add_argument(
        "--kv-connector",
        choices=("shm", "tcp"),
        default="shm",
        help="how prefill instances hand KV to decode instances in <N>e+<P>p+<D>d (default: shm)",
    )
    s.add_argument(
        "--lm-engine",
        choices=("epdserve", "vllm"),
        default="epdserve",
        help="what runs the language-model instances of <N>e+<M>pd: epdserve, or the installed vLLM "
        "with epdserve's EC connector (docs/vllm.md) (default: epdserve)",
    )
    s.add_argument(
        "--vllm-args",
        default="",
        help="with --lm-engine vllm: flags for every `vllm serve`, as one shell-quoted string passed verbatim "
        "(--vllm-args='--enforce-eager' when it is a single flag)",
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
    store = store_group(s)
    store.add_argument(
        "--mooncake-master",
        action="store_true",
        help="start a Mooncake master with the deployment and share encoder outputs through it "
        "(instead of --store-url)",
    )
    add_flags(store, STORE, STORE_FLAGS, STORE_PREFIX, defaults=False)
