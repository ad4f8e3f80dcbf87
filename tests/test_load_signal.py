"""The autoscaling signal: each role's demand over capacity, and the router's recommended replica
count per role, rising under a load one worker cannot hold and back to one when idle."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from epdserve.api.load import EncoderLoad, RateWindow, recommended_replicas, worker_ratio
from epdserve.up import Deployment, Topology
from tests.server_utils import http, internal_headers
from tests.test_topologies import request_set


def test_rates_ratios_and_replicas() -> None:
    w = RateWindow(window_s=10)
    w.add(30, now=0.0)
    w.add(20, now=5.0)
    assert w.total(now=9.0) == 50 and w.total(now=12.0) == 20 and w.rate(now=12.0) == 2.0
    load = EncoderLoad(window_s=10)
    assert load.ratio(now=0.0) == 0.0  # nothing offered
    load.offer_at(100, now=0.0)
    assert load.ratio(now=1.0) == 1.0  # offered, capacity not measured yet: call it busy
    load.served(100, 0.5)  # 200 patches per second of forward
    assert load.ratio(now=1.0) == (100 / 10) / 200
    assert worker_ratio(0.2, running=2, waiting=0, max_num_seqs=4) == 0.5
    assert worker_ratio(0.95, running=1, waiting=0, max_num_seqs=4) == 0.95
    assert worker_ratio(0.1, running=4, waiting=4, max_num_seqs=4) == 2.0
    assert recommended_replicas([]) == 1 and recommended_replicas([0.1, 0.2]) == 1
    assert recommended_replicas([2.0]) == 3 and recommended_replicas([0.8, 0.8]) == 2


def _gauge(url: str, name: str, role: str) -> float:
    text = http("GET", url + "/metrics", headers=internal_headers())[1].decode()
    m = re.search(rf'^epd_{name}{{role="{role}"}} (\S+)$', text, re.MULTILINE)
    assert m is not None, f"epd_{name}{{role={role}}} not exported"
    return float(m[1])


def test_the_router_recommends_more_workers_under_load_and_one_when_idle() -> None:
    d = Deployment(
        Topology.parse("1e+1pd"),
        None,
        port=0,
        extra_pd_args=["--max-model-len", "1024", "--max-num-seqs", "2"],
        extra_router_args=["--probe-interval", "0.3"],
    )
    d.start()
    try:
        assert _gauge(d.url, "router_recommended_replicas", "pd") == 1
        body = {"model": "shapes-qwen2vl", "max_tokens": 96, "min_tokens": 96, "ignore_eos": True, **request_set()[1]}

        def ask(_: int) -> int:
            r = urllib.request.Request(
                d.url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(r, timeout=120) as resp:
                resp.read()
                return resp.status

        seen_pd, seen_enc = 1.0, 0.0
        with ThreadPoolExecutor(8) as pool:
            answers = pool.map(ask, range(8))  # one wave: the queue is what is measured
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and seen_pd < 3:
                seen_pd = max(seen_pd, _gauge(d.url, "router_recommended_replicas", "pd"))
                seen_enc = max(seen_enc, _gauge(d.url, "router_load_ratio", "encoder"))
                time.sleep(0.2)
            assert list(answers) == [200] * 8
        # 8 requests at once on a worker that runs 2: four times its batch
        assert seen_pd >= 3, seen_pd
        assert seen_enc > 0
        deadline = time.monotonic() + 20
        while _gauge(d.url, "router_recommended_replicas", "pd") > 1:
            assert time.monotonic() < deadline, "the recommendation did not come back to one worker"
            time.sleep(0.3)
    finally:
        d.stop()
