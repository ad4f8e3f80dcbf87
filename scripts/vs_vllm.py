"""Benchmark: epdserve vs vLLM 0.32 (CPU build), aggregated and E+PD, same checkpoint,
same workload, one run on this machine.

vLLM is a measuring stick, never a dependency, and this script is not part of the package: it
drives the tested recipe in ``shared/peers/vllm-cpu`` beside this repository (or ``VLLM_PEER``;
set ``LAB`` to the folder where its ``setup.sh`` installed vLLM). Per system it records startup
time to healthy, resident memory of the whole process tree after the run, and the bench summary
(request throughput, TTFT p50/p99, TPOT p50).

    LAB=~/vllm-peer python scripts/vs_vllm.py --requests 64 --concurrency 4 --output-len 64 --image-size 448
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
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


def start_epdserve(topology: str, pin: bool, dtype: str) -> Running:
    models = ["--dtype", dtype]  # every encoder and language-model instance
    d = Deployment(
        Topology.parse(topology), None, port=free_port(), pin=pin, extra_pd_args=models, extra_encoder_args=models
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


def start_vllm(topology: str, model: Path) -> Running:
    lab = os.environ.get("LAB")
    if not lab:
        raise SystemExit("set LAB to the folder of the vLLM peer install (shared/peers/vllm-cpu/setup.sh)")
    env = dict(os.environ, MODEL=str(model))
    t0 = time.time()
    if topology == "aggregated":
        port = 8110
        subprocess.run(
            ["bash", str(PEER / "serve_single.sh"), str(model), str(port), "--enforce-eager"], env=env, check=True
        )
        names, url = [f"serve_{port}"], f"http://127.0.0.1:{port}"
    else:
        subprocess.run(["bash", str(PEER / "start_epd.sh")], env=env, check=True, cwd=lab)
        names, url = ["epd_E", "epd_PD", "epd_proxy"], "http://127.0.0.1:8300"
        _replace_proxy(Path(lab))
    _wait(url, 400)
    startup = time.time() - t0
    pids = [int((Path(lab) / "logs" / f"{n}.pid").read_text()) for n in names]

    def stop() -> None:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        time.sleep(3)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    return Running(url, pids, stop, startup)


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


def bench_one(system: str, topology: str, args, workload: WorkloadConfig, model: Path) -> list[dict]:
    """Start one system, measure it at every concurrency, stop it; one row per concurrency."""
    run = start_vllm(topology, model) if system == "vllm" else start_epdserve(topology, args.pin_cores, args.dtype)
    rows = []
    try:
        for conc in args.concurrency:
            cfg = BenchConfig(
                url=run.url,
                model="tiny" if system == "vllm" else "",  # the recipe's served name; its E+PD proxy has no /v1/models
                workload=workload,
                num_requests=args.requests,
                warmup=8,
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
    """Per run, topology and concurrency: epdserve over vLLM (req/s, TTFT p50, startup, RSS, PSS)."""
    out = []
    key = lambda r: (r["run"], r["topology"], r["concurrency"])  # noqa: E731
    vllm = {key(r): r for r in rows if r["system"] == "vllm"}
    for r in rows:
        v = vllm.get(key(r))
        if r["system"] != "epdserve" or v is None:
            continue
        out.append(
            {
                "run": r["run"],
                "topology": r["topology"],
                "concurrency": r["concurrency"],
                "req_per_s": r["req_per_s"] / v["req_per_s"],
                "ttft_p50": r["ttft_p50_ms"] / v["ttft_p50_ms"],
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
    ap.add_argument("--runs", type=int, default=1, help="repeat everything; the summary is the median ratio")
    ap.add_argument("--systems", default="epdserve:aggregated,vllm:aggregated,epdserve:1e+1pd,vllm:1e+1pd")
    ap.add_argument("--pin-cores", action="store_true", help="pin epdserve's encoder and PD to separate cores")
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["float32", "bfloat16", "float16"],
        help="epdserve's precision (the vLLM recipe serves bfloat16: the same by default)",
    )
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = default_model_dir()
    workload = WorkloadConfig(images_per_request=1, image_size=args.image_size, output_len=args.output_len)
    rows = []
    for run in range(args.runs):
        for spec in args.systems.split(","):  # the systems interleaved within each run
            system, topology = spec.split(":")
            rows += [{"run": run, **r} for r in bench_one(system, topology, args, workload, model)]
    print(
        f"\n{args.requests} requests per cell, 1 image of {args.image_size} px, {args.output_len} output tokens "
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
    print("\nepdserve / vLLM, median over runs (each run's ratio in brackets)\n")
    print("| topology | conc | req/s | TTFT p50 | startup | RSS | PSS |")
    print("|---|---|---|---|---|---|---|")
    cells = sorted({(r["topology"], r["concurrency"]) for r in rat})
    for topo, conc in cells:
        mine = [r for r in rat if (r["topology"], r["concurrency"]) == (topo, conc)]

        def med(k: str, mine: list[dict] = mine) -> str:
            vals = [r[k] for r in mine]
            return f"{statistics.median(vals):.2f}x [{', '.join(f'{v:.2f}' for v in vals)}]"

        print(
            f"| {topo} | {conc} | {med('req_per_s')} | {med('ttft_p50')} | {med('startup')} | {med('rss')} | {med('pss')} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows, "ratios": rat}, indent=2))


if __name__ == "__main__":
    main()
