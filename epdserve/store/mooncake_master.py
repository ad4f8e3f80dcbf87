"""A Mooncake master process for a deployment on one host (``epdserve up --mooncake-master``) and
for tests: every port it opens on loopback, started and stopped with the deployment.

The master only coordinates (which member holds which entry; eviction); the entries live in the
memory encoders lend to the pool. The wheel ships the ``mooncake_master`` binary; no metadata
server runs (members meet in peer-to-peer handshake mode).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

from epdserve.launcher import free_port, stop

MASTER_BINARY = "mooncake_master"


@dataclass
class MooncakeMaster:
    url: str  # mooncake://127.0.0.1:<rpc port>, the store url of every member
    proc: subprocess.Popen

    def stop(self) -> None:
        stop(self.proc, timeout=10)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def master_binary() -> str | None:
    # the wheel installs it beside this interpreter's console scripts, which need not be on PATH
    # (a virtual environment's python run by its full path)
    return shutil.which(MASTER_BINARY) or shutil.which(MASTER_BINARY, path=sysconfig.get_path("scripts"))


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def start_master(log: Path | None = None, timeout_s: float = 20.0) -> MooncakeMaster:
    """Start a master on free loopback ports and wait until it accepts connections."""
    exe = master_binary()
    if exe is None:
        raise RuntimeError(f"{MASTER_BINARY} is not installed (pip install 'epdserve[mooncake]')")
    rpc, metrics = free_port(), free_port()
    args = [
        exe,
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={metrics}",
        "--enable_http_metadata_server=false",
    ]
    out = open(log, "ab") if log is not None else subprocess.DEVNULL  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while not _listening(rpc):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc, timeout=5)
            raise RuntimeError(f"{MASTER_BINARY} did not start on port {rpc}")
        time.sleep(0.05)
    return MooncakeMaster(f"mooncake://127.0.0.1:{rpc}", proc)
