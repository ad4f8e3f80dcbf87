"""The ``epdserve`` command line: one subcommand per role or tool.

A role's flags are fields of its config dataclasses (``epdserve.config_flags``): default, help
and choices are read from the dataclass; each role's ``flags`` module, beside its config, says
which fields its command offers, and under which name where the flag is older than the field;
this module only assembles the subcommands. ``main`` builds the flags of the
chosen command alone, so a light command (``up``, ``bench``, ``--help``) never imports a role's
modules, torch among them.
"""

from __future__ import annotations

import argparse
import errno
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from epdserve.allocator import keep_freed_memory
from epdserve.api.flags import (
    ADMIN_KEY,
    API_KEY,
    AUTH,
    EXPOSURE,
    MODEL,
    QUOTA,
    QUOTA_FLAGS,
    REGISTRATION,
    REGISTRATION_FLAGS,
    add_log_args,
)
from epdserve.assets import default_model_dir
from epdserve.config_flags import add_flags, usage_error, values
from epdserve.encoder.flags import ENCODER, ENCODER_FLAGS
from epdserve.engine.flags import ENGINE, ENGINE_FLAGS
from epdserve.launcher import PORT_IN_USE_EXIT, port_available
from epdserve.media.flags import MEDIA, MEDIA_FLAGS
from epdserve.models.config import ConfigError
from epdserve.models.registry import UnknownArchitectureError
from epdserve.pd.flags import PUBLIC_FLAGS, SERVER, SERVER_FLAGS
from epdserve.router.flags import FRONTEND, FRONTEND_FLAGS, FRONTEND_PREFIX, ROUTER, ROUTER_FLAGS
from epdserve.security.credentials import ADMIN_KEY_ENV
from epdserve.shapes_cli import (
    CommandError,
    add_demo_args,
    add_eval_args,
    add_train_args,
    demo,
    eval_shapes,
    train_shapes,
)
from epdserve.store.flags import STORE, STORE_CONSUMER_FLAGS, STORE_FLAGS, STORE_PREFIX, store_group
from epdserve.transfer.flags import EC, EC_CONSUMER_FLAGS, EC_PREFIX, EC_PRODUCER_FLAGS, KV_FLAGS, KV_PREFIX
from epdserve.up_cli import add_up_args, run_up_command
from epdserve.up_cli import up_deployment as up_deployment  # the Deployment of up's flags, for its callers

if TYPE_CHECKING:
    from epdserve.api.registration import RegistrationConfig
    from epdserve.encoder.config import EncoderConfig
    from epdserve.media.limits import MediaLimits
    from epdserve.pd.config import ServerConfig
    from epdserve.router.config import RouterConfig
    from epdserve.security.credentials import ClusterCredential

T = TypeVar("T")


def _log_to_stderr(args: argparse.Namespace) -> None:
    """One log format for every long-running role (``--log-format``); the engine core process it
    starts logs the same way (``EPD_LOG_FORMAT``, inherited)."""
    import os

    from epdserve.common import logs

    os.environ[logs.LOG_FORMAT_ENV] = args.log_format
    logs.setup(args.log_format, access=not args.no_access_log)


def _checked(build: Callable[[], T]) -> T:
    """A config built from flags; a value its dataclass refuses is a usage error, as argparse's own are."""
    try:
        return build()
    except ValueError as e:
        usage_error(str(e))


def _model_path(args: argparse.Namespace) -> int:
    print(default_model_dir())
    return 0


# ---- roles -----------------------------------------------------------------------------------------


def _model(args: argparse.Namespace) -> Path:
    return Path(args.model) if args.model else default_model_dir()


def _cluster_credential(args: argparse.Namespace) -> ClusterCredential | None:
    from epdserve.security.credentials import ClusterCredential, CredentialError

    try:
        return ClusterCredential.load(args.cluster_secret_file)
    except CredentialError as e:
        usage_error(str(e))


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The ``MediaLimits`` of the flags ``add_media_args`` defines."""
    from epdserve.media.limits import MediaLimits

    per_prompt = args.limit_mm_per_prompt or {}
    counts = {f"max_{m}s_per_prompt": n for m, n in per_prompt.items()}
    return _checked(lambda: MediaLimits(**values(args, MEDIA_FLAGS), **counts))


def serve_config(args: argparse.Namespace) -> ServerConfig:
    """The ``ServerConfig`` of ``epdserve serve``'s flags."""
    from epdserve.api.auth import AuthConfig
    from epdserve.common.dtypes import check_device
    from epdserve.common.store_config import StoreConfig
    from epdserve.engine.config import EngineConfig
    from epdserve.pd.config import ServerConfig
    from epdserve.security.credentials import api_key_from
    from epdserve.transfer.config import ECConfig

    cluster = _cluster_credential(args)
    secret = cluster.secret.decode() if cluster else ""
    engine = _checked(lambda: EngineConfig(**values(args, ENGINE_FLAGS)))
    registration = registration_config(args, args.kv_connector if args.role == "prefill" else None)
    kv = None
    if args.role != "both":  # the KV connector: a prefill instance's producer, a decode instance's consumer
        from epdserve.transfer.kv import kv_config

        if cluster is None:
            usage_error(
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
            auth=AuthConfig(
                api_key=api_key_from(args.api_key),
                cluster=cluster,
                internal_only=args.internal_only,
                names=_names(registration),
            ),
            registration=registration,
            **public_limits(args),
        )
    )
    _checked(lambda: check_device(config.engine.device))
    return config


def encoder_config(args: argparse.Namespace) -> EncoderConfig:
    """The ``EncoderConfig`` of ``epdserve encoder``'s flags."""
    from epdserve.api.auth import AuthConfig
    from epdserve.common.dtypes import check_device
    from epdserve.common.store_config import StoreConfig
    from epdserve.encoder.config import EncoderConfig
    from epdserve.transfer.config import ECConfig

    cluster = _cluster_credential(args)
    if cluster is None:
        usage_error("the encoder needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file")
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
            auth=AuthConfig(cluster=cluster, names=_names(registration)),
            registration=registration,
        )
    )
    _checked(lambda: check_device(config.device))
    return config


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The ``RouterConfig`` of ``epdserve router``'s flags."""
    from epdserve.api.auth import AuthConfig
    from epdserve.router.config import RouterConfig
    from epdserve.router.frontend_decode import FrontendDecodeConfig
    from epdserve.security.credentials import api_key_from

    cluster = _cluster_credential(args)
    if cluster is None:
        usage_error("the router needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file")
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
            **public_limits(args),
        )
    )


def public_limits(args: argparse.Namespace) -> dict[str, Any]:
    """The public endpoint's per-key limits and exposure (``quota``, ``exposure``) of its flags."""
    from epdserve.api.exposure import ExposureConfig
    from epdserve.api.quota import QuotaConfig

    return {
        "quota": _checked(lambda: QuotaConfig(**values(args, QUOTA_FLAGS))),
        "exposure": ExposureConfig(**values(args, ["public_metrics"])),
    }


def _serve(args: argparse.Namespace) -> int:
    from epdserve.pd.launch import launch_core

    config = serve_config(args)
    _check_port(config.host, config.port)
    _log_to_stderr(args)
    core = launch_core(config)  # loads the model while the front end imports (nothing heavy so far)
    from epdserve.pd.server import serve

    serve(config, core)
    return 0


def _encoder(args: argparse.Namespace) -> int:
    from epdserve.encoder.app import serve

    config = encoder_config(args)
    _check_port(config.host, config.port)
    _log_to_stderr(args)
    serve(config)
    return 0


def _router(args: argparse.Namespace) -> int:
    from epdserve.router.app import serve_router

    config = router_config(args)
    _check_port(config.host, config.port)
    _log_to_stderr(args)
    serve_router(config)
    return 0


def _check_port(host: str, port: int) -> None:
    """A role's port, checked before it loads anything (a racer can still take it: bind says so then)."""
    if not port_available(host, port):
        raise OSError(errno.EADDRINUSE, f"port {port} on {host} is in use (another epdserve?)")


# ---- flags -----------------------------------------------------------------------------------------


def add_engine_args(s: argparse.ArgumentParser) -> None:
    """Flags of a language-model instance, named as in vLLM where vLLM has them."""
    add_flags(s, SERVER, [MODEL, *SERVER_FLAGS, *PUBLIC_FLAGS])
    add_flags(s.add_argument_group("engine"), ENGINE, ENGINE_FLAGS)
    add_flags(s.add_argument_group("EC connector (consumer)"), EC, EC_CONSUMER_FLAGS, EC_PREFIX)
    add_flags(store_group(s), STORE, STORE_CONSUMER_FLAGS, STORE_PREFIX)
    kv = s.add_argument_group("KV connector (--role prefill: producer; decode: consumer)")
    add_flags(kv, EC, KV_FLAGS, KV_PREFIX)
    credentials = s.add_argument_group("credentials")
    add_flags(credentials, AUTH, [API_KEY, "internal_only"])
    add_cluster_args(credentials)
    add_public_limit_args(s)
    add_registration_args(s)
    add_media_args(s)
    add_log_args(s)


def add_encoder_args(s: argparse.ArgumentParser) -> None:
    """Flags of an encoder-only instance."""
    add_flags(s, ENCODER, [MODEL, *ENCODER_FLAGS])
    add_flags(s.add_argument_group("EC connector (producer)"), EC, EC_PRODUCER_FLAGS, EC_PREFIX)
    add_flags(store_group(s), STORE, STORE_FLAGS, STORE_PREFIX)
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
    add_public_limit_args(s)
    add_media_args(s)
    add_log_args(s)


def add_public_limit_args(s: argparse.ArgumentParser) -> None:
    """Per-key limits and what /metrics shows without credentials (the public endpoint's)."""
    group = s.add_argument_group("per-key limits (429 with Retry-After) and exposure")
    add_flags(group, QUOTA, QUOTA_FLAGS)
    add_flags(group, EXPOSURE, ["public_metrics"])


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
        usage_error(f"listening on {args.host}: set --advertise-host, the address peers dial for tcp transfers")
    return reg


def _names(registration: RegistrationConfig) -> tuple[str, ...]:
    """Hosts peers may address this role by besides its socket's address (internal requests'
    proofs name the host they were sent to)."""
    return (registration.advertise_host,) if registration.advertise_host else ()


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


def _bench(args: argparse.Namespace) -> int:
    from epdserve.bench.loadgen import run_cli

    return run_cli(args)


def add_bench_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve bench``."""
    from epdserve.bench.loadgen import add_cli_flags

    add_cli_flags(s)


def _sweep(args: argparse.Namespace) -> int:
    from epdserve.bench.sweep_cli import run_cli

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


# ---- commands --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    help: str  # one line in ``epdserve --help``
    run: Callable[[argparse.Namespace], int]
    add_args: Callable[[argparse.ArgumentParser], None] | None = None
    description: str | None = None  # ``epdserve <command> --help``'s text (default: help)


COMMANDS = {
    "model-path": Command("print the directory of the embedded model", _model_path),
    "demo": Command("ask the embedded model questions about generated shapes images", demo, add_demo_args),
    "eval-shapes": Command("exact-match accuracy per question type (transformers, greedy)", eval_shapes, add_eval_args),
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
        run_up_command,
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
    "train-shapes": Command("train the shapes-world model (see docs/embedded-model.md)", train_shapes, add_train_args),
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
    debug_help = "show an error's traceback (default: one line saying what happened and what to do)"
    p.add_argument("--debug", action="store_true", help=debug_help)
    sub = p.add_subparsers(dest="cmd", metavar="command")
    for name, command in COMMANDS.items():
        s = sub.add_parser(
            name, help=command.help, description=command.description or command.help, formatter_class=DefaultsShown
        )
        # after the command too; SUPPRESS: absent there, it leaves the one before the command alone
        s.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
        if command.add_args is not None and only in (None, name):
            command.add_args(s)
    return p


def _error_line(e: BaseException) -> tuple[str, int]:
    """An error as one line saying what happened and what to do, and the exit code that goes with it."""
    if isinstance(e, (CommandError, ConfigError, UnknownArchitectureError)):  # the user's to fix
        return str(e), 2
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:  # a port taken after the check, by a racer
        return f"{e.strerror}: stop what holds the port or choose another with --port", PORT_IN_USE_EXIT
    return f"{type(e).__name__}: {e} (run with --debug for the traceback)", 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(only=next((a for a in argv if not a.startswith("-")), ""))
    args = parser.parse_args(argv)
    if args.cmd is None:  # a bare ``epdserve``: what it can do
        parser.print_help()
        return 0
    keep_freed_memory()  # before the command allocates anything large
    try:
        return COMMANDS[args.cmd].run(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        line, code = _error_line(e)
        print(f"epdserve {args.cmd}: error: {line}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
