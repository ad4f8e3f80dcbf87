"""A server whose engine core process dies: the open stream ends with an error event, /health
says 503, and the server exits non-zero so a supervisor restarts it (``epdserve up`` does:
tests/test_up.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
from pathlib import Path

from epdserve.launcher import free_port, start_role, stop, wait_healthy
from tests.server_utils import http

MODEL = "embedded"


def core_pid(server_pid: int) -> int:
    """The engine core: the serve process's child running ``epdserve.engine.core_proc``."""
    for task in Path(f"/proc/{server_pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"epdserve.engine.core_proc" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise AssertionError("no engine core process under the server")


def test_core_death_fails_the_stream_reports_unhealthy_and_exits(model_dir: Path) -> None:
    port = free_port()
    proc = start_role(["serve", "--port", str(port), "--max-model-len", "2048", "--num-kv-blocks", "256"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        name = json.loads(http("GET", f"{url}/v1/models")[1])["data"][0]["id"]
        body = json.dumps(
            {
                "model": name,
                "messages": [{"role": "user", "content": "Describe the image."}],
                "max_tokens": 1500,
                "ignore_eos": True,
                "stream": True,
            }
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            head = (
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            sock.sendall(head.encode() + body)
            seen = b""
            while seen.count(b"data:") < 3:  # streaming tokens
                chunk = sock.recv(65536)
                assert chunk, "stream ended before tokens came"
                seen += chunk
            os.kill(core_pid(proc.pid), signal.SIGKILL)
            while b"[DONE]" not in seen:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                seen += chunk
        assert b'"error"' in seen and b"The engine failed" in seen
        assert seen.index(b"data: [DONE]") > seen.index(b"The engine failed")  # the error, then the end
        status, _ = http("GET", f"{url}/health", timeout=5)
        assert status == 503
        assert proc.wait(timeout=30) == 3  # non-zero: a supervisor restarts it
    finally:
        stop(proc)
