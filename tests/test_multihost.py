"""Roles on separate hosts: network namespaces joined by a bridge (tests/netns.py), addresses in
198.18.0.0/15, each role started inside its own namespace. The router finds the encoders by DNS
name (one name, two addresses) and the PD worker registers itself; embeddings cross hosts by the
tcp connector, and by Mooncake's transfer engine where it is installed. Answers are the aggregated server's; nothing internal answers without the cluster
credential; every namespace and process is gone afterwards."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from epdserve.launcher import wait_healthy
from epdserve.security.credentials import CLUSTER_SECRET_ENV
from tests.netns import Hosts, namespaces_unavailable
from tests.server_utils import http
from tests.test_topologies import MOONCAKE, PD_ARGS, aggregated, assert_same_answers  # noqa: F401 - a fixture

WHY_NOT = namespaces_unavailable()
pytestmark = pytest.mark.skipif(WHY_NOT is not None, reason=f"no network namespaces here: {WHY_NOT}")

ADMIN_KEY = "admin-key-for-multi-host-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ROUTER_PORT, ENCODER_PORT, EC_PORT, PD_PORT = 8000, 8001, 9001, 8002
ENCODER_ARGS = ["encoder", "--host", "0.0.0.0", "--port", str(ENCODER_PORT)]
CONNECTOR_ARGS = {
    "tcp": ["--ec-connector", "tcp", "--ec-tcp-port", str(EC_PORT)],
    "mooncake": ["--ec-connector", "mooncake", "--ec-mooncake-protocol", "tcp"],
}
PD_WORKER_ARGS = ["serve", "--port", str(PD_PORT), "--no-vision-tower", "--internal-only", *PD_ARGS]
ROUTER_ARGS = ["router", "--port", str(ROUTER_PORT), "--encoders", f"dns+http://encoders:{ENCODER_PORT}"]
ROUTER_ARGS += ["--dns-interval-s", "1", "--probe-interval", "0.5"]


def counter(url: str, name: str) -> float:
    text = http("GET", url + "/metrics")[1].decode()
    return sum(float(v) for v in re.findall(rf"^epd_{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


@pytest.mark.parametrize("connector", ["tcp", MOONCAKE])
def test_roles_on_separate_hosts_answer_as_aggregated(aggregated, connector: str, tmp_path: Path) -> None:  # noqa: F811
    _, expected, _ = aggregated
    hosts = ["router", "encoder0", "encoder1", "pd0"]
    env = {CLUSTER_SECRET_ENV: os.environ[CLUSTER_SECRET_ENV], "EPD_ADMIN_KEY": ADMIN_KEY}
    with Hosts(hosts, hosts={"encoders": ["encoder0", "encoder1"]}) as net:
        router_url = f"http://{net.addr('router')}:{ROUTER_PORT}"
        procs = {}
        for e in ("encoder0", "encoder1"):
            procs[e] = net.start(
                e,
                [*ENCODER_ARGS, *CONNECTOR_ARGS[connector], "--advertise-host", net.addr(e)],
                env,
                tmp_path / f"{e}.log",
            )
        procs["pd0"] = net.start(
            "pd0",
            [*PD_WORKER_ARGS, "--host", net.addr("pd0"), "--register-with", router_url, "--heartbeat-s", "1"],
            env,
            tmp_path / "pd0.log",
        )
        procs["router"] = net.start(
            "router",
            [*ROUTER_ARGS, "--host", net.addr("router")],
            env,
            tmp_path / "router.log",
        )
        try:
            for host, port in (("encoder0", ENCODER_PORT), ("encoder1", ENCODER_PORT), ("pd0", PD_PORT)):
                wait_healthy(f"http://{net.addr(host)}:{port}", procs[host])
            deadline = time.monotonic() + 60
            while True:
                status, raw = http("GET", router_url + "/v1/workers", headers=ADMIN, timeout=5)
                if status == 200:
                    found = json.loads(raw)
                    # listed and probed healthy: a found worker is probed before it takes requests
                    if (
                        len(found["encoders"]) == 2
                        and all(w["healthy"] for w in found["encoders"] + found["pds"])
                        and [w["url"] for w in found["pds"]] == [f"http://{net.addr('pd0')}:{PD_PORT}"]
                    ):
                        break
                assert time.monotonic() < deadline, f"the router did not find its workers: {status} {raw[:500]!r}"
                time.sleep(0.2)
            assert {w["url"] for w in found["encoders"]} == {
                f"http://{net.addr(e)}:{ENCODER_PORT}" for e in ("encoder0", "encoder1")
            }
            wait_healthy(router_url, procs["router"])
            assert_same_answers(router_url, expected)
            # the embeddings crossed hosts
            encoders = [f"http://{net.addr(e)}:{ENCODER_PORT}" for e in ("encoder0", "encoder1")]
            assert sum(counter(u, "encoder_items_total") for u in encoders) > 0
            assert counter(f"http://{net.addr('pd0')}:{PD_PORT}", "ec_bytes_received_total") > 0
            # an attacker on the network without the cluster credential reaches nothing internal
            probe = json.dumps({"version": 3, "model": "shapes-qwen2vl", "items": []}).encode()
            assert http("POST", encoders[0] + "/v1/encode", probe)[0] == 401
            chat = json.dumps({"model": "shapes-qwen2vl", "messages": [{"role": "user", "content": "hi"}]}).encode()
            assert http("POST", f"http://{net.addr('pd0')}:{PD_PORT}/v1/chat/completions", chat)[0] == 401
            assert http("POST", router_url + "/v1/workers", b"{}")[0] == 401
        finally:
            for log in tmp_path.glob("*.log"):
                tail = log.read_text(errors="replace")[-3000:]
                print(f"--- {log.name}\n{tail}")
            pids = [p.pid for p in procs.values()]
    assert net.leftovers() == []
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
