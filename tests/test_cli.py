"""The command line is derived from the config dataclasses: no flag given means exactly the
dataclass defaults, every flag reaches its field, Literal fields accept only their values, bad
values are usage errors (exit 2), and ``up`` hands role flags on without importing the roles."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import openai
import pytest

from epdserve import cli, shapes_cli
from epdserve.api.auth import AuthConfig
from epdserve.assets import default_model_dir
from epdserve.bench import loadgen, sweep
from epdserve.bench.report import BenchConfig
from epdserve.bench.sweep import SweepConfig
from epdserve.bench.workload import WorkloadConfig
from epdserve.config_flags import Flag, add_flags, field_info, to_argv, values
from epdserve.encoder.server import EncoderConfig
from epdserve.engine.config import EngineConfig
from epdserve.media.limits import MediaLimits
from epdserve.pd.config import ServerConfig
from epdserve.router.server import RouterConfig
from epdserve.security.credentials import ClusterCredential
from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import producer_bytes


@pytest.fixture(autouse=True)
def no_keys_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keys' defaults come from the environment: none here, whatever the shell has."""
    monkeypatch.delenv("EPD_API_KEY", raising=False)
    monkeypatch.delenv("EPD_ADMIN_KEY", raising=False)


def parse(*argv: str) -> argparse.Namespace:
    return cli.build_parser(only=argv[0]).parse_args(list(argv))


def cluster() -> ClusterCredential:
    cred = ClusterCredential.load()
    assert cred is not None, "tests/conftest.py sets EPD_CLUSTER_SECRET"
    return cred


def secret() -> str:
    return cluster().secret.decode()


# ---- no flag: the dataclass defaults --------------------------------------------------------------


def test_serve_without_flags_is_the_dataclass_defaults() -> None:
    got = cli.serve_config(parse("serve"))
    expected = ServerConfig(model=default_model_dir(), ec=ECConfig(secret=secret()), auth=AuthConfig(cluster=cluster()))
    assert got == expected
    assert got.engine == EngineConfig() and got.limits == MediaLimits()


def test_encoder_without_flags_is_the_dataclass_defaults() -> None:
    got = cli.encoder_config(parse("encoder"))
    port = EncoderConfig(model=Path()).port
    ec = ECConfig(secret=secret(), instance=f"encoder-{port}")  # the one default the CLI sets: unique per port
    assert got == EncoderConfig(model=default_model_dir(), ec=ec, auth=AuthConfig(cluster=cluster()))


def test_router_without_flags_is_the_dataclass_defaults() -> None:
    assert cli.router_config(parse("router")) == RouterConfig(auth=AuthConfig(cluster=cluster()))


def test_bench_and_sweep_without_flags_are_the_dataclass_defaults(tmp_path: Path) -> None:
    assert loadgen.config_from_args(parse("bench")) == BenchConfig()
    got = sweep.config_from_args(parse("sweep", "--out", str(tmp_path)))
    assert got == SweepConfig(log_dir=tmp_path / "logs", command=got.command)


def test_up_without_flags_hands_nothing_on() -> None:
    d = cli.up_deployment(parse("up"))
    assert (d.extra_pd_args, d.extra_encoder_args, d.extra_args, d.extra_router_args) == ([], [], [], [])
    assert (d.host, d.port, d.ec_connector, d.pin) == ("127.0.0.1", 8000, ECConfig().connector, False)


def test_every_flag_default_is_its_field_default() -> None:
    """Flag by flag, for every table the commands use: argparse's default is the field's default
    (or None where the table says the command decides)."""
    tables: list[tuple[str, object, tuple, str]] = [
        ("serve", ServerConfig, cli.SERVER_FLAGS + cli.PUBLIC_FLAGS, "--"),
        ("serve", EngineConfig, cli.ENGINE_FLAGS, "--"),
        ("serve", ECConfig, cli.EC_CONSUMER_FLAGS, cli.EC_PREFIX),
        ("serve", MediaLimits, cli.MEDIA_FLAGS, "--"),
        ("encoder", EncoderConfig, cli.ENCODER_FLAGS, "--"),
        ("encoder", ECConfig, cli.EC_PRODUCER_FLAGS, cli.EC_PREFIX),
        ("router", RouterConfig, cli.ROUTER_FLAGS + cli.PUBLIC_FLAGS, "--"),
        ("bench", BenchConfig, loadgen.BENCH_FLAGS, "--"),
        ("bench", WorkloadConfig, loadgen.WORKLOAD_FLAGS, "--"),
        ("sweep", SweepConfig, sweep.SWEEP_FLAGS + sweep.ARRIVAL_FLAGS, "--"),
    ]
    checked = 0
    for command, config, flags, prefix in tables:
        argv = [command, "--out", "x"] if command == "sweep" else [command]
        args = parse(*argv)
        fields = {f.name: f for f in dataclasses.fields(config)}  # type: ignore[arg-type]
        for spec in flags:
            flag = spec if isinstance(spec, Flag) else Flag(spec)
            f = fields[flag.field]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            got = getattr(args, flag.dest(prefix))
            if flag.default is None:
                assert got is None, (command, flag)
            else:
                assert got == default, (command, flag.option(prefix), got, default)
            checked += 1
    assert checked >= 50


# ---- every flag reaches its field -----------------------------------------------------------------


def test_serve_flags_reach_their_fields(tmp_path: Path) -> None:
    argv = "serve --model /m --served-model-name x --host 0.0.0.0 --port 9 --no-vision-tower --max-prompt-chars 7"
    argv += " --enable-mm-embeds --max-model-len 512 --max-num-seqs 3 --max-num-batched-tokens 99 --block-size 8"
    argv += " --num-kv-blocks 100 --no-enable-prefix-caching --threads 2 --device cpu --dtype bfloat16"
    argv += f" --ec-fs-dir {tmp_path} --api-key k --internal-only --allowed-media-domains a.example B.example."
    argv += ' --allow-private-media --media-fetch-timeout 3 --limit-mm-per-prompt {"video":0}'
    c = cli.serve_config(parse(*argv.split()))
    assert (c.model, c.served_model_name, c.host, c.port, c.vision) == (Path("/m"), "x", "0.0.0.0", 9, False)
    assert (c.max_prompt_chars, c.enable_mm_embeds) == (7, True)
    assert c.engine == EngineConfig(
        max_model_len=512,
        max_num_seqs=3,
        max_num_batched_tokens=99,
        block_size=8,
        num_kv_blocks=100,
        enable_prefix_caching=False,
        threads=2,
        device="cpu",
        dtype="bfloat16",
    )
    assert c.ec.fs_dir == str(tmp_path)
    assert (c.auth.api_key, c.auth.internal_only) == ("k", True)
    assert c.limits == MediaLimits(
        allowed_media_domains=("a.example", "b.example"),
        allow_private_addresses=True,
        fetch_timeout_s=3.0,
        max_videos_per_prompt=0,
    )


def test_encoder_flags_reach_their_fields() -> None:
    argv = "encoder --served-model-name x --port 9 --encode-token-budget 64 --encode-batch-wait-ms 5"
    argv += " --encoder-cache-bytes 0 --threads 0 --device cpu --dtype float16 --ec-connector tcp"
    argv += " --ec-shm-bytes 2097152 --ec-tcp-port 7 --ec-instance e1 --limit-mm-per-prompt {}"
    argv += " --ec-tcp-bytes 8MiB"
    c = cli.encoder_config(parse(*argv.split()))
    assert (c.served_model_name, c.port, c.encode_token_budget, c.batch_wait_ms) == ("x", 9, 64, 5.0)
    assert (c.encoder_cache_bytes, c.threads, c.device, c.dtype) == (0, 0, "cpu", "float16")
    assert (c.ec.connector, c.ec.shm_bytes, c.ec.tcp_port, c.ec.instance) == ("tcp", 2 << 20, 7, "e1")
    assert c.ec.tcp_bytes == 8 << 20 and producer_bytes(c.ec) == 8 << 20  # what its account counts


def test_router_flags_reach_their_fields() -> None:
    argv = "router --encoders http://e1 http://e2 --pds http://p --policy round_robin --encoder-policy"
    argv += " least_outstanding --probe-interval 0.5 --dispatch adaptive --api-key a --admin-key b"
    c = cli.router_config(parse(*argv.split()))
    assert (c.encoders, c.pds) == (("http://e1", "http://e2"), ("http://p",))
    assert (c.policy, c.encoder_policy, c.probe_interval_s, c.dispatch) == (
        "round_robin",
        "least_outstanding",
        0.5,
        "adaptive",
    )
    assert (c.auth.api_key, c.auth.admin_key) == ("a", "b")


def test_bench_flags_reach_their_fields() -> None:
    c = loadgen.config_from_args(
        parse("bench", "--url", "http://h:1/", "-n", "3", "--no-exact-output", "--image-pool", "2")
    )
    assert (c.url, c.num_requests, c.workload.exact_output, c.workload.pool_size) == ("http://h:1", 3, False, 2)


def test_up_hands_role_flags_on_to_the_right_roles() -> None:
    argv = "up --served-model-name x --threads 2 --device cuda:1 --dtype bfloat16 --max-model-len 512"
    argv += " --allowed-media-domains a.example --no-allow-private-media --ec-connector fs"
    d = cli.up_deployment(parse(*argv.split()))
    models = ["--served-model-name", "x", "--threads", "2", "--device", "cuda:1", "--dtype", "bfloat16"]
    assert d.extra_encoder_args == models
    assert d.extra_pd_args == [*models, "--max-model-len", "512"]
    assert d.extra_args == ["--allowed-media-domains", "a.example", "--no-allow-private-media"]
    assert d.ec_connector == "fs"
    # what up hands on, the roles parse to the same values
    serve = parse("serve", *d.extra_pd_args, *d.extra_args)
    assert (serve.device, serve.dtype, serve.max_model_len, serve.allow_private_media) == (
        "cuda:1",
        "bfloat16",
        512,
        False,
    )
    encoder = parse("encoder", *d.extra_encoder_args, *d.extra_args)
    assert (encoder.device, encoder.dtype, encoder.threads) == ("cuda:1", "bfloat16", 2)
    # the worker and router options a new user reaches for
    argv = "up --max-num-seqs 4 --no-enable-prefix-caching --num-kv-blocks 64 --encode-token-budget 900"
    argv += " --encoder-cache-bytes 0 --max-prompt-chars 100 --enable-mm-embeds --encoder-policy round_robin"
    argv += " --log-format json --log-stats-interval 5 --api-key k --no-access-log"
    d = cli.up_deployment(parse(*argv.split()))
    serve = parse("serve", *d.extra_pd_args, *d.extra_args)
    assert serve.no_access_log and parse("encoder", *d.extra_encoder_args, *d.extra_args).no_access_log
    assert (serve.max_num_seqs, serve.enable_prefix_caching, serve.num_kv_blocks) == (4, False, 64)
    assert (serve.max_prompt_chars, serve.enable_mm_embeds, serve.log_format) == (100, True, "json")
    assert serve.log_stats_interval == 5
    encoder = parse("encoder", *d.extra_encoder_args, *d.extra_args)
    assert (encoder.encode_token_budget, encoder.encoder_cache_bytes, encoder.log_format) == (900, 0, "json")
    router = parse("router", *d.extra_router_args, *d.extra_args)
    assert (router.encoder_policy, router.max_prompt_chars, router.enable_mm_embeds) == ("round_robin", 100, True)
    assert router.no_access_log and not parse("router").no_access_log
    assert d.api_key == "k"


def test_the_cli_explains_itself(capsys: pytest.CaptureFixture[str]) -> None:
    """A bare ``epdserve`` prints its commands, ``--version`` its version, and every option of every
    command has a sentence of help, its default shown where it has one, and no internal jargon."""
    from epdserve import __version__

    assert cli.main([]) == 0
    assert "up " in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"epdserve {__version__}"
    for name in cli.COMMANDS:
        parser = cli.build_parser(only=name)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
        for action in sub._actions:
            if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
                continue
            assert action.help and len(action.help) > 8, f"{name} {action.option_strings} has no help"
        text = sub.format_help()
        for jargon in ("runs 1-3", "spec's", "2x their", "issue "):
            assert jargon not in text, f"{name} --help says {jargon!r}"
        if name in ("serve", "encoder", "router", "bench"):
            assert text.count("(default:") >= 10, f"{name} --help shows few defaults"


# ---- choices and bad values -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--dtype", "float64"],
        ["encoder", "--dtype", "int8"],
        ["encoder", "--ec-connector", "nfs"],
        ["router", "--policy", "affinity"],  # a PD worker has no per-item key to be affine to
        ["router", "--encoder-policy", "random"],
        ["up", "--dtype", "x"],
        ["up", "--ec-connector", "nfs"],
        ["sweep", "--out", "x", "--ec-connector", "nfs"],
        ["serve", "--block-size", "zero"],
        ["serve", "--limit-mm-per-prompt", "{not json"],
        ["serve", "--limit-mm-per-prompt", '{"pointcloud": 1}'],
        ["serve", "--limit-mm-per-prompt", '{"image": -1}'],
    ],
)
def test_values_outside_a_flags_type_or_choices_are_usage_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: epdserve {argv[0]}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--block-size", "0"],
        ["serve", "--max-model-len", "999999"],
        ["serve", "--device", "tpu"],
        ["encoder", "--ec-shm-bytes", "5"],
        ["encoder", "--encode-token-budget", "0"],
        ["router", "--media-fetch-timeout", "0"],
    ],
)
def test_values_a_config_refuses_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.startswith("epdserve: error: ")


def test_literal_choices_are_the_literal_types_values() -> None:
    """The choices read from the source are what typing says the field's type allows."""
    for config, name in [
        (EngineConfig, "dtype"),
        (EncoderConfig, "dtype"),
        (ECConfig, "connector"),
        (RouterConfig, "policy"),
        (RouterConfig, "encoder_policy"),
        (SweepConfig, "ec_connector"),
    ]:
        hint = typing.get_type_hints(config)[name]
        assert field_info(config, name).choices == typing.get_args(hint), (config, name)


# ---- the flag machinery ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Example:
    size: int = 3  # how many
    mode: typing.Literal["a", "b"] = "a"  # which one
    names: tuple[str, ...] = ()  # any names
    on: bool = True  # whether
    where: Path | None = None  # a place
    undocumented: int = 0
    nested: MediaLimits = dataclasses.field(default_factory=MediaLimits)  # not a flag's type


def test_flags_from_a_dataclass_round_trip_through_to_argv() -> None:
    p = argparse.ArgumentParser()
    flags = ("size", "mode", "names", Flag("on", "--switch"), "where")
    add_flags(p, _Example, flags)
    assert values(p.parse_args([]), flags) == {"size": 3, "mode": "a", "names": (), "on": True}
    args = p.parse_args(["--size", "5", "--mode", "b", "--names", "x", "y", "--no-switch", "--where", "/w"])
    got = values(args, flags)
    assert got == {"size": 5, "mode": "b", "names": ("x", "y"), "on": False, "where": Path("/w")}
    assert values(p.parse_args(to_argv(args, flags)), flags) == got
    assert "(default: 3)" in p.format_help() and "which one" in p.format_help()


def test_a_field_without_a_comment_or_with_an_unflaggable_type_has_no_flag() -> None:
    with pytest.raises(ValueError, match="no one-line # comment"):
        add_flags(argparse.ArgumentParser(), _Example, ["undocumented"])
    with pytest.raises(TypeError, match="no command-line flag for a field of type MediaLimits"):
        add_flags(argparse.ArgumentParser(), _Example, ["nested"])


# ---- the real command -----------------------------------------------------------------------------


def test_serve_help_lists_the_derived_flags() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "epdserve.cli", "serve", "--help"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    out = " ".join(done.stdout.split())  # argparse wraps lines
    for text in (
        "--dtype {float32,bfloat16,float16}",
        "--device DEVICE",
        "--no-vision-tower",
        "--enable-prefix-caching, --no-enable-prefix-caching",
        "prompt + output tokens per request (default: 4096)",
        "--ec-fs-dir",
        "--limit-mm-per-prompt",
        "--internal-only",
    ):
        assert text in out, text


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_help(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main([command, "--help"])
    assert e.value.code == 0
    assert f"usage: epdserve {command}" in capsys.readouterr().out


def test_up_parses_its_flags_without_loading_torch() -> None:
    code = (
        "import sys; from epdserve.cli import build_parser, up_deployment; "
        "up_deployment(build_parser('up').parse_args(['up', '--dtype', 'float16', '--threads', '2'])); "
        "print(sorted(m for m in ('torch', 'aiohttp', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_demo_against_a_server_sends_the_api_key_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from epdserve.launcher import free_port, start_role, stop, wait_healthy

    port = free_port()
    server = start_role(
        ["serve", "--port", str(port), "--max-model-len", "512", "--num-kv-blocks", "64"],
        env={"EPD_API_KEY": "demo-key"},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, server)
        monkeypatch.setenv("EPD_API_KEY", "demo-key")
        ask = shapes_cli._server_asker(url)
        assert isinstance(ask("How many shapes are there?", [], []), str)
        monkeypatch.delenv("EPD_API_KEY")
        with pytest.raises(openai.AuthenticationError):
            shapes_cli._server_asker(url)
    finally:
        stop(server)
