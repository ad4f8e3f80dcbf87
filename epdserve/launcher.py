"""Start epdserve role processes locally, tie their lives to ours, and wait for them to become healthy."""

from __future__ import annotations

import ctypes
import errno
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from epdserve.common.health import MAX_HEALTH_BYTES, is_other_role

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# a role's exit code when it had started and then lost its engine core: restart it, it was no failed start
ENGINE_CORE_DIED_EXIT = 3
# a role's exit code when its port is taken: ``up`` reports a taken public port, not a failed role
PORT_IN_USE_EXIT = 4


class Cancelled(Exception):
    """A wait was abandoned because a stop was requested."""


def python_module(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` with this interpreter. ``-P``: the working directory is
    not put first on the import path, where a folder named like a package (a clone of this
    repository, seen from its parent) would shadow the installed one; PYTHONPATH still counts."""
    return [sys.executable, "-P", "-m", module, *args]


# the ports ``free_port`` picks from (below Kubernetes' NodePort range too, whose rules may catch a
# node's own connections), and how many random ones it tries before it asks the kernel
FIXED_PORT_FLOOR, FIXED_PORT_CEILING = 10000, 30000
FIXED_PORT_TRIES = 64
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def ephemeral_ports(source: Path = EPHEMERAL_RANGE) -> range:
    """The ports the kernel gives outgoing connections and ``bind(port 0)`` (Linux's default
    when ``source`` cannot be read)."""
    try:
        low, high = (int(v) for v in source.read_text().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on ``host`` now. Nothing holds it for the caller: any process may take it.

    It is picked at random below the kernel's ephemeral range (and below 30000), because a role
    binds its port only once its model has loaded: a port inside that range could meanwhile
    become the local end of any process's outgoing connection (a client, vLLM's own sockets), and
    the role would find it taken. Below the range only another server can take it. The kernel's
    own pick when that range is too small or every try is busy."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    address = host.strip("[]")
    choose = rng or random.SystemRandom()
    top = min(ephemeral_ports().start, FIXED_PORT_CEILING)
    for _ in range(FIXED_PORT_TRIES if top > FIXED_PORT_FLOOR else 0):
        port = choose.randrange(FIXED_PORT_FLOOR, top)
        with socket.socket(family) as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def port_available(host: str, port: int) -> bool:
    """Whether a server could listen on ``host:port`` now. SO_REUSEADDR as the roles' servers set it,
    so a port whose old connections linger in TIME_WAIT counts as free, one with a listener does not."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def is_healthy(url: str, timeout: float = 1.0, role: str | None = None) -> bool:
    """``url`` answers /health with 200 and, given ``role``, names no other role (whatever holds a
    port that ``role`` was to bind is not ``role``)."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as r:
            return bool(r.status == 200) and (role is None or is_other_role(r.read(MAX_HEALTH_BYTES + 1), role) is None)
    except (OSError, urllib.error.URLError):
        return False


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel send the child SIGTERM when its parent dies, however the
    parent dies (SIGKILL included). SIGTERM rather than SIGKILL so the role still runs its shutdown
    and unlinks its shared-memory slab. The setting survives exec (of ``taskset`` and of python).
    Everything is looked up here, in the parent: between fork and exec the child may only call."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl: nobody would tell us
            os._exit(1)

    return preexec


def start_role(
    args: Sequence[str],
    cpus: Sequence[int] | None = None,
    log_path: str | None = None,
    env: Mapping[str, str | None] | None = None,
    module: str = "epdserve.cli",
) -> subprocess.Popen:
    """``epdserve <args>`` (``python -m module <args>``) as a child process in its own process
    group (optionally pinned to cpus).

    ``env`` adds variables to ours; a value of None removes one. The child gets SIGTERM when the
    thread that started it ends (PR_SET_PDEATHSIG follows the creating thread): start roles from a
    thread that lives as long as they should, normally the main thread."""
    cmd = python_module(module, *args)
    if cpus:
        cmd = ["taskset", "-c", ",".join(str(c) for c in cpus), *cmd]
    child_env = dict(os.environ, PYTHONUNBUFFERED="1")
    for k, v in (env or {}).items():
        if v is None:
            child_env.pop(k, None)
        else:
            child_env[k] = v
    log = open(log_path, "ab") if log_path else None  # noqa: SIM115 - closed below, the child has its copy
    try:
        return subprocess.Popen(
            cmd,
            env=child_env,
            stdout=log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT if log else None,
            # its own group: a terminal's Ctrl-C reaches only the parent, which stops roles in order
            start_new_session=True,
            preexec_fn=_die_with_parent(),
        )
    finally:
        if log:
            log.close()


def process_children() -> dict[int, list[int]]:
    """Parent pid -> the pids of its children, from /proc."""
    children: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(p.name))
    return children


def process_tree(pids: list[int]) -> list[int]:
    """The processes and all their descendants (from /proc), each once: a role and what it started."""
    children = process_children()
    todo, seen = list(pids), dict[int, None]()  # insertion-ordered: the roots first
    while todo:
        pid = todo.pop()
        if pid not in seen:
            seen[pid] = None
            todo += children.get(pid, [])
    return list(seen)


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float = 180.0, cancelled: Callable[[], bool] | None = None
) -> float:
    """Seconds until ``url`` answered /health; raises if the process died, time ran out, or
    ``cancelled()`` became true (``Cancelled``)."""
    t0 = time.time()
    while time.time() - t0 < timeout:
        if cancelled is not None and cancelled():
            raise Cancelled(url)
        if proc.poll() is not None:
            raise RuntimeError(f"process {proc.args!r} exited with {proc.returncode}")
        if is_healthy(url, timeout=0.5):
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
