"""The shared embedding store on a real Redis (password required): entries round-trip and are
validated before use (tampered, foreign or mislabelled entries are rejected and deleted), a store
that refuses us, dies or was never there answers misses within the timeout, and concurrent misses
on one item across encoders compute it once, even when the encoder holding the claim dies."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import redis
import torch

from epdserve.api.media import MediaResolver
from epdserve.assets import default_model_dir
from epdserve.bench.workload import image_data_url
from epdserve.common.store_config import StoreConfig
from epdserve.encoder.protocol import ENCODER_PROTOCOL_VERSION
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.media.fetch import decode_data_url
from epdserve.media.hashing import media_uuid
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.security.credentials import ClusterCredential
from epdserve.shapes import ShapesWorld
from epdserve.store.base import Claim
from epdserve.store.record import EntryCheck, pack
from epdserve.store.redis_store import RedisStore
from epdserve.store.single_flight import fetch_or_claim, holding
from tests.redis_server import RedisServer, redis_server
from tests.server_utils import http, internal_headers, post_json
from tests.store_work import encoder_request

MODEL, WIDTH, MERGE = "m", 8, 4
KEY = ClusterCredential.generate().derive("ec-store")


def rows_of(grid: tuple[int, int, int]) -> int:
    return grid[0] * grid[1] * grid[2] // MERGE


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def store(server: RedisServer, key: bytes = KEY, model: str = MODEL, **cfg: object) -> RedisStore:
    """A store on ``server``; its operations wait up to 5 s unless ``timeout_s`` is given (a loaded
    test machine can take longer than the default's half second to connect)."""
    cfg = {"timeout_s": 5.0, **cfg}
    config = StoreConfig(url=server.url, password=server.password, **cfg)  # type: ignore[arg-type]
    return RedisStore(config, EntryCheck(model, key, WIDTH, rows_of))


def emb(seed: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


def raw(server: RedisServer) -> redis.Redis:
    return redis.Redis.from_url(server.url, password=server.password)


def test_an_entry_round_trips_and_only_for_its_model(server: RedisServer) -> None:
    async def main() -> None:
        a, other = store(server), store(server, model="other-model")
        assert await a.get("u1") is None and a.stats.misses == 1
        e = emb(1)
        assert await a.put("u1", (1, 4, 4), e) is not None
        got = await a.get("u1")
        assert got is not None and got.grid_thw == (1, 4, 4) and torch.equal(got.embeddings, e)
        assert a.stats.hits == 1 and a.stats.writes == 1
        assert await other.get("u1") is None  # another model's namespace
        await a.close()
        await other.close()

    asyncio.run(main())


@pytest.mark.parametrize("harm", ["payload", "header", "foreign key", "wrong uuid", "wrong rows", "truncated"])
def test_a_bad_entry_is_rejected_deleted_and_counted(server: RedisServer, harm: str) -> None:
    r = raw(server)
    key = f"epd:ec:v1:{MODEL}:u2"
    good, _ = pack("u2", MODEL, (1, 4, 4), emb(2), KEY)
    bad = {
        "payload": good[:-1] + bytes([good[-1] ^ 1]),
        "header": good.replace(b'"shape":[4,8]', b'"shape":[4,9]'),
        "foreign key": pack("u2", MODEL, (1, 4, 4), emb(2), ClusterCredential.generate().derive("ec-store"))[0],
        "wrong uuid": pack("u3", MODEL, (1, 4, 4), emb(2), KEY)[0],
        "wrong rows": pack("u2", MODEL, (1, 4, 8), emb(2), KEY)[0],  # grid says 8 rows, 4 stored
        "truncated": good[:10],
    }[harm]
    assert bad != good
    r.set(key, bad)

    async def main() -> None:
        s = store(server)
        assert await s.get("u2") is None
        assert s.stats.rejected == 1 and s.stats.hits == 0
        await s.close()

    asyncio.run(main())
    assert r.exists(key) == 0


def test_a_store_that_refuses_or_dies_is_a_quick_miss(server: RedisServer) -> None:
    async def main() -> None:
        config = StoreConfig(url=server.url, password="not-it", timeout_s=0.5)
        wrong = RedisStore(config, EntryCheck(MODEL, KEY, WIDTH, rows_of))
        assert await wrong.get("u") is None and wrong.stats.errors == 1 and not wrong.available
        assert await wrong.get("u") is None and wrong.stats.skipped == 1  # not asked again for down_s
        assert (await wrong.claim("u")).won  # no coordination: compute alone
        await wrong.close()
        s = store(server, timeout_s=0.5)
        assert await s.put("u", (1, 4, 4), emb(3)) is not None
        server.kill()
        t0 = time.monotonic()
        assert await s.get("u") is None
        assert await s.put("v", (1, 4, 4), emb(4)) is None
        assert time.monotonic() - t0 < 2.0 and s.stats.errors == 1 and s.stats.skipped == 1
        await s.close()

    asyncio.run(main())


def test_concurrent_misses_across_encoders_compute_once(server: RedisServer) -> None:
    computed: list[str] = []

    async def main() -> None:
        a, b = store(server), store(server)  # two encoders
        outs = await asyncio.gather(*(encoder_request(a if i % 2 else b, "cold", computed, emb(5)) for i in range(8)))
        assert computed == ["cold"]
        assert all(torch.equal(o, outs[0]) for o in outs)
        assert a.stats.waits + b.stats.waits == 7
        await a.close()
        await b.close()

    asyncio.run(main())


def test_a_claim_whose_holder_died_is_taken_over(server: RedisServer) -> None:
    # an encoder claimed the item and died: its claim is never renewed, released or fulfilled
    raw(server).set(f"epd:ec:v1:{MODEL}:claim:orphan", "dead-encoder", px=400)

    async def main() -> None:
        s = store(server)
        t0 = time.monotonic()
        got = await fetch_or_claim(s, "orphan", wait_s=10)
        assert isinstance(got, Claim) and got.won and got.token
        assert 0.3 < time.monotonic() - t0 < 3 and s.stats.takeovers == 1
        # the taken-over claim is this encoder's own: renewing and releasing it works
        async with holding(s, "orphan", got, renew_s=0.05):
            await asyncio.sleep(0.2)
            assert await s.claimed("orphan")
        assert not await s.claimed("orphan")
        await s.close()

    asyncio.run(main())


# ---- encoders sharing a store, as real processes ------------------------------------------------


def _metric(url: str, name: str) -> float:
    status, body = http("GET", url + "/metrics")
    assert status == 200
    m = re.search(rf"^epd_{re.escape(name)} (\S+)$", body.decode(), re.MULTILINE)
    assert m is not None, f"epd_{name} not in /metrics"
    return float(m.group(1))


def _encode(url: str, seed: int) -> tuple[int, dict]:
    image = ShapesWorld(seed).sample("describe").scenes[0].render()
    items = [{"modality": "image", "url": image_data_url(image)}]
    body = {"version": ENCODER_PROTOCOL_VERSION, "model": "shapes-qwen2vl", "items": items}
    return post_json(url + "/v1/encode", body, internal_headers())


@contextmanager
def _encoders(server: RedisServer, n: int) -> Iterator[list[str]]:
    procs, urls = [], []
    env = {"EPD_STORE_PASSWORD": server.password}
    try:
        for _ in range(n):
            port = free_port()
            args = ["encoder", "--port", str(port), "--ec-shm-bytes", str(16 << 20), "--store-url", server.url]
            # a store call on a loaded machine (the suite runs three workers on two cores) can take
            # longer than a fraction of a second; past the timeout an encoder computes alone
            procs.append(start_role([*args, "--store-timeout-s", "1", "--store-down-s", "1"], env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc, timeout=120)
        yield urls
    finally:
        for p in procs:
            stop(p)


def test_encoders_share_work_through_the_store_and_survive_its_death(server: RedisServer) -> None:
    with _encoders(server, 2) as (a, b):
        status, out = _encode(a, 1)
        assert status == 200 and out["items"][0]["status"] == "computed"
        warm_up = _metric(b, "encoder_batches_total")  # its own warm-up's forward
        status, out = _encode(b, 1)  # computed by a: b runs no forward
        assert status == 200 and out["items"][0]["status"] == "store_hit"
        assert _metric(b, "encoder_batches_total") == warm_up and _metric(b, "encoder_store_hits_total") == 1
        # eight concurrent requests for one cold image, spread over both: one forward in all
        before = _metric(a, "encoder_batch_items_total") + _metric(b, "encoder_batch_items_total")
        with ThreadPoolExecutor(8) as pool:
            outs = list(pool.map(lambda i: _encode(a if i % 2 else b, 2), range(8)))
        assert all(s == 200 for s, _ in outs)
        statuses = sorted(o["items"][0]["status"] for _, o in outs)
        assert statuses.count("computed") == 1, statuses
        after = _metric(a, "encoder_batch_items_total") + _metric(b, "encoder_batch_items_total")
        assert after - before == 1
        # whether computed, waited for or read from the store, each item gave its pixels' bytes back
        assert _metric(a, "encoder_pending_media_bytes") == _metric(b, "encoder_pending_media_bytes") == 0
        # the store dies: encoders compute alone, no request fails
        server.kill()
        for url, seed in ((a, 3), (b, 3), (a, 1)):
            status, out = _encode(url, seed)
            assert status == 200, out
        assert _metric(a, "encoder_store_errors_total") + _metric(a, "encoder_store_skipped_total") >= 1


def test_items_waiting_for_another_encoder_hold_no_claim_of_their_calls_others(server: RedisServer) -> None:
    """A call's items are counted in its prompt's room before any of them is claimed: while one
    waits for the claim another encoder holds on it, the call's other item is computed and written
    (were it claimed first, it would wait in the room holding its claim, and an encoder counting
    the same two items the other way round would wait for it in turn)."""
    x, y = (image_data_url(ShapesWorld(seed).sample("describe").scenes[0].render()) for seed in (40, 41))
    processor = VisionProcessor(ProcessorConfig.from_pretrained(default_model_dir()))
    with ThreadPoolExecutor(1) as pool:
        kwargs = MediaResolver("shapes-qwen2vl", processor, MediaLimits(), pool).processor_kwargs
    uuid_x, uuid_y = (media_uuid("shapes-qwen2vl", "image", decode_data_url(u, MediaLimits()), kwargs) for u in (x, y))
    prefix = "epd:ec:v1:shapes-qwen2vl:"
    with _encoders(server, 1) as (a,):
        raw(server).set(prefix + "claim:" + uuid_y, "another-encoder", px=10_000)  # computing y, slowly
        items = [{"modality": "image", "url": u} for u in (x, y)]
        body = {"version": ENCODER_PROTOCOL_VERSION, "model": "shapes-qwen2vl", "items": items,
                "context": {"max_model_len": 4096}}  # fmt: skip
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(post_json, a + "/v1/encode", body, internal_headers())
            deadline = time.monotonic() + 6
            while not raw(server).exists(prefix + uuid_x) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert raw(server).exists(prefix + uuid_x), "x waited for y's claim"
            assert not call.done()  # y still waits for the other encoder
            status, out = call.result(timeout=60)  # its claim lapsed: y computed here
        assert status == 200 and [it["status"] for it in out["items"]] == ["computed", "computed"], out
