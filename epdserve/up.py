"""``epdserve up``: start a whole topology on this machine, wait for health, stop it cleanly.

Topologies: ``aggregated`` (one ``serve`` process doing E+P+D) or ``<N>e+<M>pd`` (N encoder
instances, M prefill+decode instances, one router on the public port). Every role is its own
process (its own process group), optionally pinned to cores. On Ctrl-C / SIGTERM every child is
stopped and any shared-memory slab a child left behind is removed.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from epdserve.launcher import free_port, start_role, stop, wait_healthy

TOPOLOGY = re.compile(r"^(?:(?P<agg>aggregated)|(?P<e>\d+)e\+(?P<pd>\d+)pd)$")


@dataclass(frozen=True)
class Topology:
    encoders: int  # 0 for aggregated
    pds: int

    @property
    def aggregated(self) -> bool:
        return self.encoders == 0

    @classmethod
    def parse(cls, text: str) -> Topology:
        m = TOPOLOGY.match(text.strip().lower())
        if not m:
            raise ValueError(f"topology must be 'aggregated' or '<N>e+<M>pd' (e.g. 1e+1pd), got {text!r}")
        if m["agg"]:
            return cls(0, 1)
        e, pd = int(m["e"]), int(m["pd"])
        if e < 1 or pd < 1:
            raise ValueError("a disaggregated topology needs at least one encoder and one pd instance")
        return cls(e, pd)


@dataclass
class Role:
    name: str
    url: str
    proc: subprocess.Popen


def plan_cores(topo: Topology, cores: list[int]) -> dict[str, list[int]]:
    """Split the cores between roles: encoders share a slice, PD workers the rest (one each
    where possible). The router and aggregated server use every core."""
    if topo.aggregated or len(cores) < 2:
        return {}
    n_enc = max(1, len(cores) * topo.encoders // (topo.encoders + topo.pds))
    n_enc = min(n_enc, len(cores) - 1)
    enc, pd = cores[:n_enc], cores[n_enc:]
    plan: dict[str, list[int]] = {}
    for i in range(topo.encoders):
        plan[f"encoder{i}"] = [enc[i % len(enc)]] if topo.encoders >= len(enc) else enc[i :: topo.encoders]
    for i in range(topo.pds):
        plan[f"pd{i}"] = [pd[i % len(pd)]] if topo.pds >= len(pd) else pd[i :: topo.pds]
    return plan


class Deployment:
    def __init__(
        self,
        topology: Topology,
        model: str | None,
        host: str = "127.0.0.1",
        port: int = 8000,
        pin: bool = False,
        ec_connector: str = "shm",
        extra_pd_args: list[str] | None = None,
        log_dir: Path | None = None,
        extra_router_args: list[str] | None = None,
    ) -> None:
        self.topology = topology
        self.model_args = ["--model", model] if model else []
        self.host = host
        self.port = port
        self.pin = pin
        self.ec_connector = ec_connector
        self.extra_pd_args = extra_pd_args or []
        self.extra_router_args = extra_router_args or []
        self.log_dir = log_dir
        self.roles: list[Role] = []
        self.secret = secrets.token_hex(16)
        self.fs_dir = Path("/tmp") / f"epd-ec-fs-{os.getpid()}"
        self.startup_s = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _start(self, name: str, args: list[str], port: int, cpus: list[int] | None) -> Role:
        log = str(self.log_dir / f"{name}.log") if self.log_dir else None
        proc = start_role([*args, "--host", self.host, "--port", str(port)], cpus, log, {"EPD_EC_SECRET": self.secret})
        role = Role(name, f"http://{self.host}:{port}", proc)
        self.roles.append(role)
        return role

    def start(self) -> None:
        t0 = time.time()
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        topo = self.topology
        try:
            if topo.aggregated:
                self._start("serve", ["serve", *self.model_args, *self.extra_pd_args], self.port, None)
            else:
                cores = plan_cores(topo, sorted(os.sched_getaffinity(0))) if self.pin else {}
                enc_urls, pd_urls = [], []
                for i in range(topo.encoders):
                    args = ["encoder", *self.model_args, "--ec-connector", self.ec_connector]
                    if self.ec_connector == "tcp":
                        args += ["--ec-tcp-port", str(free_port())]
                    elif self.ec_connector == "fs":
                        args += ["--ec-fs-dir", str(self.fs_dir)]
                    enc_urls.append(self._start(f"encoder{i}", args, free_port(), cores.get(f"encoder{i}")).url)
                # behind encoders the PD workers only see metadata-only media: no vision weights,
                # unless the router forwards raw media (the baseline of the metadata-only benchmark)
                no_vision = [] if "--forward-raw-media" in self.extra_router_args else ["--no-vision-tower"]
                for i in range(topo.pds):
                    args = ["serve", *self.model_args, *self.extra_pd_args, *no_vision]
                    if self.ec_connector == "fs":
                        args += ["--ec-fs-dir", str(self.fs_dir)]
                    pd_urls.append(self._start(f"pd{i}", args, free_port(), cores.get(f"pd{i}")).url)
                for r in self.roles:
                    wait_healthy(r.url, r.proc)
                args = ["router", "--encoders", *enc_urls, "--pds", *pd_urls, *self.extra_router_args]
                self._start("router", args, self.port, None)
            for r in self.roles:
                wait_healthy(r.url, r.proc)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.time() - t0

    def stop(self) -> None:
        # the public endpoint first, then the workers behind it
        for r in reversed(self.roles):
            if r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(r.proc.pid, signal.SIGTERM)
        for r in reversed(self.roles):
            stop(r.proc)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(r.proc.pid, signal.SIGKILL)  # anything the role left in its group
        remove_stale_segments([r.proc.pid for r in self.roles])
        if self.fs_dir.is_dir():
            shutil.rmtree(self.fs_dir, ignore_errors=True)
        self.roles = []


def remove_stale_segments(pids: list[int], shm_dir: str = "/dev/shm") -> list[str]:
    """Remove EC slabs left by the given (now dead) processes."""
    removed: list[str] = []
    d = Path(shm_dir)
    if not d.is_dir():
        return removed
    for f in d.glob("epd-ec-*"):
        m = re.search(r"-(\d+)$", f.name)
        if m and int(m.group(1)) in pids:
            f.unlink(missing_ok=True)
            removed.append(str(f))
    return removed


def run_up(deployment: Deployment) -> int:
    """Start, print the URL, block until SIGINT/SIGTERM, stop everything."""
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        deployment.start()
        print(
            f"epdserve up: {describe(deployment.topology)} ready in {deployment.startup_s:.1f}s at "
            f"{deployment.url}/v1  (Ctrl-C to stop)",
            flush=True,
        )
        while not stopping:
            for r in deployment.roles:
                if r.proc.poll() is not None:
                    print(f"epdserve up: {r.name} exited with {r.proc.returncode}; stopping", file=sys.stderr)
                    stopping = True
            time.sleep(0.2)
    finally:
        deployment.stop()
    return 0


def describe(t: Topology) -> str:
    return "aggregated" if t.aggregated else f"{t.encoders} encoder(s) + {t.pds} prefill/decode worker(s) + router"
