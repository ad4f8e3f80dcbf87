"""Start epdserve role processes locally and wait for them to become healthy."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_healthy(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return bool(r.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def start_role(
    args: Sequence[str], cpus: Sequence[int] | None = None, log_path: str | None = None, env: dict | None = None
) -> subprocess.Popen:
    """``epdserve <args>`` as a child process in its own process group (optionally pinned to cpus)."""
    cmd = [sys.executable, "-m", "epdserve.cli", *args]
    if cpus:
        cmd = ["taskset", "-c", ",".join(str(c) for c in cpus), *cmd]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the child
    return subprocess.Popen(
        cmd,
        env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
        stdout=out,
        stderr=subprocess.STDOUT if log_path else None,
        start_new_session=True,
    )


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 180.0) -> float:
    """Seconds until ``url`` answered /health; raises if the process died or time ran out."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        if is_healthy(url):
            return time.time() - t0
        time.sleep(0.1)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
