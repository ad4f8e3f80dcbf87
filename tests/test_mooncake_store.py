"""The shared embedding store on a real Mooncake master and real Mooncake clients: entries written
by one member are read by another and checked before use (a forged entry is rejected and deleted),
claims make concurrent misses compute (almost always) once and lapse when their holder dies, a dead master is a
quick miss, a member that has not joined yet answers misses (never waits), and two encoder
processes share their work through it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
import torch

from epdserve.bench.workload import image_data_url
from epdserve.common.store_config import StoreConfig
from epdserve.encoder.protocol import ENCODER_PROTOCOL_VERSION
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.security.credentials import ClusterCredential
from epdserve.shapes import ShapesWorld
from epdserve.store.base import Claim
from epdserve.store.mooncake_master import MooncakeMaster, master_binary, start_master
from epdserve.store.mooncake_store import MooncakeStore
from epdserve.store.record import EntryCheck
from epdserve.store.single_flight import fetch_or_claim
from tests.server_utils import counter, internal_headers, post_json
from tests.store_work import encoder_request

pytest.importorskip("mooncake.store", reason="Mooncake is not installed (pip install 'epdserve[mooncake]')")

MODEL, WIDTH, MERGE = "m", 8, 4
KEY = ClusterCredential.generate().derive("ec-store")


def rows_of(grid: tuple[int, int, int]) -> int:
    return grid[0] * grid[1] * grid[2] // MERGE


def emb(seed: int, rows: int = 4) -> torch.Tensor:
    return torch.randn(rows, WIDTH, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def master() -> Iterator[MooncakeMaster]:
    if master_binary() is None:
        pytest.skip("mooncake_master is not installed")
    m = start_master()
    try:
        yield m
    finally:
        m.kill()


def member(master: MooncakeMaster, lend: bool = True, key: bytes = KEY, **cfg: object) -> MooncakeStore:
    # calls get a longer timeout than a deployment's: a slow call under a loaded test machine must
    # not make a member compute alone (that is tested on its own: the dead master)
    config = StoreConfig(**{"url": master.url, "segment_bytes": 32 << 20, "timeout_s": 3.0, **cfg})  # type: ignore[arg-type]
    return MooncakeStore(config, EntryCheck(MODEL, key, WIDTH, rows_of), lend=lend)


def test_entries_cross_members_and_forged_ones_are_rejected(master: MooncakeMaster) -> None:
    async def main() -> None:
        encoder, reader = member(master), member(master, lend=False)
        assert await encoder.wait_joined(20) and await reader.wait_joined(20)
        e = emb(1)
        header = await encoder.put("u1", (1, 4, 4), e)
        assert header is not None and header.key == "u1"
        got = await reader.get("u1")
        assert got is not None and torch.equal(got.embeddings, e) and got.grid_thw == (1, 4, 4)
        assert await reader.present("u1") and not await reader.present("u2")
        assert await reader.get("u2") is None and reader.stats.misses == 1
        # a member without the cluster secret writes an entry: nobody uses it, it is deleted
        other = member(master, key=ClusterCredential.generate().derive("ec-store"))
        assert await other.wait_joined(20)
        assert await other.put("u3", (1, 4, 4), emb(2)) is not None
        assert await reader.get("u3") is None and reader.stats.rejected == 1
        # garbage under an entry's key
        await encoder._write(encoder._prefix + "u4", b"\x00garbage")
        assert await reader.get("u4") is None and reader.stats.rejected == 2
        for s in (encoder, reader, other):
            await s.close()

    asyncio.run(main())


def test_concurrent_misses_compute_once_and_a_dead_holders_claim_lapses(master: MooncakeMaster) -> None:
    computed: list[str] = []

    async def main() -> None:
        a, b = member(master), member(master, lend=False)
        assert await a.wait_joined(20) and await b.wait_joined(20)
        outs = await asyncio.gather(*(encoder_request(a if i % 2 else b, "cold", computed, emb(5)) for i in range(6)))
        # Mooncake has no compare-and-set: claims cut duplicates but cannot exclude them (a race of
        # two first writes may let both compute); without claims all six would compute
        assert 1 <= len(computed) <= 2 and all(torch.equal(o, outs[0]) for o in outs)
        assert a.stats.waits + b.stats.waits >= 1
        # a claim whose holder died (never renewed): taken over after its deadline
        dead = member(master, lend=False, claim_ttl_s=0.4)
        assert await dead.wait_joined(20)
        claim = await dead.claim("orphan")
        assert claim.won and claim.token and await a.claimed("orphan")
        # the cold round may itself take over a claim whose holder was slow to renew on a loaded
        # machine: count this round's takeovers only
        takeovers = a.stats.takeovers
        t0 = time.monotonic()
        got = await fetch_or_claim(a, "orphan", wait_s=10)
        assert isinstance(got, Claim) and got.won and got.token
        assert time.monotonic() - t0 < 3 and a.stats.takeovers == takeovers + 1
        await a.unclaim("orphan", got)
        assert not await a.claimed("orphan")
        for s in (a, b, dead):
            await s.close()

    asyncio.run(main())


def test_a_reader_s_first_call_waits_for_its_join(master: MooncakeMaster) -> None:
    """A language-model instance makes its reader on the first store handle it gets: that handle's
    entry must be found, not missed while the reader joins (an encoder's early call is a miss)."""

    async def main() -> None:
        encoder = member(master)
        assert await encoder.wait_joined(20)
        e = emb(5)
        assert await encoder.put("u5", (1, 4, 4), e) is not None
        reader = member(master, lend=False)  # asked at once, before it joined
        got = await reader.get("u5")
        assert got is not None and torch.equal(got.embeddings, e) and reader.stats.skipped == 0
        for s in (encoder, reader):
            await s.close()

    asyncio.run(main())


def test_a_dead_master_is_a_quick_miss(master: MooncakeMaster) -> None:
    async def main() -> None:
        early = member(master)  # asked at once: a miss, not a wait for the join
        assert await early.get("u") is None and early.stats.skipped == 1 and early.stats.errors == 0
        assert await early.wait_joined(20)
        await early.close()
        s = member(master, timeout_s=0.5, down_s=30)
        assert await s.wait_joined(20)
        assert await s.put("u", (1, 4, 4), emb(3)) is not None
        master.kill()
        t0 = time.monotonic()
        assert await s.get("v") is None
        assert await s.put("w", (1, 4, 4), emb(4)) is None
        assert (await s.claim("x")).won  # no coordination: compute alone
        # the first call to reach the dead master fails (Mooncake's client may answer a read of a
        # missing key as a plain miss before that): counted once, and every call after it is skipped
        assert time.monotonic() - t0 < 2.0 and s.stats.errors == 1 and s.stats.skipped >= 1
        skipped = s.stats.skipped
        assert await s.get("y") is None and s.stats.skipped == skipped + 1 and s.stats.errors == 1

    asyncio.run(main())


def test_two_encoder_processes_share_work_through_mooncake(master: MooncakeMaster) -> None:
    procs, urls = [], []
    try:
        for _ in range(2):
            port = free_port()
            args = ["encoder", "--port", str(port), "--ec-shm-bytes", str(16 << 20), "--store-url", master.url]
            procs.append(start_role([*args, "--store-segment-bytes", str(32 << 20)]))
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs, strict=True):
            wait_healthy(url, proc, timeout=120)
        image = image_data_url(ShapesWorld(5).sample("describe").scenes[0].render())
        body = {
            "version": ENCODER_PROTOCOL_VERSION,
            "model": "shapes-qwen2vl",
            "items": [{"modality": "image", "url": image}],
        }
        status, out = post_json(urls[0] + "/v1/encode", body, internal_headers())
        assert status == 200 and out["items"][0]["status"] == "computed"
        warm_up = counter(urls[1], "encoder_batches_total")  # its own warm-up's forward
        status, out = post_json(urls[1] + "/v1/encode", body, internal_headers())
        assert status == 200 and out["items"][0]["status"] == "store_hit"
        assert counter(urls[1], "encoder_batches_total") == warm_up
        master.kill()  # the store dies: encoders compute alone
        body["items"][0]["url"] = image_data_url(ShapesWorld(6).sample("describe").scenes[0].render())
        for url in urls:
            status, out = post_json(url + "/v1/encode", body, internal_headers())
            assert status == 200, out
    finally:
        for p in procs:
            stop(p, timeout=5)  # leaving a dead master blocks Mooncake's client for a while: no need to wait
