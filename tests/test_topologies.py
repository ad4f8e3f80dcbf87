"""Every topology gives exactly the aggregated server's greedy output (issue 4), with each connector."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from epdserve.bench.workload import gif_data_url
from epdserve.bench.workload import image_data_url as data_url
from epdserve.shapes import ShapesWorld, render_images
from epdserve.transfer.shm_slab import SLAB_RE
from epdserve.up import Deployment, Topology
from tests.optional import unavailable
from tests.server_utils import http, internal_headers, openai_client

MODEL = "shapes-qwen2vl"
PD_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "256"]


def deploy(topology: str, connector: str = "shm", kv_connector: str = "shm", dispatch: str = "always") -> Deployment:
    d = Deployment(
        Topology.parse(topology),
        None,
        port=0,
        ec_connector=connector,  # type: ignore[arg-type]
        kv_connector=kv_connector,  # type: ignore[arg-type]
        extra_pd_args=PD_ARGS,
        dispatch=dispatch,  # type: ignore[arg-type]
    )
    d.start()
    return d


def request_set() -> list[dict]:
    """text-only, 1 image, 4 images of different sizes, a video, a repeated image; stream and not."""
    w = ShapesWorld(2024)
    one = w.sample("describe")
    four = [w.scene() for _ in range(12)]
    sizes: dict[tuple[int, int], object] = {}
    for sc in four:
        sizes.setdefault((sc.width, sc.height), sc)
    four_imgs = [sc.render() for sc in list(sizes.values())[:4]]  # type: ignore[attr-defined]
    vid = w.sample("direction")

    def img_parts(images: list) -> list[dict]:
        return [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]

    def msg(parts: list[dict], q: str) -> list[dict]:
        return [{"role": "user", "content": [*parts, {"type": "text", "text": q}]}]

    reqs = [
        {"messages": [{"role": "user", "content": "Describe the image."}], "max_tokens": 8},
        {"messages": msg(img_parts(render_images(one)), one.question)},
        {"messages": msg(img_parts(four_imgs), "Describe the third image.")},
        {"messages": msg([{"type": "video_url", "video_url": {"url": gif_data_url(vid.frames)}}], vid.question)},
        {"messages": msg(img_parts(render_images(one) * 2), "Describe the second image.")},
        {"messages": msg(img_parts(render_images(one)), "How many shapes are there?"), "stream": True},
    ]
    return reqs


def ask(url: str, req: dict) -> str:
    c = openai_client(url)
    if req.get("stream"):
        stream = c.chat.completions.create(model=MODEL, temperature=0, **req)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    r = c.chat.completions.create(model=MODEL, temperature=0, **req)
    return r.choices[0].message.content or ""


def shapes_questions() -> list[dict]:
    """One shapes-world question of each kind (a video for ``direction``)."""
    w = ShapesWorld(77)
    out = []
    for kind in ("describe", "shape", "where_is", "what_at", "describe_nth", "which_image", "direction"):
        s = w.sample(kind)
        if s.video is not None:
            parts = [{"type": "video_url", "video_url": {"url": gif_data_url(s.frames)}}]
        else:
            parts = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in render_images(s)]
        out.append(
            {
                "messages": [{"role": "user", "content": [*parts, {"type": "text", "text": s.question}]}],
                "answer": s.answer,
            }
        )
    return out


@pytest.fixture(scope="module")
def aggregated() -> Iterator[tuple[Deployment, list[str], Callable[[], list[str]]]]:
    """The aggregated server, its answers to ``request_set``, and (asked once, on first call: not
    every test needs them) its answers to ``shapes_questions``."""
    d = deploy("aggregated")
    try:
        reqs = request_set()
        expected = [ask(d.url, r) for r in reqs]
        answers = functools.cache(lambda: [ask(d.url, {"messages": q["messages"]}) for q in shapes_questions()])
        yield d, expected, answers
    finally:
        d.stop()


HAVE_MOONCAKE = unavailable("mooncake.store") is None  # installed, and its native libraries load
MOONCAKE = pytest.param(
    "mooncake", marks=pytest.mark.skipif(not HAVE_MOONCAKE, reason="pip install 'epdserve[mooncake]'")
)


@pytest.mark.parametrize("connector", ["shm", "tcp", "fs", MOONCAKE])
def test_1e1pd_equals_aggregated(aggregated, connector: str) -> None:
    _, expected, answers = aggregated
    d = deploy("1e+1pd", connector)
    try:
        reqs = assert_same_answers(d.url, expected)
        # shapes-world answers (hence accuracy) identical to the aggregated server's
        questions = shapes_questions()
        assert [ask(d.url, {"messages": q["messages"]}) for q in questions] == answers()
        # the PD worker holds no vision weights: every image went through the encoder
        pd = next(r for r in d.roles if r.name == "pd0")
        assert "epd_vision_tower_loaded 0.0" in http("GET", pd.url + "/metrics")[1].decode()
        # the encoder did the vision work; an image it has seen is a cache hit, not another forward
        enc = next(r for r in d.roles if r.name == "encoder0")
        hits, computed = items_encoded(enc.url, "cache_hit"), items_encoded(enc.url, "computed")
        assert hits >= 1 and computed >= 1, "the request set repeats an image"
        assert ask(d.url, reqs[1]) == expected[1]  # one image, encoded before
        assert items_encoded(enc.url, "cache_hit") == hits + 1
        assert items_encoded(enc.url, "computed") == computed
    finally:
        pids = [r.proc.pid for r in d.roles]
        d.stop()
    assert_clean(pids)


@pytest.mark.parametrize("topology", ["1e+1pd", "1e+1p+1d"])
def test_adaptive_dispatch_equals_aggregated(aggregated, topology: str) -> None:
    """Adaptive dispatch sends media to the encoder or raw to the worker's own vision tower, per
    request: the answers are the aggregated server's either way, and with the encoder killed every
    image still gets served (raw, by the workers)."""
    _, expected, _ = aggregated
    d = deploy(topology, dispatch="adaptive")
    try:
        for name in ("pd0",) if topology == "1e+1pd" else ("prefill0", "decode0"):
            lm = next(r for r in d.roles if r.name == name)
            assert "epd_vision_tower_loaded 1.0" in http("GET", lm.url + "/metrics")[1].decode()
        assert_same_answers(d.url, expected)
        reqs = request_set()
        # assert_same_answers sends the set, then its first 16 of three rounds
        media_requests = sum(1 for r in [*reqs, *(reqs * 3)[:16]] if media_urls([r]))
        assert dispatched(d.url, "remote") + dispatched(d.url, "local") == media_requests
        # what the cost model weighs went back to zero with every request answered
        assert metric(d.url, 'router_lm_requests{state="awaiting_first_token"}') == 0
        assert metric(d.url, 'router_lm_requests{state="past_first_token"}') == 0
        enc = next(r for r in d.roles if r.name == "encoder0")
        enc.proc.kill()
        enc.proc.wait()
        assert [ask(d.url, r) for r in reqs] == expected
        assert dispatched(d.url, "local") + metric(d.url, "router_dispatch_fallbacks_total") >= 1
    finally:
        d.stop()


def dispatched(url: str, path: str) -> float:
    metrics = http("GET", url + "/metrics")[1].decode()
    m = re.search(rf'^epd_router_dispatch_total{{path="{path}"}} (\S+)$', metrics, re.MULTILINE)
    assert m is not None, metrics
    return float(m[1])


def assert_same_answers(url: str, expected: list[str]) -> list[dict]:
    """The request set gives the expected answers, one by one and 16 at a time; returns the set."""
    reqs = request_set()
    assert [ask(url, r) for r in reqs] == expected
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda r: ask(url, r), (reqs * 3)[:16]))
    assert got == (expected * 3)[:16]
    return reqs


def media_urls(reqs: list[dict]) -> set[str]:
    """The distinct media URLs of a request set."""
    return {
        p[p["type"]]["url"]
        for r in reqs
        for m in r["messages"]
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] in ("image_url", "video_url")
    }


def items_encoded(url: str, status: str) -> float:
    """The encoder's ``epd_encoder_items_total`` counter for one status."""
    metrics = http("GET", url + "/metrics")[1].decode()
    m = re.search(rf'^epd_encoder_items_total{{status="{status}"}} (\S+)$', metrics, re.MULTILINE)
    assert m is not None, metrics
    return float(m[1])


def assert_clean(pids: list[int]) -> None:
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    slabs = [SLAB_RE.fullmatch(f.name) for f in Path("/dev/shm").glob("epd-ec-*")]
    assert [m.string for m in slabs if m is not None and int(m["pid"]) in pids] == []


def test_encoder_killed_items_retry_on_the_other_encoder(aggregated) -> None:
    _, expected, _ = aggregated
    d = deploy("2e+1pd")
    try:
        victim = next(r for r in d.roles if r.name == "encoder0")
        os.kill(victim.proc.pid, signal.SIGKILL)
        victim.proc.wait()
        reqs = request_set()
        assert [ask(d.url, r) for r in reqs] == expected
        # evicted by the failed call if affinity sent items to it (it depends on the ports), else
        # by the next health probe (every 2 s)
        deadline = time.monotonic() + 10
        while True:
            healthy = http("GET", d.url + "/metrics")[1].decode()
            if "epd_router_encoders_healthy 1" in healthy or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "epd_router_encoders_healthy 1" in healthy
    finally:
        pids = [r.proc.pid for r in d.roles]
        d.stop()
    assert_clean(pids)


def embeds_request(uuid: str, handle: dict) -> dict:
    """A metadata-only chat request: one 8x8-patch image given by its EC handle."""
    item = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 8, 8]}, "uuid": uuid, "ec_handle": handle}
    content = [item, {"type": "text", "text": "Describe the image."}]
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def test_metadata_only_with_bad_handle_fails_only_that_request(aggregated) -> None:
    d, _, _ = aggregated
    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    before = ask(d.url, hi)
    bad = embeds_request("x", {"connector": "shm", "path": "/dev/shm/epd-ec-nope-1", "offset": 0})
    url = d.url + "/v1/chat/completions"
    # from a client: refused outright, without a word about internal places
    status, body = http("POST", url, json.dumps(bad).encode())
    assert status == 400, body
    assert "/dev/shm" not in body.decode() and json.loads(body)["error"]["type"] == "invalid_request_error"
    # from a caller with the cluster credential: the handle does not verify, so nothing is read
    status, body = http("POST", url, json.dumps(bad).encode(), headers=internal_headers())
    assert status == 400, body
    assert "/dev/shm" not in body.decode() and "not valid" in json.loads(body)["error"]["message"]
    assert ask(d.url, hi) == before  # and the server goes on serving, unchanged


def test_topology_parsing() -> None:
    assert Topology.parse("aggregated") == Topology(0, 1)
    assert Topology.parse("2e+1pd") == Topology(2, 1)
    for bad in ("", "1e", "0e+1pd", "e+pd", "1e+0pd"):
        with pytest.raises(ValueError):
            Topology.parse(bad)


def test_request_waiting_for_embeddings_does_not_stall_others(aggregated) -> None:
    """A metadata-only request whose producer hangs waits outside the engine: other requests keep
    completing; when the producer goes away the waiting request fails alone with 503."""
    import socket
    import threading

    from epdserve.security.credentials import ClusterCredential
    from epdserve.transfer.header import PROTOCOL_VERSION
    from epdserve.transfer.signing import issue, new_lease

    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen()
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(hang.accept()[0]), daemon=True).start()
    d, _, _ = aggregated  # left serving: the waiting request ends either way
    try:
        handle = {
            "connector": "tcp",
            "version": PROTOCOL_VERSION,
            "key": "k",
            "model_id": MODEL,
            "dtype": "float32",
            "shape": [16, 256],
            "levels": 1,
            "nbytes": 16 * 256 * 4,
            "checksum": "0" * 16,
            "host": "127.0.0.1",
            "port": hang.getsockname()[1],
            "token": "t",
        }
        cred = ClusterCredential.load()
        assert cred is not None
        # a producer of this cluster that hangs: the handle is signed, so the PD worker dials it
        handle = issue({**handle, "key": "u"}, cred.derive("ec-handle"), 120.0, new_lease())
        body = embeds_request("u", handle)
        result: list[tuple[int, bytes]] = []
        url = d.url + "/v1/chat/completions"
        waiting = threading.Thread(
            target=lambda: result.append(http("POST", url, json.dumps(body).encode(), headers=internal_headers()))
        )
        waiting.start()
        deadline = time.time() + 10
        while not accepted and time.time() < deadline:
            time.sleep(0.05)
        assert accepted, "the PD worker never contacted the producer"
        t0 = time.time()
        for _ in range(3):
            assert ask(d.url, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
        assert time.time() - t0 < 10 and waiting.is_alive()  # served while the other one waits
        accepted[0].close()  # the producer goes away
        hang.close()
        waiting.join(timeout=60)
        status, raw = result[0]
        assert status == 503 and "unavailable" in json.loads(raw)["error"]["message"]
    finally:
        hang.close()


# ---- E/P/D ------------------------------------------------------------------------------------


def metric(url: str, name: str) -> float:
    text = http("GET", url + "/metrics")[1].decode()
    m = re.search(rf"^epd_{name} (\S+)$", text, re.MULTILINE)
    assert m is not None, name
    return float(m[1])


def ask_logprobs(url: str, req: dict) -> list[tuple[str, float]]:
    """A streamed answer's tokens with their logprobs (what the client sees, token by token)."""
    c = openai_client(url)
    stream = c.chat.completions.create(
        model=MODEL, temperature=0, stream=True, logprobs=True, top_logprobs=2, max_tokens=8, **req
    )
    out = []
    for ch in stream:
        if ch.choices and ch.choices[0].logprobs and ch.choices[0].logprobs.content:
            out += [(t.token, t.logprob) for t in ch.choices[0].logprobs.content]
    return out


@pytest.mark.parametrize("kv_connector", ["shm", "tcp"])
def test_1e1p1d_equals_aggregated(aggregated, kv_connector: str) -> None:
    agg, expected, _ = aggregated
    d = deploy("1e+1p+1d", kv_connector=kv_connector)
    try:
        reqs = assert_same_answers(d.url, expected)
        # the first token (from P) and the rest (from D) carry the same logprobs as aggregated's
        lp_req = {"messages": reqs[1]["messages"]}
        mine, theirs = ask_logprobs(d.url, lp_req), ask_logprobs(agg.url, lp_req)
        assert [t for t, _ in mine] == [t for t, _ in theirs] and len(mine) == 8
        assert all(abs(a - b) <= 1e-4 * max(1.0, abs(b)) for (_, a), (_, b) in zip(mine, theirs, strict=True))
        p = next(r for r in d.roles if r.name == "prefill0")
        dec = next(r for r in d.roles if r.name == "decode0")
        n = len(reqs) + 16 + 1
        assert metric(p.url, "kv_transfers_out_total") >= n - 2  # (a request may end with its first token)
        assert metric(dec.url, "kv_transfers_in_total") == metric(p.url, "kv_transfers_out_total")
        assert metric(dec.url, "kv_fallbacks_total") == 0
        # neither holds vision weights: every image went through the encoder
        for role in (p, dec):
            assert metric(role.url, "vision_tower_loaded") == 0
        # a client cannot hand the router KV parameters (nor a handle of its own)
        forged = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        forged["kv_transfer_params"] = {"first_token_id": 3, "kv_handle": {"connector": "shm"}}
        status, raw = http("POST", d.url + "/v1/chat/completions", json.dumps(forged).encode())
        assert status == 400 and "internal" in json.loads(raw)["error"]["message"]
        # a repeated prompt is prefilled from the prefill worker's prefix cache (the decode side's
        # registration of loaded blocks is tested in test_pd_transfer)
        assert metric(p.url, "prefix_cache_hits_total") > 0
    finally:
        pids = [r.proc.pid for r in d.roles]
        d.stop()
    assert_clean(pids)


def test_kv_that_cannot_be_loaded_is_recomputed_by_the_decode_worker(aggregated, tmp_path: Path) -> None:
    """The prefill worker keeps its KV slab where the decode worker may not map it: every KV load
    fails validation, the decode worker computes the prefill from the media's embeddings, and the
    client sees the same answers."""
    from epdserve.launcher import free_port, start_role, stop, wait_healthy

    _, expected, _ = aggregated
    private = Path("/dev/shm") / f"epd-test-private-{os.getpid()}"
    private.mkdir(mode=0o700, exist_ok=True)
    ports = {name: free_port() for name in ("encoder", "prefill", "decode", "router")}
    common = ["--host", "127.0.0.1"]
    lm = ["serve", *PD_ARGS, "--no-vision-tower", "--internal-only"]
    specs = {
        "encoder": ["encoder", "--ec-connector", "shm"],
        "prefill": [*lm, "--role", "prefill", "--kv-shm-dir", str(private)],
        "decode": [*lm, "--role", "decode"],
    }
    procs = {}
    try:
        for name, args in specs.items():
            procs[name] = start_role([*args, *common, "--port", str(ports[name])])
        urls = {name: f"http://127.0.0.1:{ports[name]}" for name in ports}
        for name in specs:
            wait_healthy(urls[name], procs[name])
        procs["router"] = start_role(
            [
                "router",
                *common,
                "--port",
                str(ports["router"]),
                "--encoders",
                urls["encoder"],
                "--prefills",
                urls["prefill"],
                "--decodes",
                urls["decode"],
            ]
        )
        wait_healthy(urls["router"], procs["router"])
        reqs = request_set()
        assert [ask(urls["router"], r) for r in reqs] == expected
        assert metric(urls["decode"], "kv_transfers_in_total") == 0
        assert metric(urls["decode"], "kv_fallbacks_total") >= len(reqs) - 1
        # every KV lease and every embedding lease was given back (read or not)
        deadline = time.monotonic() + 5
        while metric(urls["encoder"], "encoder_ec_live_handles") and time.monotonic() < deadline:
            time.sleep(0.1)
        assert metric(urls["encoder"], "encoder_ec_live_handles") == 0
    finally:
        for proc in procs.values():
            stop(proc)
        for f in private.iterdir():
            f.unlink()
        private.rmdir()


def test_client_may_not_send_kv_transfer_params(aggregated) -> None:
    d, _, _ = aggregated
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "kv_transfer_params": {"first_token_id": 3},
    }
    status, raw = http("POST", d.url + "/v1/chat/completions", json.dumps(body).encode())
    assert status == 400 and "internal" in json.loads(raw)["error"]["message"]


def test_pd_topology_parsing() -> None:
    assert Topology.parse("1e+1p+1d") == Topology(1, 0, 1, 1)
    assert Topology.parse("2e+1p+3d") == Topology(2, 0, 1, 3)
    assert Topology.parse("1p+1d") == Topology(0, 0, 1, 1)
    assert not Topology.parse("1p+1d").aggregated and Topology.parse("1p+1d").split
    for bad in ("1e+0p+1d", "0e+1p+1d", "1p+0d", "1e+1p"):
        with pytest.raises(ValueError):
            Topology.parse(bad)


def test_killed_prefill_and_decode_workers_lose_no_request(aggregated) -> None:
    """With one prefill and one decode worker killed, every request is answered (the same answer)
    by the others, and every lease (KV and embeddings) is given back."""
    _, expected, _ = aggregated
    d = deploy("1e+2p+2d")
    try:
        for name in ("prefill0", "decode0"):
            victim = next(r for r in d.roles if r.name == name)
            os.kill(victim.proc.pid, signal.SIGKILL)
            victim.proc.wait()
        reqs = request_set()
        assert [ask(d.url, r) for r in reqs] == expected
        p = next(r for r in d.roles if r.name == "prefill1")
        enc = next(r for r in d.roles if r.name == "encoder0")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if metric(p.url, "kv_live_handles") == 0 and metric(enc.url, "encoder_ec_live_handles") == 0:
                break
            time.sleep(0.2)
        assert metric(p.url, "kv_live_handles") == 0
        assert metric(enc.url, "encoder_ec_live_handles") == 0
    finally:
        pids = [r.proc.pid for r in d.roles]
        kv_instances = [f"prefill-{r.url.rsplit(':', 1)[1]}" for r in d.roles if r.name.startswith("prefill")]
        d.stop()
    assert_clean(pids)
    # the KV slab of the killed prefill worker's engine core too
    assert [f for i in kv_instances for f in Path("/dev/shm").glob(f"epd-ec-{i}-*")] == []


def test_1p1d_without_encoders_equals_aggregated(aggregated) -> None:
    """No encoders: the router forwards raw media to a prefill and a decode worker that both load
    the vision tower (the decode worker needs it only to recompute)."""
    _, expected, _ = aggregated
    d = deploy("1p+1d")
    try:
        reqs = request_set()
        assert [ask(d.url, r) for r in reqs] == expected
        p = next(r for r in d.roles if r.name == "prefill0")
        dec = next(r for r in d.roles if r.name == "decode0")
        assert metric(p.url, "vision_tower_loaded") == 1 and metric(dec.url, "vision_tower_loaded") == 1
        assert metric(dec.url, "kv_transfers_in_total") >= len(reqs) - 1 and metric(dec.url, "kv_fallbacks_total") == 0
    finally:
        pids = [r.proc.pid for r in d.roles]
        d.stop()
    assert_clean(pids)


def _counter(url: str, name: str) -> float:
    metrics = http("GET", url + "/metrics")[1].decode()
    m = re.search(rf"^epd_{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert m is not None, f"epd_{name} not in {url}/metrics"
    return float(m[1])


def test_shared_store_encodes_each_item_once_and_keeps_outputs(aggregated, monkeypatch) -> None:
    """2e+1pd sharing a real Redis: identical outputs; each distinct item computed once across
    both encoders; repeated items skip the encoder (router directory) and concurrent requests for
    one new item make one encode call; an entry evicted from the store, or the store dying, costs
    an encode, never a request."""
    import redis

    from tests.redis_server import redis_server

    _, expected, _ = aggregated
    with redis_server() as server:
        monkeypatch.setenv("EPD_STORE_PASSWORD", server.password)
        store = ["--store-url", server.url]
        d = Deployment(
            Topology.parse("2e+1pd"),
            None,
            port=0,
            extra_pd_args=[*PD_ARGS, *store],
            extra_encoder_args=store,
        )
        d.start()
        try:
            encoders = [r.url for r in d.roles if r.name.startswith("encoder")]

            def computed() -> float:
                return sum(items_encoded(u, "computed") for u in encoders)

            def encode_calls() -> float:
                return sum(_counter(u, "encode_requests_total") for u in encoders)

            reqs = request_set()
            assert [ask(d.url, r) for r in reqs] == expected
            urls = media_urls(reqs)
            assert computed() == len(urls)  # each distinct item once, across both encoders
            assert _counter(d.url, "router_directory_hits_total") >= 2  # the repeated image, twice
            # sixteen at a time: everything is known, no encoder is called
            calls = encode_calls()
            with ThreadPoolExecutor(16) as pool:
                assert list(pool.map(lambda r: ask(d.url, r), (reqs * 3)[:16])) == (expected * 3)[:16]
            assert encode_calls() == calls and computed() == len(urls)
            # eight concurrent requests for one new image: one encode call in all
            new = {"messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": data_url(ShapesWorld(31).scene().render())}},
                {"type": "text", "text": "Describe the image."},
            ]}]}  # fmt: skip
            with ThreadPoolExecutor(8) as pool:
                answers = list(pool.map(lambda _: ask(d.url, new), range(8)))
            assert len(set(answers)) == 1
            assert encode_calls() == calls + 1 and computed() == len(urls) + 1
            # the store loses everything: the directory's handles go stale, the request still answers
            redis.Redis.from_url(server.url, password=server.password).flushall()
            assert ask(d.url, reqs[1]) == expected[1]  # the worker holds its KV: nothing to read
            assert encode_calls() == calls + 1 and _counter(d.url, "router_pd_retries_total") == 0
            # the same image behind other text must be read: the entry is gone, it is encoded afresh
            # (the encoder's own cache still has it) and the request answers
            behind = {"messages": [{"role": "user", "content": [
                {"type": "text", "text": "Look at this."}, *reqs[1]["messages"][0]["content"],
            ]}]}  # fmt: skip
            first = ask(d.url, behind)
            assert first and encode_calls() == calls + 2 and _counter(d.url, "router_pd_retries_total") == 1
            behind["messages"][0]["content"][0]["text"] = "Now look at this."
            assert ask(d.url, behind)  # the encoder wrote the entry again: no retry
            assert encode_calls() == calls + 2 and _counter(d.url, "router_pd_retries_total") == 1
            # the store dies: encoders compute alone, workers fall back, nothing fails
            server.kill()
            assert ask(d.url, reqs[2]) == expected[2]
            assert ask(d.url, new) == answers[0]
        finally:
            d.stop()


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="pip install 'epdserve[mooncake]'")
def test_mooncake_store_and_connector_deployment(aggregated) -> None:
    """``up --mooncake-master --ec-connector mooncake`` in 2e+1pd: identical outputs, each distinct
    item computed once across both encoders (their Mooncake store), repeated items skip the
    encoder (router directory); the master stops with the deployment."""

    _, expected, _ = aggregated
    d = Deployment(
        Topology.parse("2e+1pd"),
        None,
        port=0,
        ec_connector="mooncake",
        extra_pd_args=PD_ARGS,
        mooncake_master=True,
    )
    d.start()
    master = d.master
    try:
        assert master is not None
        encoders = [r.url for r in d.roles if r.name.startswith("encoder")]
        reqs = assert_same_answers(d.url, expected)
        urls = media_urls(reqs)
        assert sum(items_encoded(u, "computed") for u in encoders) == len(urls)
        assert _counter(d.url, "router_directory_hits_total") >= 2
    finally:
        d.stop()
    assert master is not None and master.proc.poll() is not None
