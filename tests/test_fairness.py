"""Fairness at the public endpoint: an over-long prompt is refused for the cost of the context
length (not of its text) and cannot delay a short request; per-key limits answer 429 with
Retry-After; every 429 and 503 says when to retry; /metrics and stage timing show other users'
traffic only to the operator."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from epdserve.api.errors import Overloaded, Unavailable
from epdserve.api.quota import QuotaConfig, Quotas
from epdserve.api.tokenizer import CHUNK_CHARS, FastTokenizer, TooManyTokens
from epdserve.assets import default_model_dir
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.up import open_api_warning
from tests.server_utils import counter, device_args, http, internal_headers, running

MODEL = "shapes-qwen2vl"
CONTEXT = 1024
API_KEY = "test-key-fairness"


def words(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    vocab = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog,", "again.\n", "42", "  "]
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(vocab)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)[:chars]


@pytest.fixture(scope="module")
def tok() -> FastTokenizer:
    return FastTokenizer(default_model_dir())


def test_a_text_that_fits_encodes_exactly_as_whole(tok: FastTokenizer) -> None:
    for text in (words(100), words(5 * CHUNK_CHARS, seed=1), "x" * (3 * CHUNK_CHARS)):
        ids = tok.encode(text)
        assert tok.encode_within(text, len(ids)) == ids


def test_a_long_text_is_refused_without_counting_it_all(tok: FastTokenizer) -> None:
    text = words(1 << 20)
    with pytest.raises(TooManyTokens) as e:  # the byte-length bound alone
        tok.encode_within(text, CONTEXT)
    assert e.value.at_least > CONTEXT and e.value.limit == CONTEXT
    # past the bound, the chunked count stops within one chunk of the limit
    text = words(CONTEXT * tok.bytes_per_token - 1, seed=2)
    with pytest.raises(TooManyTokens) as e:
        tok.encode_within(text, CONTEXT)
    assert CONTEXT < e.value.at_least <= len(tok.encode(text))
    # one token over is refused, exactly at the limit is not
    ids = tok.encode(words(2 * CHUNK_CHARS, seed=3))
    text = tok.decode(ids)
    n = len(tok.encode(text))
    with pytest.raises(TooManyTokens):
        tok.encode_within(text, n - 1)
    assert len(tok.encode_within(text, n)) == n


def test_every_429_and_503_says_when_to_retry() -> None:
    assert Unavailable("restarting").headers == {"Retry-After": "1"}
    assert Overloaded("busy").headers == {"Retry-After": "1"}
    assert Overloaded("busy", retry_after_s=7).headers == {"Retry-After": "7"}


def test_a_key_over_its_share_is_told_when_to_come_back() -> None:
    now = [0.0]
    q = Quotas(QuotaConfig(max_inflight_per_key=2, max_tokens_per_minute_per_key=600), clock=lambda: now[0])
    a, b = q.admit("alice"), q.admit("alice")
    with pytest.raises(Overloaded) as e:
        q.admit("alice")
    assert e.value.code == "rate_limit_exceeded" and e.value.retry_after_s == 1
    q.admit("bob").done()  # others are not held back
    a.reserve(500)
    with pytest.raises(Overloaded) as e:
        b.reserve(300)  # 100 left; 200 more come in 20 s
    assert e.value.retry_after_s == 20 and e.value.status == 429
    a.done(used=100)  # 400 unused come back
    b.reserve(300)
    b.failed()  # nothing used: all of it comes back
    now[0] += 60.0
    c = q.admit("alice")
    c.reserve(10_000)  # larger than the bucket: takes all of it, once full
    d = q.admit("alice")
    with pytest.raises(Overloaded):
        d.reserve(1)
    d.failed()
    c.done()
    assert q.in_flight == {}


# ---------------------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    args = ["serve", *device_args(), "--max-model-len", str(CONTEXT), "--num-kv-blocks", "256"]
    args += ["--max-tokens-limit", "64", "--max-inflight-per-key", "2", "--max-tokens-per-minute-per-key", "3000"]
    with running(args) as url:
        yield url


def post(url: str, body: dict, key: str = "", timeout: float = 120) -> tuple[int, dict, dict[str, str], float]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers=headers)
    t0 = time.perf_counter()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read()), dict(r.headers), time.perf_counter() - t0
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), dict(e.headers), time.perf_counter() - t0


def chat(text: str, max_tokens: int = 4, **extra: object) -> dict:
    return {"model": MODEL, "max_tokens": max_tokens, "messages": [{"role": "user", "content": text}], **extra}


def test_million_character_prompts_are_refused_at_once_and_do_not_delay_others(server: str) -> None:
    long_prompts = [words(1 << 20, seed=i) for i in range(8)]
    probed = words(60_000, seed=9)  # under the length bound: counted chunk by chunk
    assert post(server, chat("warm up"), key="warm")[0] == 200
    with ThreadPoolExecutor(10) as pool:
        t0 = time.perf_counter()
        longs = [pool.submit(post, server, chat(p), f"long{i}") for i, p in enumerate([*long_prompts, probed])]
        time.sleep(0.05)
        short = pool.submit(post, server, chat("Hi"), "short")
        answers = [f.result() for f in longs]
        status, _, _, short_s = short.result()
        burst_s = time.perf_counter() - t0
    assert status == 200
    for code, body, _, _ in answers:
        assert code == 400 and body["error"]["code"] == "context_length_exceeded", body
        assert body["error"]["param"] == "messages" and "or more" in body["error"]["message"]
    # counting each to its end took seconds per prompt, all of it holding the GIL: generous bounds
    assert burst_s < 15 and short_s < 10, (burst_s, short_s)


def test_the_server_caps_max_tokens(server: str) -> None:
    status, body, _, _ = post(server, chat("Hi", max_tokens=65), key="cap")
    assert status == 400 and body["error"]["param"] == "max_tokens" and "at most 64" in body["error"]["message"]
    assert post(server, chat("Hi", max_tokens=64), key="cap")[0] == 200
    completion = {"model": MODEL, "prompt": "Hi", "max_tokens": 65}
    status, raw = http("POST", server + "/v1/completions", json.dumps(completion).encode())
    assert status == 400 and json.loads(raw)["error"]["param"] == "max_tokens"


def test_a_million_character_completion_prompt_is_refused_at_once(server: str) -> None:
    body = {"model": MODEL, "prompt": words(1 << 20), "max_tokens": 4}
    t0 = time.perf_counter()
    status, raw = http("POST", server + "/v1/completions", json.dumps(body).encode())
    error = json.loads(raw)["error"]
    assert status == 400 and error["code"] == "context_length_exceeded" and error["param"] == "prompt", error
    assert time.perf_counter() - t0 < 10  # generous: counting it through takes seconds


def test_per_key_limits_answer_429_with_retry_after(server: str) -> None:
    slow = chat("Count.", max_tokens=64, min_tokens=64, ignore_eos=True)
    with ThreadPoolExecutor(6) as pool:
        # six at once against two in flight a key: three could finish one after another before
        # the third arrived (a 64-token answer of the embedded model is a fraction of a second)
        results = list(pool.map(lambda _: post(server, slow, "alice"), range(6)))
        other = post(server, chat("Hi"), key="bob")
    codes = [r[0] for r in results]
    assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) == {200, 429}, codes
    refused = next(r for r in results if r[0] == 429)
    assert refused[1]["error"]["code"] == "rate_limit_exceeded" and int(refused[2]["Retry-After"]) >= 1
    assert other[0] == 200


def test_a_key_over_its_tokens_per_minute_gets_429(server: str, tok: FastTokenizer) -> None:
    text = "fox " * 300
    assert len(tok.encode(text)) < CONTEXT - 64
    # each request uses its long prompt: a few use up the minute's 3000 tokens
    statuses = [post(server, chat(text, max_tokens=8), key="carol") for _ in range(6)]
    assert [s[0] for s in statuses[:3]] == [200] * 3, [s[0] for s in statuses]
    limited = [s for s in statuses if s[0] == 429]
    assert limited, [s[0] for s in statuses]
    assert "tokens per minute" in limited[0][1]["error"]["message"] and int(limited[0][2]["Retry-After"]) >= 1
    assert post(server, chat("Hi"), key="dave")[0] == 200  # another key is not held back
    assert counter(server, "quota_rejected_total") >= len(limited)
    completion = json.dumps({"model": MODEL, "prompt": text, "max_tokens": 8}).encode()
    headers = {"Authorization": "Bearer carol"}
    assert http("POST", server + "/v1/completions", completion, headers=headers)[0] == 429  # the same share


def test_public_metrics_show_health_only_once_an_api_key_is_set() -> None:
    args = ["serve", *device_args(), "--max-model-len", str(CONTEXT), "--num-kv-blocks", "64", "--api-key", API_KEY]
    with running(args) as url:
        status, raw = http("GET", url + "/metrics")
        text = raw.decode()
        assert status == 200 and "epd_kv_cache_usage_perc" in text and "epd_requests_total" not in text
        status, raw = http("GET", url + "/metrics", headers=internal_headers())
        assert status == 200 and "epd_requests_total" in raw.decode()


def test_a_router_without_healthy_workers_answers_503_with_retry_after() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    port = free_port()
    proc = start_role(["router", "--pds", dead, "--public-metrics", "none", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while not _up(url):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        status, body, headers, _ = post(url, chat("Hi"))
        assert status == 503 and headers.get("Retry-After") == "1", (status, body)
        req = urllib.request.Request(url + "/v1/models")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=30)
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1"
        assert http("GET", url + "/metrics")[0] == 401
        assert http("GET", url + "/metrics", headers=internal_headers())[0] == 200
    finally:
        stop(proc)


def _up(url: str) -> bool:
    try:
        http("GET", url + "/version", timeout=2)
        return True
    except OSError:
        return False


def test_the_router_holds_each_key_to_its_share(server: str) -> None:
    # a router in front of the module's server: the server counts no call of the router's (they
    # carry the cluster credential), so every 429 here is the router's
    port = free_port()
    router = start_role(["router", "--pds", server, "--max-inflight-per-key", "1", "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, router)
        slow = chat("Count.", max_tokens=64, min_tokens=64, ignore_eos=True)
        with ThreadPoolExecutor(5) as pool:
            # four at once against one in flight a key (two could finish one after the other)
            mine = [pool.submit(post, url, slow, "alice") for _ in range(4)]
            time.sleep(0.2)
            theirs = pool.submit(post, url, chat("Hi"), "bob")
            results = [f.result() for f in mine]
            assert theirs.result()[0] == 200
        codes = [r[0] for r in results]
        assert codes.count(200) >= 1 and set(codes) == {200, 429}, [r[:2] for r in results]
        refused = next(r for r in results if r[0] == 429)
        assert refused[2]["Retry-After"] == "1" and refused[1]["error"]["type"] == "rate_limit_error"
    finally:
        stop(router)


def test_up_on_a_public_interface_without_an_api_key_warns_how_to_fix_it() -> None:
    assert open_api_warning("127.0.0.1", "") is None and open_api_warning("::1", "") is None
    assert open_api_warning("localhost", "") is None and open_api_warning("0.0.0.0", "k") is None
    for host in ("0.0.0.0", "::", "10.1.2.3", "myhost"):
        warning = open_api_warning(host, "")
        assert warning is not None and "EPD_API_KEY" in warning and "127.0.0.1" in warning
    # the real command: it warns before anything starts (here the port is taken, so nothing does)
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [
            sys.executable,
            "-c",
            "from epdserve.cli import main; raise SystemExit(main())",
            "up",
            "--host",
            "0.0.0.0",
        ]
        done = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=120)
        lines = [line for line in done.stderr.splitlines() if "WARNING" in line]
        assert len(lines) == 1 and "no API key" in lines[0] and "--host 127.0.0.1" in lines[0], done.stderr
        env = {**os.environ, "EPD_API_KEY": API_KEY}
        done = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=120, env=env)
        assert "WARNING" not in done.stderr and done.returncode != 0, done.stderr
