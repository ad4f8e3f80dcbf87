"""Start real epdserve processes on loopback for integration tests."""

from __future__ import annotations

import json
import os
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.security.credentials import ClusterCredential
from epdserve.security.peers import sign

if TYPE_CHECKING:
    import openai

# scripts/gpu_check.sh runs some tests on a GPU: where the engine runs and at what precision
TEST_DEVICE = os.environ.get("EPD_TEST_DEVICE", "cpu")
TEST_DTYPE = os.environ.get("EPD_TEST_DTYPE", "float32")


def device_args() -> list[str]:
    """``--device``/``--dtype`` for a role under test (cpu, float32 unless the environment says)."""
    return ["--device", TEST_DEVICE, "--dtype", TEST_DTYPE]


SIGN = "X-Test-Sign-Internal"  # a marker ``http`` replaces by the request's own proof


def internal_headers() -> dict[str, str]:
    """Ask ``http``/``post_json`` to prove the test session's cluster credential on this request
    (a MAC bound to the URL, method and body, as the router sends its workers)."""
    return {SIGN: "1"}


def signed_headers(method: str, url: str, body: bytes = b"", now: float | None = None) -> dict[str, str]:
    """The proof of the test session's cluster credential for one request."""
    cred = ClusterCredential.load()
    assert cred is not None, "tests/conftest.py sets EPD_CLUSTER_SECRET"
    return sign(cred, method, url, body, now)


@contextmanager
def running(args: list[str]) -> Iterator[str]:
    """Run ``epdserve <args> --port P`` and yield its base URL; stop it afterwards."""
    port = free_port()
    proc = start_role([*args, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        stop(proc)


def http(
    method: str, url: str, body: bytes | None = None, timeout: float = 60.0, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One plain HTTP request; returns (status, body) for error statuses too."""
    headers = dict(headers or {})
    if headers.pop(SIGN, None):
        headers.update(signed_headers(method, url, body or b""))
    req = urllib.request.Request(
        url, data=body, method=method, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def post_json(url: str, payload: object, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, body = http("POST", url, json.dumps(payload).encode(), headers=headers)
    return status, json.loads(body)


def counter(url: str, name: str) -> float:
    """The value of the unlabelled metric ``epd_<name>`` on a role's ``/metrics``."""
    status, body = http("GET", url + "/metrics")
    assert status == 200
    m = re.search(rf"^epd_{re.escape(name)} (\S+)$", body.decode(), re.MULTILINE)
    assert m is not None, f"epd_{name} not in {url}/metrics"
    return float(m[1])


def openai_client(url: str, timeout: float = 120.0, api_key: str = "none") -> openai.OpenAI:
    """An OpenAI client of ``url`` (a base URL without ``/v1``) that does not retry. The servers
    under test speak plain HTTP on loopback, so no TLS certificates are loaded: loading them is
    most of what making a client costs, and the tests make one per request."""
    import openai

    http_client = openai.DefaultHttpxClient(verify=False, timeout=timeout)
    return openai.OpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout, http_client=http_client)


def wait_until(check: Callable[[], object], timeout: float = 10.0) -> bool:
    """Whether ``check()`` holds within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return bool(check())
