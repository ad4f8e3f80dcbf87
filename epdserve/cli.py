"""The ``epdserve`` command line: one subcommand per role or tool."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn

from epdserve.assets import default_model_dir

if TYPE_CHECKING:
    from epdserve.media.limits import MediaLimits
    from epdserve.security.credentials import ClusterCredential


def _log_to_stderr() -> None:
    """One log format for every long-running role."""
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")


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

    client = openai.OpenAI(base_url=url.rstrip("/") + "/v1", api_key="none")
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


def _serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from epdserve.api.auth import AuthConfig
    from epdserve.engine.config import EngineConfig
    from epdserve.pd.server import ServerConfig, serve
    from epdserve.security.credentials import api_key_from
    from epdserve.transfer.config import ECConfig

    _log_to_stderr()
    cluster = _cluster_credential(args)
    limits = media_limits(args)
    engine = EngineConfig(
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        threads=args.threads,
    )
    config = ServerConfig(
        model=Path(args.model or default_model_dir()),
        served_model_name=args.served_model_name or "",
        host=args.host,
        port=args.port,
        engine=engine,
        limits=limits,
        vision=not args.no_vision_tower,
        max_prompt_chars=args.max_prompt_chars,
        enable_mm_embeds=args.enable_mm_embeds,
        ec=ECConfig(fs_dir=args.ec_fs_dir, secret=cluster.secret.decode() if cluster else ""),
        auth=AuthConfig(api_key=api_key_from(args.api_key), cluster=cluster, internal_only=args.internal_only),
    )
    serve(config)
    return 0


def _encoder(args: argparse.Namespace) -> int:
    from pathlib import Path

    from epdserve.api.auth import AuthConfig
    from epdserve.encoder.server import EncoderConfig, serve
    from epdserve.transfer.config import ECConfig

    _log_to_stderr()
    cluster = _cluster_credential(args)
    if cluster is None:
        _usage_error("the encoder needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file")
    ec = ECConfig(
        secret=cluster.secret.decode(),
        connector=args.ec_connector,
        shm_bytes=args.ec_shm_bytes,
        fs_dir=args.ec_fs_dir,
        tcp_port=args.ec_tcp_port,
        instance=args.ec_instance or f"encoder-{args.port}",
    )
    config = EncoderConfig(
        model=Path(args.model or default_model_dir()),
        served_model_name=args.served_model_name or "",
        host=args.host,
        port=args.port,
        encode_token_budget=args.encode_token_budget,
        batch_wait_ms=args.encode_batch_wait_ms,
        encoder_cache_bytes=args.encoder_cache_bytes,
        threads=args.threads,
        device=args.device,
        dtype=args.dtype,
        limits=media_limits(args),
        ec=ec,
        auth=AuthConfig(cluster=cluster),
    )
    serve(config)
    return 0


def add_encoder_args(s: argparse.ArgumentParser) -> None:
    """Flags of an encoder-only instance."""
    s.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: directory name)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--ec-connector", choices=("shm", "tcp", "fs"), default="shm", help="how embeddings reach the LM")
    s.add_argument(
        "--ec-shm-bytes",
        type=int,
        default=0,
        help="size of the shm connector's slab (0: 256 MiB, or half of the free space of /dev/shm if less)",
    )
    s.add_argument("--ec-fs-dir", default="", help="shared directory of the fs connector")
    s.add_argument("--ec-tcp-port", type=int, default=0, help="port of the tcp connector's data server (0: any)")
    s.add_argument("--ec-instance", default=None, help="name in slab/file names (default: encoder-<port>)")
    s.add_argument("--encode-token-budget", type=int, default=8192, help="most patch rows per vision forward")
    s.add_argument("--encode-batch-wait-ms", type=float, default=0.0, help="wait for more items before a forward")
    s.add_argument("--encoder-cache-bytes", type=int, default=512 << 20, help="local embedding cache size (0: off)")
    s.add_argument(
        "--threads", type=int, default=1, help="torch threads for the vision forward (0: torch default; see serve)"
    )
    s.add_argument("--device", default="cpu", help="torch device of the vision tower")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    add_cluster_args(s)
    add_media_args(s)


def add_engine_args(s: argparse.ArgumentParser) -> None:
    """Flags of a language-model instance, named as in vLLM where vLLM has them."""
    s.add_argument("--ec-fs-dir", default="", help="shared directory to accept fs-connector handles from")
    s.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: directory name)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-model-len", type=int, default=4096)
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-num-batched-tokens", type=int, default=1024)
    s.add_argument("--block-size", type=int, default=16)
    s.add_argument("--num-kv-blocks", type=int, default=2048)
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    s.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the engine (0: torch default). 1 is fastest for small models on few cores: "
        "2 threads made the embedded model 1.55x slower here (docs/benchmarks.md)",
    )
    s.add_argument("--no-vision-tower", action="store_true", help="metadata-only media: do not load the vision tower")
    add_public_args(s)
    s.add_argument(
        "--internal-only",
        action="store_true",
        help="serve only callers that hold the cluster credential (a worker behind a router)",
    )
    add_cluster_args(s)
    add_media_args(s)


def add_public_args(s: argparse.ArgumentParser) -> None:
    """Flags of a role that serves the public OpenAI API."""
    from epdserve.api.protocol import DEFAULT_MAX_PROMPT_CHARS

    s.add_argument(
        "--api-key",
        default=None,
        help="clients must send 'Authorization: Bearer <key>' (default: $EPD_API_KEY; unset: no key needed)",
    )
    s.add_argument(
        "--max-prompt-chars",
        type=int,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="most characters of text in one request; longer requests get 413 before any tokenization",
    )
    s.add_argument(
        "--enable-mm-embeds",
        action="store_true",
        help="accept clients' own image/video embeddings, inline only (never connector handles)",
    )


def add_cluster_args(s: argparse.ArgumentParser) -> None:
    """The internal credential every role of one deployment shares."""
    s.add_argument(
        "--cluster-secret-file",
        default=None,
        help="file holding the deployment's internal secret (default: $EPD_CLUSTER_SECRET; 'up' makes one)",
    )


def _usage_error(message: str) -> NoReturn:
    print(f"epdserve: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def _cluster_credential(args: argparse.Namespace) -> ClusterCredential | None:
    from epdserve.security.credentials import ClusterCredential, CredentialError

    try:
        return ClusterCredential.load(args.cluster_secret_file)
    except CredentialError as e:
        _usage_error(str(e))


def add_media_args(s: argparse.ArgumentParser) -> None:
    """Flags limiting client media, shared by every role that fetches and decodes media."""
    s.add_argument("--limit-mm-per-prompt", default=None, help='JSON, e.g. \'{"image": 8, "video": 2}\'')
    s.add_argument("--allowed-media-domains", nargs="*", default=None, help="hosts allowed for http(s) media")
    s.add_argument(
        "--allow-private-media", action="store_true", help="allow fetching media from private/loopback addresses"
    )
    s.add_argument("--media-fetch-timeout", type=float, default=10.0, help="seconds per http(s) media fetch")


def media_limits(args: argparse.Namespace) -> MediaLimits:
    """The ``MediaLimits`` of the flags ``add_media_args`` defines."""
    import json

    from epdserve.media.limits import MediaLimits

    mm = json.loads(args.limit_mm_per_prompt) if args.limit_mm_per_prompt else {}
    return MediaLimits(
        max_images_per_prompt=int(mm.get("image", 8)),
        max_videos_per_prompt=int(mm.get("video", 2)),
        allow_private_addresses=args.allow_private_media,
        allowed_media_domains=tuple(args.allowed_media_domains or ()),
        fetch_timeout_s=args.media_fetch_timeout,
    )


def _router(args: argparse.Namespace) -> int:
    from epdserve.api.auth import AuthConfig
    from epdserve.router.server import RouterConfig, serve_router
    from epdserve.security.credentials import ADMIN_KEY_ENV, api_key_from

    _log_to_stderr()
    cluster = _cluster_credential(args)
    if cluster is None:
        _usage_error("the router needs the cluster credential: set EPD_CLUSTER_SECRET or --cluster-secret-file")
    auth = AuthConfig(
        api_key=api_key_from(args.api_key), admin_key=api_key_from(args.admin_key, ADMIN_KEY_ENV), cluster=cluster
    )
    serve_router(
        RouterConfig(
            host=args.host,
            port=args.port,
            encoders=tuple(args.encoders),
            pds=tuple(args.pds),
            policy=args.policy,
            encoder_policy=args.encoder_policy,
            probe_interval_s=args.probe_interval,
            forward_raw_media=args.forward_raw_media,
            limits=media_limits(args),
            max_prompt_chars=args.max_prompt_chars,
            enable_mm_embeds=args.enable_mm_embeds,
            auth=auth,
        )
    )
    return 0


def _up(args: argparse.Namespace) -> int:
    from pathlib import Path

    from epdserve.security.credentials import ADMIN_KEY_ENV, ClusterCredential, CredentialError, api_key_from
    from epdserve.up import Deployment, run_up

    try:
        # a fresh secret per run unless given: never one inherited from the shell's environment
        cluster = ClusterCredential.from_file(args.cluster_secret_file) if args.cluster_secret_file else None
    except CredentialError as e:
        print(f"epdserve up: {e}", file=sys.stderr)
        return 2
    cluster = cluster or ClusterCredential.generate()
    lm_args = ["--served-model-name", args.served_model_name] if args.served_model_name else []
    lm_args += ["--threads", str(args.threads)] if args.threads is not None else []
    media_args = ["--allowed-media-domains", *args.allowed_media_domains] if args.allowed_media_domains else []
    media_args += ["--allow-private-media"] if args.allow_private_media else []
    pd_args = ["--max-model-len", str(args.max_model_len)] if args.max_model_len is not None else []
    deployment = Deployment(
        args.topology,
        args.model,
        host=args.host,
        port=args.port,
        pin=args.pin_cores,
        ec_connector=args.ec_connector,
        extra_pd_args=[*lm_args, *pd_args],
        extra_encoder_args=lm_args,
        extra_args=media_args,
        log_dir=Path(args.log_dir) if args.log_dir else None,
        api_key=api_key_from(args.api_key),
        admin_key=api_key_from(args.admin_key, ADMIN_KEY_ENV),
        cluster=cluster,
        verbose=True,
    )
    return run_up(deployment)


def _bench(args: argparse.Namespace) -> int:
    from epdserve.bench.loadgen import run_cli

    return run_cli(args)


def add_bench_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve bench`` (kept here so parsing does not import the benchmark's aiohttp client)."""
    s.add_argument("--url", default=None, help="server base URL, e.g. http://127.0.0.1:8000 (without /v1)")
    s.add_argument("--model", default=None, help="model name in requests (default: first id of /v1/models)")
    s.add_argument("-n", "--num-requests", type=int, default=100, help="measured requests")
    s.add_argument("--warmup", type=int, default=4, help="unmeasured requests sent first")
    s.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    s.add_argument("--request-rate", type=float, default=0.0, help="open loop: Poisson arrivals in req/s (0: closed)")
    s.add_argument("--seed", type=int, default=0, help="fixes payloads and arrival times")
    s.add_argument("--images-per-request", type=int, default=1, help="images in each image request (0-50)")
    s.add_argument("--image-size", type=int, default=0, help="resize images to this side in px (0: spec's 84-168)")
    s.add_argument("--prompt-tokens", type=int, default=0, help="pad the text to roughly this many tokens (0: none)")
    s.add_argument("--output-len", type=int, default=64, help="output tokens per request")
    s.add_argument(
        "--no-exact-output",
        action="store_true",
        help="send only max_tokens (for servers without min_tokens/ignore_eos)",
    )
    s.add_argument("--text-fraction", type=float, default=0.0, help='fraction of text-only requests (kind "text")')
    s.add_argument("--video-fraction", type=float, default=0.0, help='fraction of GIF-video requests (kind "video")')
    s.add_argument("--repeated-fraction", type=float, default=0.0, help="fraction of media from a small reused pool")
    s.add_argument("--image-pool", type=int, default=4, help="distinct images (and videos) in the reused pool")
    s.add_argument(
        "--slo",
        default=None,
        help="goodput SLO, e.g. ttft=500ms,itl=100ms,e2e=2s,tpot=50ms (bare numbers: ms); a request meets "
        "itl when its largest inter-token gap (max ITL) is within the bound",
    )
    s.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    s.add_argument("--out", default=None, help="write config, summaries and per-request timings as JSON here")
    s.add_argument("--plots", default=None, help="write TTFT/TPOT/ITL/E2E histogram+CDF PNGs into this directory")
    s.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    s.add_argument(
        "--self-test",
        action="store_true",
        help="run the load against an in-process instant server on 127.0.0.1 to show the client's own ceiling",
    )


def _sweep(args: argparse.Namespace) -> int:
    from epdserve.bench.sweep import run_cli

    return run_cli(args)


def add_sweep_args(s: argparse.ArgumentParser) -> None:
    """Flags of ``epdserve sweep`` (kept here so parsing does not import the benchmark or the launcher)."""
    s.add_argument("--out", required=True, help="directory for report.md, sweep.json, the heatmaps and role logs")
    s.add_argument("--topologies", default="aggregated,1e+1pd,2e+1pd", help="comma-separated, started in turn")
    s.add_argument("--images", default="1,4,10", help="images per request, comma-separated (heatmap rows, 0-50)")
    s.add_argument("--output-lens", default="16,64,256", help="output tokens per request (heatmap columns)")
    s.add_argument("--image-size", type=int, default=0, help="resize images to this side in px (0: spec's 84-168)")
    s.add_argument("--requests", type=int, default=16, help="measured requests per cell and topology")
    s.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each cell")
    arrival = s.add_mutually_exclusive_group()
    arrival.add_argument("--concurrency", type=int, default=4, help="closed loop: requests in flight")
    arrival.add_argument("--request-rate", type=float, default=0.0, help="open loop: Poisson arrivals in req/s")
    s.add_argument("--seed", type=int, default=0, help="fixes payloads and arrivals (the same in every topology)")
    s.add_argument("--slo", default=None, help="goodput SLO, e.g. ttft=500ms,e2e=2s (as in epdserve bench)")
    s.add_argument(
        "--mixed", action="store_true", help="also run 50:50 text/image traffic per images value (reported apart)"
    )
    s.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    s.add_argument("--pin-cores", action="store_true", help="pin encoders and PD workers to separate cores")
    s.add_argument("--ec-connector", choices=["shm", "tcp", "fs"], default="shm")
    s.add_argument("--pd-args", default="", help="extra flags of every PD worker, e.g. --pd-args='--threads 1'")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request")
    s.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="epdserve", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    commands: dict[str, Callable[[argparse.Namespace], int]] = {}

    s = sub.add_parser("model-path", help="print the directory of the embedded model")
    commands["model-path"] = _model_path

    s = sub.add_parser("demo", help="ask the embedded model questions about generated shapes images")
    s.add_argument("--model", default=None, help="model directory (default: embedded)")
    s.add_argument("--seed", type=int, default=7)
    s.add_argument("-n", type=int, default=5, help="number of questions")
    s.add_argument("--url", default=None, help="ask a running server (e.g. http://127.0.0.1:8000) instead")
    commands["demo"] = _demo

    s = sub.add_parser("eval-shapes", help="exact-match accuracy per question type (transformers, greedy)")
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
    commands["eval-shapes"] = _eval_shapes

    s = sub.add_parser("serve", help="serve the model: OpenAI-compatible API (aggregated E+P+D)")
    add_engine_args(s)
    commands["serve"] = _serve

    s = sub.add_parser("encoder", help="run an encoder-only instance (the E of EPD): media in, embeddings out")
    add_encoder_args(s)
    commands["encoder"] = _encoder

    s = sub.add_parser("router", help="the public OpenAI endpoint in front of encoder and PD workers")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--encoders", nargs="*", default=[], help="encoder base URLs")
    s.add_argument("--pds", nargs="*", default=[], help="prefill+decode worker base URLs")
    s.add_argument(
        "--policy", choices=["round_robin", "least_outstanding"], default="least_outstanding", help="PD choice"
    )
    s.add_argument(
        "--encoder-policy",
        choices=["affinity", "round_robin", "least_outstanding"],
        default="affinity",
        help="encoder choice; affinity sends the same media to the same encoder (cache hits)",
    )
    s.add_argument("--probe-interval", type=float, default=2.0, help="seconds between health probes")
    s.add_argument(
        "--forward-raw-media", action="store_true", help="skip the encoders; PD workers process media (baseline)"
    )
    add_public_args(s)
    s.add_argument(
        "--admin-key",
        default=None,
        help="key that worker registration (/v1/workers) needs (default: $EPD_ADMIN_KEY; unset: registration off)",
    )
    add_cluster_args(s)
    add_media_args(s)
    commands["router"] = _router

    s = sub.add_parser(
        "up",
        help="start a whole topology locally (aggregated, 1e+1pd, 2e+1pd, <N>e+<M>pd) and keep it running",
        description="Start every role, restart any that dies (same port, back-off 0.5 s doubling to 10 s), "
        "stop all on SIGINT/SIGTERM/SIGHUP (a second signal kills at once). Exit codes: 0 stopped by a "
        "signal, 1 a role failed to start, 2 bad flags or the public port is in use.",
    )
    from epdserve.up import topology_arg

    s.add_argument("--topology", type=topology_arg, default="1e+1pd", help="aggregated | <N>e+<M>pd (default 1e+1pd)")
    s.add_argument("--model", default=None, help="checkpoint directory (default: the embedded model)")
    s.add_argument("--host", default="127.0.0.1", help="public interface; internal roles always use 127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="public port (router or aggregated server)")
    s.add_argument("--pin-cores", action="store_true", help="pin encoders and PD workers to separate cores")
    s.add_argument("--ec-connector", choices=["shm", "tcp", "fs"], default="shm")
    s.add_argument("--log-dir", default=None, help="write each role's log here")
    s.add_argument("--api-key", default=None, help="key public clients must send (default: $EPD_API_KEY; none: open)")
    s.add_argument("--admin-key", default=None, help="key of the router's admin API (default: $EPD_ADMIN_KEY)")
    s.add_argument(
        "--cluster-secret-file", default=None, help="secret shared by the roles (default: a new one per run)"
    )
    s.add_argument("--max-model-len", type=int, default=None, help="of every LM instance (default: serve's)")
    s.add_argument("--served-model-name", default=None, help="model name clients use (default: directory name)")
    s.add_argument("--threads", type=int, default=None, help="torch threads per encoder and LM instance")
    s.add_argument("--allowed-media-domains", nargs="*", default=None, help="hosts allowed for http(s) media")
    s.add_argument("--allow-private-media", action="store_true", help="allow media from private/loopback addresses")
    commands["up"] = _up

    s = sub.add_parser("bench", help="load-test an OpenAI-compatible chat endpoint (TTFT/TPOT/ITL/E2E, goodput)")
    add_bench_args(s)
    commands["bench"] = _bench

    s = sub.add_parser("sweep", help="when does EPD pay here: a workload grid against each topology, gain heatmaps")
    add_sweep_args(s)
    commands["sweep"] = _sweep

    s = sub.add_parser("train-shapes", help="train the shapes-world model (see docs/model.md)")
    from epdserve.training.args import add_arguments

    add_arguments(s)
    commands["train-shapes"] = _train_shapes

    p.set_defaults(_commands=commands)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    return args._commands[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
