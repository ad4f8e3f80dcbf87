"""A real redis-server for tests: loopback, a free port, a random password, nothing on disk."""

from __future__ import annotations

import secrets
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from epdserve.launcher import free_port


@dataclass
class RedisServer:
    url: str
    password: str
    proc: subprocess.Popen

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return bool(s.recv(64))
    except OSError:
        return False


@contextmanager
def redis_server(maxmemory: str = "64mb") -> Iterator[RedisServer]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (scripts/test.sh installs it: apt-get install redis-server)")
    port, password = free_port(), secrets.token_hex(16)
    args = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--requirepass", password, "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 10
        while not _answers(port):
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"redis-server did not start on port {port}")
            time.sleep(0.05)
        yield RedisServer(f"redis://127.0.0.1:{port}/0", password, proc)
    finally:
        proc.kill()
        proc.wait()
