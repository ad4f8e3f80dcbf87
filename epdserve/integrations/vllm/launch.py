"""Starting ``vllm serve`` with epdserve's EC connector: the one place its command line is built
(``epdserve up --lm-engine vllm`` and the integration tests use it), where the installed ``vllm``
is found, and the small wrapper process ``up`` supervises in vLLM's place.

The wrapper (``python -m epdserve.integrations.vllm.launch --name pd0 -- vllm serve ...``) runs
vLLM as its child in its own process group, prefixes each of vLLM's output lines with the role's
name, passes a stop on to vLLM and leaves nothing of vLLM behind: vLLM gets SIGTERM from the
kernel when the wrapper dies, and whatever vLLM started is killed with the group once vLLM has
exited. Pinned, it moves vLLM's front end off the engine's cores once vLLM is up (``placement``).
vLLM- and torch-free: ``up`` imports it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from epdserve.integrations.vllm.placement import front_end_cpus, front_end_to

CONNECTOR = {
    "ec_connector": "EpdserveECConnector",
    "ec_connector_module_path": "epdserve.integrations.vllm.ec_connector",
    "ec_role": "ec_consumer",
}
# flags of ``vllm serve`` that ``up`` sets itself: given in --vllm-args they would move vLLM
# away from where the router and the encoders expect it
OWNED_FLAGS = ("--host", "--port", "--ec-transfer-config", "--served-model-name")
PARALLEL_FLAGS = ("--tensor-parallel-size", "-tp", "--pipeline-parallel-size", "-pp", "--data-parallel-size", "-dp")
# what ``up`` says of the memory of vLLM instances, which its fit check does not count
SIZES_ITSELF = "which size their own memory (VLLM_CPU_KVCACHE_SPACE on CPUs, --gpu-memory-utilization on GPUs)"
START_TIMEOUT_S = 900.0  # vLLM loads, profiles and warms up before its /health answers
STOP_GRACE_S = 20.0  # how long vLLM has to shut down after a stop before its group is killed
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class VllmNotFound(RuntimeError):
    """No usable ``vllm`` here: not installed, or installed where epdserve is not."""


def ec_transfer_config(extra: dict | None = None) -> str:
    """``--ec-transfer-config``'s value: epdserve's connector as an EC consumer (docs/vllm.md)."""
    return json.dumps({**CONNECTOR, "ec_connector_extra_config": extra or {}})


def serve_command(
    vllm: str,
    model: str,
    served_name: str,
    host: str,
    port: int,
    ec_extra: dict | None = None,
    vllm_args: Sequence[str] = (),
    connector: bool = True,
) -> list[str]:
    """``vllm serve`` of ``model`` at ``host:port`` under ``served_name`` (the identity handles
    carry), with epdserve's connector unless ``connector`` is false (a plain vLLM), and the
    operator's own flags last, verbatim."""
    cmd = [vllm, "serve", model, "--host", host, "--port", str(port), "--served-model-name", served_name]
    if connector:
        cmd += ["--ec-transfer-config", ec_transfer_config(ec_extra)]
    return [*cmd, *vllm_args]


def vllm_cpu_binding(cores: Sequence[int] | None, vllm_args: Sequence[str]) -> dict[str, str]:
    """The environment that binds the model worker of vLLM's CPU build to ``cores``
    (``VLLM_CPU_OMP_THREADS_BIND``; GPU builds ignore it). Nothing when no cores are planned,
    when the operator set the variable, or with tensor, pipeline or data parallelism, whose ranks
    each need a list of their own."""
    parallel = any(a.split("=", 1)[0] in PARALLEL_FLAGS for a in vllm_args)
    if not cores or parallel or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return {}
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(str(c) for c in cores)}


def check_vllm_args(args: Sequence[str]) -> None:
    """ValueError when the operator's flags set what ``up`` sets itself."""
    for arg in args:
        name = arg.split("=", 1)[0]
        if name in OWNED_FLAGS:
            raise ValueError(f"--vllm-args may not set {name}: epdserve up sets it for each vLLM instance")


def find_vllm() -> str:
    """The ``vllm`` executable: the one installed beside this interpreter, else the first on PATH,
    provided its interpreter can import both vLLM and epdserve (the connector runs inside vLLM)."""
    beside = Path(sys.executable).with_name("vllm")
    found = str(beside) if beside.is_file() and os.access(beside, os.X_OK) else shutil.which("vllm")
    if found is None:
        raise VllmNotFound(
            f"vLLM is not installed: no `vllm` beside {sys.executable} nor on PATH "
            "(pip install 'epdserve[vllm]' into one environment; docs/vllm.md)"
        )
    python = _interpreter_of(found)
    if python is not None:
        probe = "import importlib.util as u, sys; sys.exit(not (u.find_spec('vllm') and u.find_spec('epdserve')))"
        try:
            ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=60).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if not ok:
            raise VllmNotFound(
                f"{found} runs {python}, which cannot import both vllm and epdserve "
                "(install epdserve into vLLM's environment; docs/vllm.md)"
            )
    return found


def _interpreter_of(script: str) -> str | None:
    """The Python a console script runs (its ``#!`` line), None when it says no plain path."""
    try:
        with open(script, "rb") as f:
            first = f.readline(4096).decode(errors="replace")
    except OSError:
        return None
    if not first.startswith("#!"):
        return None
    parts = first[2:].split()
    return parts[0] if len(parts) == 1 and os.path.isabs(parts[0]) else None


WRAPPER = "epdserve.integrations.vllm.launch"  # the module ``up`` runs for each vLLM instance
RPC_DIR_ENV = "VLLM_RPC_BASE_PATH"  # where vLLM creates its processes' ZMQ sockets


def wrapper_args(
    name: str, cmd: Sequence[str], log_json: bool = False, front_end: tuple[Sequence[int], str] | None = None
) -> list[str]:
    """The wrapper's arguments for one vLLM instance (``python -m`` WRAPPER these); ``front_end``:
    the cores vLLM's API server moves to once vLLM answers at the URL."""
    placed = ["--front-end-cpus", ",".join(map(str, front_end[0])), "--url", front_end[1]] if front_end else []
    return ["--name", name, *(["--log-format", "json"] if log_json else []), *placed, "--", *cmd]


def _die_with_parent() -> None:
    """In vLLM's child, before exec: SIGTERM from the kernel when the wrapper dies."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def prefixed(name: str, line: str, log_json: bool) -> str:
    """One of vLLM's output lines as the wrapper writes it: ``[pd0 vllm] ...``, or a JSON object
    as epdserve's roles log them (``--log-format json``)."""
    line = line.rstrip("\r\n")
    if not log_json:
        return f"[{name} vllm] {line}\n"
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    return json.dumps({"time": stamp, "level": "INFO", "logger": f"vllm.{name}", "message": line}) + "\n"


def run_wrapped(
    name: str, cmd: Sequence[str], log_json: bool = False, front_end: tuple[Sequence[int], str] | None = None
) -> int:
    """Run ``cmd`` (vLLM), its lines prefixed on our stderr, until it exits; a SIGTERM, SIGINT
    or SIGHUP is passed on to it (SIGKILL after ``STOP_GRACE_S``). Its exit code is ours (128 +
    signal when a signal ended it). ``front_end``: (cores, URL) as in ``wrapper_args``.

    vLLM's processes talk over ZMQ sockets it creates in ``VLLM_RPC_BASE_PATH`` (the temporary
    directory by default) and leaves behind when it stops, a handful each start; unless the
    operator chose that directory, each start gets a private one, removed once vLLM is gone."""
    env, rpc_dir = None, None
    if RPC_DIR_ENV not in os.environ:
        rpc_dir = tempfile.mkdtemp(prefix=f"epd-vllm-{name}-")
        env = {**os.environ, RPC_DIR_ENV: rpc_dir}
    try:
        return _run(name, cmd, log_json, front_end, env)
    finally:
        if rpc_dir is not None:
            shutil.rmtree(rpc_dir, ignore_errors=True)


def _run(
    name: str,
    cmd: Sequence[str],
    log_json: bool,
    front_end: tuple[Sequence[int], str] | None,
    env: dict[str, str] | None,
) -> int:
    try:
        child = subprocess.Popen(
            list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent, env=env
        )
    except OSError as e:
        sys.stderr.write(prefixed(name, f"could not start {cmd[0]}: {e}", log_json))
        return 127
    stop_at: list[float] = []

    def on_signal(signum: int, frame: object) -> None:
        if not stop_at:
            stop_at.append(time.monotonic())
            child.send_signal(signal.SIGTERM)

    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, on_signal)
    assert child.stdout is not None
    # copied by a thread: vLLM's helpers hold the pipe too, so its end is no sign that vLLM exited
    copier = threading.Thread(target=_copy, args=(child.stdout, name, log_json), daemon=True)
    copier.start()
    if front_end:

        def say(text: str) -> None:
            _write(prefixed(name, text, log_json))

        threading.Thread(target=front_end_to, args=(child, *front_end, START_TIMEOUT_S, say), daemon=True).start()
    while (code := child.poll()) is None:
        if stop_at and time.monotonic() - stop_at[0] > STOP_GRACE_S:
            child.kill()
        time.sleep(0.1)
    if os.getpgrp() == os.getpid():  # our own group (as ``up`` starts us), not a shell's
        # vLLM's own helpers (its engine core) are in it: none outlives the instance
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.killpg(os.getpgrp(), signal.SIGTERM)
    copier.join(timeout=5)  # their last lines, once they are gone
    return 128 - code if code < 0 else code


def _copy(pipe: IO[bytes], name: str, log_json: bool) -> None:
    for raw in pipe:
        # a progress bar redraws its line after each carriage return: each drawing is a line of
        # the log, with its prefix, not text that a terminal would draw over the prefix
        for part in raw.replace(b"\r\n", b"\n").split(b"\r"):
            if part.strip():
                _write(prefixed(name, part.decode(errors="replace"), log_json))


def _write(line: str) -> None:
    sys.stderr.write(line)  # one call a line: the copier's and the mover's lines do not interleave
    sys.stderr.flush()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m epdserve.integrations.vllm.launch", description=__doc__)
    p.add_argument("--name", required=True, help="the role's name, prefixed to every line")
    p.add_argument("--log-format", choices=("text", "json"), default="text")
    p.add_argument(
        "--front-end-cpus", type=front_end_cpus, help="cores for vLLM's API server once it is up (with --url)"
    )
    p.add_argument("--url", help="vLLM's base URL, whose /health says it is up")
    p.add_argument("cmd", nargs=argparse.REMAINDER, help="-- then vLLM's command line")
    args = p.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        p.error("no command to run")
    if (args.front_end_cpus is None) != (args.url is None):
        p.error("--front-end-cpus and --url go together")
    front_end = (args.front_end_cpus, args.url) if args.url else None
    return run_wrapped(args.name, cmd, args.log_format == "json", front_end)


if __name__ == "__main__":
    sys.exit(main())
