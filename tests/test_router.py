"""Router behaviour with real processes: registration, PD retry before the first byte, pools."""

from __future__ import annotations

import json
import time

import openai
import pytest

from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.router.pool import NoWorker, WorkerPool
from tests.server_utils import http, running

MODEL = "shapes-qwen2vl"
ADMIN_KEY = "test-admin-key-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_pool_policies() -> None:
    rr = WorkerPool("pd", ["http://a", "http://b", "http://c"], "round_robin")
    assert [rr.pick().url for _ in range(4)] == ["http://a", "http://b", "http://c", "http://a"]
    lo = WorkerPool("pd", ["http://a", "http://b"], "least_outstanding")
    lo.workers["http://a"].outstanding = 3
    assert {lo.pick().url for _ in range(4)} == {"http://b"}
    lo.mark_failed(lo.workers["http://b"])
    assert lo.pick().url == "http://a"
    lo.mark_failed(lo.workers["http://a"])
    with pytest.raises(NoWorker):
        lo.pick()
    with pytest.raises(ValueError):
        WorkerPool("pd", [], "random")


def test_affinity_keeps_media_on_one_encoder_and_spills_when_busy() -> None:
    pool = WorkerPool("encoder", [f"http://e{i}" for i in range(4)], "affinity")
    keys = [f"data:image/png;base64,{i}" for i in range(40)]
    first = {k: pool.pick(key=k).url for k in keys}
    assert all(pool.pick(key=k).url == first[k] for k in keys)  # stable
    assert len(set(first.values())) > 1  # spread over workers
    # a worker leaving only moves its own keys
    gone = first[keys[0]]
    pool.remove(gone)
    assert all(pool.pick(key=k).url == u for k, u in first.items() if u != gone)
    # a preferred worker far busier than the least loaded one is skipped
    k = keys[1]
    preferred = pool.workers[pool.pick(key=k).url]
    preferred.outstanding = 10
    assert pool.pick(key=k).url != preferred.url


def test_registration_and_retry_on_a_dead_pd() -> None:
    lm = ["serve", "--max-model-len", "512", "--num-kv-blocks", "64"]
    doomed_port = free_port()
    dead = f"http://127.0.0.1:{doomed_port}"  # a worker that joins, then dies
    doomed = start_role([*lm, "--port", str(doomed_port)])
    with running(lm) as pd:
        port = free_port()
        router = start_role(
            ["router", "--port", str(port), "--policy", "round_robin", "--probe-interval", "30"],
            env={"EPD_ADMIN_KEY": ADMIN_KEY},
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.time() + 60
            while time.time() < deadline:
                try:
                    if http("GET", url + "/v1/workers", headers=ADMIN)[0] == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            assert http("GET", url + "/health")[0] == 503  # no PD worker yet
            # registration is an admin act: without the key, or with a wrong one, nothing changes
            rogue = json.dumps({"role": "pd", "url": "http://127.0.0.1:9"}).encode()
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {ADMIN_KEY}"}):
                for method in ("POST", "DELETE", "GET"):
                    status, body = http(method, url + "/v1/workers", rogue, headers=headers)
                    assert status == 401 and json.loads(body)["error"]["code"] == "invalid_api_key", body
            assert json.loads(http("GET", url + "/v1/workers", headers=ADMIN)[1])["pds"] == []
            # nothing that cannot prove the cluster credential joins (here: nothing listens)
            status, body = http("POST", url + "/v1/workers", rogue, headers=ADMIN)
            assert status == 403 and b"credential challenge" in body, body
            wait_healthy(dead, doomed)
            for u in (dead, pd):
                status, _ = http(
                    "POST", url + "/v1/workers", json.dumps({"role": "pd", "url": u}).encode(), headers=ADMIN
                )
                assert status == 200
            stop(doomed)
            wait_healthy(url, router)
            c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            # round robin sends some requests to the dead worker first: each is retried on the live one
            for _ in range(4):
                r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                assert r.choices[0].finish_reason in ("stop", "length")
            workers = json.loads(http("GET", url + "/v1/workers", headers=ADMIN)[1])["pds"]
            assert {w["url"]: w["healthy"] for w in workers} == {dead: False, pd: True}
            status, body = http(
                "POST", url + "/v1/workers", json.dumps({"role": "db", "url": pd}).encode(), headers=ADMIN
            )
            assert status == 400 and json.loads(body)["error"]["param"] == "role"
            for u in (pd, dead):
                http("DELETE", url + "/v1/workers", json.dumps({"role": "pd", "url": u}).encode(), headers=ADMIN)
            status, body = http(
                "POST",
                url + "/v1/chat/completions",
                json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode(),
            )
            assert status == 503 and json.loads(body)["error"]["message"]
        finally:
            stop(router)
            stop(doomed)


def test_health_probe_evicts_and_readmits_a_worker() -> None:
    pd_port, port = free_port(), free_port()
    pd_url = f"http://127.0.0.1:{pd_port}"
    args = ["serve", "--port", str(pd_port), "--max-model-len", "256", "--num-kv-blocks", "32"]
    pd = start_role(args)
    router = start_role(
        ["router", "--port", str(port), "--pds", pd_url, "--probe-interval", "0.3"], env={"EPD_ADMIN_KEY": ADMIN_KEY}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(pd_url, pd)
        wait_healthy(url, router)

        def healthy() -> bool:
            return bool(json.loads(http("GET", url + "/v1/workers", headers=ADMIN)[1])["pds"][0]["healthy"])

        def wait_for(state: bool) -> None:
            deadline = time.time() + 30
            while healthy() != state and time.time() < deadline:
                time.sleep(0.1)
            assert healthy() == state

        stop(pd)
        wait_for(False)
        assert http("GET", url + "/health")[0] == 503
        pd = start_role(args)
        wait_healthy(pd_url, pd)
        wait_for(True)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.choices[0].finish_reason in ("stop", "length")
    finally:
        stop(router)
        stop(pd)


def test_registration_is_off_without_an_admin_key() -> None:
    port = free_port()
    router = start_role(["router", "--port", str(port), "--probe-interval", "30"], env={"EPD_ADMIN_KEY": ""})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if http("GET", url + "/metrics")[0] == 200:
                    break
            except OSError:
                time.sleep(0.2)
        body = json.dumps({"role": "pd", "url": "http://127.0.0.1:9"}).encode()
        status, raw = http("POST", url + "/v1/workers", body, headers={"Authorization": "Bearer "})
        assert status == 403 and "admin-key" in json.loads(raw)["error"]["message"]
    finally:
        stop(router)
