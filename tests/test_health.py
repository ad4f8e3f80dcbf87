"""Every role's /health names the role, and whoever probes an address checks it: the router's pools
and ``up`` never take one role for another that holds its port."""

from __future__ import annotations

import json
import time

import pytest

from epdserve.common.health import MAX_HEALTH_BYTES, health_body, is_other_role, named_role
from epdserve.launcher import free_port, is_healthy, start_role, stop, wait_healthy
from epdserve.supervisor import Role
from tests.server_utils import http

MODEL = "shapes-qwen2vl"
ADMIN_KEY = "test-admin-key-0123456789"
PD_ARGS = ["--max-model-len", "256", "--num-kv-blocks", "32"]


@pytest.mark.parametrize(
    "body",
    [
        b"",  # vLLM's /health
        b"OK",
        b"[1, 2]",
        b'{"status": "ok"}',
        b'{"status": "ok", "role": 7}',
        b'{"status": "ok", "role": "pd"' + b" " * MAX_HEALTH_BYTES + b"}",
        b"\xff\xfe{",
    ],
)
def test_an_answer_naming_no_readable_role_is_taken_at_its_status(body: bytes) -> None:
    assert named_role(body) is None
    assert is_other_role(body, "pd") is None


def test_an_answer_naming_another_role_is_told_apart() -> None:
    body = json.dumps(health_body("encoder", extra=1)).encode()
    assert named_role(body) == "encoder"
    assert is_other_role(body, "encoder") is None
    assert is_other_role(body, "pd") == "encoder"


def test_a_role_is_known_by_its_name() -> None:
    kinds = {n: Role(n, "http://x", []).kind for n in ("serve", "router", "encoder0", "encoder12", "pd1", "prefill0")}
    assert kinds == {
        "serve": "pd",
        "router": "router",
        "encoder0": "encoder",
        "encoder12": "encoder",
        "pd1": "pd",
        "prefill0": "prefill",
    }


def test_a_router_never_takes_an_encoder_for_a_language_model_worker() -> None:
    """An encoder at an address the router was told holds a PD worker fails the health probe (it
    would answer every chat request 404): requests go to the real worker only, and the operator
    sees the misplaced address unhealthy. The roles name themselves to ``is_healthy`` too."""
    enc_port, pd_port, port = free_port(), free_port(), free_port()
    enc, pd = f"http://127.0.0.1:{enc_port}", f"http://127.0.0.1:{pd_port}"
    procs = [start_role(["encoder", "--port", str(enc_port)]), start_role(["serve", "--port", str(pd_port), *PD_ARGS])]
    try:
        for url, proc in zip((enc, pd), procs, strict=True):
            wait_healthy(url, proc)
        assert is_healthy(enc, role="encoder") and is_healthy(enc)
        assert not is_healthy(enc, role="pd")
        assert is_healthy(pd, role="pd") and not is_healthy(pd, role="encoder")
        router = start_role(
            ["router", "--port", str(port), "--pds", enc, pd, "--policy", "round_robin", "--probe-interval", "0.2"],
            env={"EPD_ADMIN_KEY": ADMIN_KEY},
        )
        procs.append(router)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, router)
        assert is_healthy(url, role="router")

        def pds() -> dict[str, bool]:
            raw = http("GET", url + "/v1/workers", headers={"Authorization": f"Bearer {ADMIN_KEY}"})[1]
            return {w["url"]: w["healthy"] for w in json.loads(raw)["pds"]}

        deadline = time.monotonic() + 30  # named workers count as healthy until their first probe
        while pds() != {enc: False, pd: True} and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pds() == {enc: False, pd: True}
        health = json.loads(http("GET", url + "/health")[1])
        assert health["role"] == "router" and health["pds"] == 1
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(4):  # round robin over both would send every other one to the encoder
            status, raw = http("POST", url + "/v1/chat/completions", json.dumps(body).encode())
            assert status == 200, raw
    finally:
        for proc in procs:
            stop(proc)
