"""EC connectors: round trips, validation, lifecycle (release, TTL, cleanup, leases), signed handles
and authentication, with producer and consumer in separate processes where it matters (shm, tcp).
The attacks of the security review (forged, foreign, expired and replayed handles, relayed tcp
handshakes, shared fs directories) live in tests/test_transfer_security.py."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import mmap
import os
import signal
import subprocess
import sys
import time
from collections.abc import Coroutine, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch

from epdserve.launcher import free_port
from epdserve.transfer import header as wire
from epdserve.transfer import shm_slab, signing
from epdserve.transfer.base import (
    PROTOCOL_VERSION,
    ECConsumer,
    ECProducer,
    Handle,
    InvalidHandle,
    ProducerFull,
    TransferError,
)
from epdserve.transfer.config import HANDLE_PURPOSE, TCP_PURPOSE, ECConfig
from epdserve.transfer.factory import make_consumer, make_producer
from epdserve.transfer.fs import FsProducer
from epdserve.transfer.shm import ShmProducer
from epdserve.transfer.shm_slab import slab_name
from epdserve.transfer.tcp import TcpConsumer, TcpProducer
from tests.optional import unavailable

REPO = Path(__file__).resolve().parents[1]
MODEL = "qwen2-vl-test@abc123"
SECRET = "test-secret-0123456789"
KEY = ECConfig(secret=SECRET).key(HANDLE_PURPOSE)
T = TypeVar("T")

# A producer in its own process: reads JSON commands on stdin, answers one JSON line each.
PRODUCER_SCRIPT = r"""
import json, sys, torch
from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import make_producer
producer = make_producer(ECConfig(**json.loads(sys.argv[1])))
print(json.dumps({"pid": __import__("os").getpid()}), flush=True)
for line in sys.stdin:
    cmd = json.loads(line)
    if cmd["op"] == "put":
        gen = torch.Generator().manual_seed(cmd["seed"])
        t = torch.randn(cmd["rows"], cmd["width"], generator=gen).to(getattr(torch, cmd["dtype"]))
        print(json.dumps(producer.put(cmd["key"], t, cmd["model_id"])), flush=True)
    elif cmd["op"] == "live":
        print(json.dumps([producer.live_handles, producer.live_entries]), flush=True)
    elif cmd["op"] == "close":
        producer.close()
        print("null", flush=True)
"""


def embeddings(rows: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=gen).to(dtype)


def resign(handle: Handle, **changes: Any) -> Handle:
    """``handle`` with ``changes``, signed again with the cluster key: what a (buggy) producer of the
    cluster could issue, so the checks behind the signature get exercised."""
    return signing.sign({**handle, **changes}, KEY)


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


def config(kind: str, tmp_path: Path, **overrides: Any) -> ECConfig:
    values: dict[str, Any] = {
        "connector": kind,
        "shm_bytes": 4 << 20,
        "shm_dir": str(tmp_path / "shm"),
        "fs_dir": str(tmp_path / "fs"),
        "secret": SECRET,
        "instance": "test",
    }
    values.update(overrides)
    (tmp_path / "shm").mkdir(exist_ok=True)
    return ECConfig(**values)


HAVE_MOONCAKE = unavailable("mooncake.store") is None  # installed, and its native libraries load
MOONCAKE = pytest.param(
    "mooncake", marks=pytest.mark.skipif(not HAVE_MOONCAKE, reason="pip install 'epdserve[mooncake]'")
)


@pytest.fixture(params=["shm", "tcp", "fs", MOONCAKE])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(kind: str, tmp_path: Path) -> Iterator[tuple[ECProducer, ECConsumer]]:
    producer = make_producer(config(kind, tmp_path))
    consumer = make_consumer(config(kind, tmp_path))
    yield producer, consumer
    producer.close()
    run(consumer.close())


class ProducerProcess:
    """A producer in a child process, driven over its stdin/stdout."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", PRODUCER_SCRIPT, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.pid = self.ask(None)["pid"]

    def ask(self, cmd: dict[str, Any] | None) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if cmd is not None:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def put(self, key: str, rows: int, width: int, dtype: str, seed: int) -> Handle:
        return self.ask(
            {"op": "put", "key": key, "rows": rows, "width": width, "dtype": dtype, "seed": seed, "model_id": MODEL}
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


# --- round trips ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_is_exact(pair: tuple[ECProducer, ECConsumer], dtype: torch.dtype) -> None:
    producer, consumer = pair

    async def go() -> None:
        for i, (rows, width) in enumerate([(1, 8), (9, 256), (577, 160), (0, 64)]):
            sent = embeddings(rows, width, dtype, seed=i)
            handle = producer.put(f"item-{i}", sent, MODEL)
            handle = json.loads(json.dumps(handle))  # handles travel as JSON
            got = await consumer.get(handle, rows, width, MODEL)
            assert got.dtype == dtype and got.shape == (rows, width)
            assert torch.equal(got, sent)
            await consumer.release(handle)
            await consumer.release(handle)  # idempotent

    run(go())


def test_put_copies_so_the_caller_may_reuse_its_tensor(pair: tuple[ECProducer, ECConsumer]) -> None:
    producer, consumer = pair
    sent = embeddings(4, 32, torch.float32)
    expected = sent.clone()
    handle = producer.put("k", sent, MODEL)
    sent.zero_()
    assert torch.equal(run(consumer.get(handle, 4, 32, MODEL)), expected)


def test_got_tensor_is_private(pair: tuple[ECProducer, ECConsumer]) -> None:
    producer, consumer = pair
    sent = embeddings(4, 32, torch.float32)

    async def go() -> None:
        handle = producer.put("k", sent, MODEL)
        got = await consumer.get(handle, 4, 32, MODEL)
        await consumer.release(handle)
        producer.put("other", torch.zeros(4, 32), MODEL)  # may land in the same region
        assert torch.equal(got, sent)

    run(go())


@pytest.mark.parametrize("kind", ["shm", "tcp", MOONCAKE])
def test_round_trip_across_processes(kind: str, tmp_path: Path) -> None:
    cfg = config(kind, tmp_path)
    child = ProducerProcess(
        {"connector": kind, "shm_bytes": cfg.shm_bytes, "shm_dir": cfg.shm_dir, "secret": SECRET, "instance": "child"}
    )
    consumer = make_consumer(cfg)
    try:

        async def go() -> None:
            for seed, (rows, width, dtype) in enumerate(
                [(9, 256, "float32"), (33, 128, "bfloat16"), (1024, 512, "float32")]
            ):
                handle = child.put(f"k{seed}", rows, width, dtype, seed)
                got = await consumer.get(handle, rows, width, MODEL)
                assert torch.equal(got, embeddings(rows, width, getattr(torch, dtype), seed))
                await consumer.release(handle)
            # releases reached the producer: it can reclaim everything
            child.put("probe", 1, 8, "float32", 0)
            assert child.ask({"op": "live"}) == [1, 1]
            # a cache hit in another process is a second lease on the same payload
            again = [child.put("same", 16, 64, "float32", 7) for _ in range(2)]
            assert again[0]["lease"] != again[1]["lease"]
            assert child.ask({"op": "live"}) == [3, 2]
            for handle in again:
                assert torch.equal(await consumer.get(handle, 16, 64, MODEL), embeddings(16, 64, torch.float32, 7))
                await consumer.release(handle)
            assert child.ask({"op": "live"}) == [1, 1]

        run(go())
        assert child.ask({"op": "close"}) is None
        assert not list(Path(cfg.shm_dir).glob("epd-ec-*"))
    finally:
        child.stop()
        run(consumer.close())


def test_killed_shm_producer_leaves_a_slab_the_next_start_removes(tmp_path: Path) -> None:
    cfg = config("shm", tmp_path)
    child = ProducerProcess(
        {"connector": "shm", "shm_bytes": cfg.shm_bytes, "shm_dir": cfg.shm_dir, "secret": SECRET, "instance": "crashy"}
    )
    consumer = make_consumer(cfg)
    try:
        handle = child.put("k", 4, 16, "float32", 1)
        assert torch.equal(run(consumer.get(handle, 4, 16, MODEL)), embeddings(4, 16, torch.float32, 1))
        os.kill(child.pid, signal.SIGKILL)
        child.stop()
        assert Path(handle["path"]).exists()
        with ShmProducer(cfg) as fresh:
            assert not Path(handle["path"]).exists()
            assert [p.name for p in Path(cfg.shm_dir).iterdir()] == [fresh.path.name]
    finally:
        child.stop()
        run(consumer.close())


# --- validation ----------------------------------------------------------------------------------


def test_mismatches_fail_with_clear_errors(pair: tuple[ECProducer, ECConsumer]) -> None:
    producer, consumer = pair
    handle = producer.put("k", embeddings(16, 256, torch.float32), MODEL)

    def fails(h: Handle, rows: int, width: int, model: str) -> str:
        with pytest.raises(TransferError) as err:
            run(consumer.get(h, rows, width, model))
        return str(err.value)

    assert fails(handle, 9, 256, MODEL) == "embeddings have shape [16, 256] but the prompt has 9 placeholders"
    assert "expects width 512" in fails(handle, 16, 512, MODEL)
    assert "this instance serves 'other-model'" in fails(handle, 16, 256, "other-model")
    # what a signed handle says is still checked, whoever signed it
    assert "protocol version 99" in fails(resign(handle, version=99), 16, 256, MODEL)
    assert "dtype int8" in fails(resign(handle, dtype="int8"), 16, 256, MODEL)
    assert "bytes" in fails(resign(handle, nbytes=10**12), 16, 256, MODEL)
    assert "malformed" in fails(resign(handle, shape="16x256"), 16, 256, MODEL)
    # a handle that lies about the checksum no longer matches what the producer stored
    assert "not the ones the handle describes" in fails(resign(handle, checksum="0" * 16), 16, 256, MODEL)
    # and the real one still works after all those failures
    assert run(consumer.get(handle, 16, 256, MODEL)).shape == (16, 256)


def test_consumer_refuses_dtypes_it_was_not_configured_for(tmp_path: Path, kind: str) -> None:
    with closing(make_producer(config(kind, tmp_path))) as producer:
        consumer = make_consumer(config(kind, tmp_path, dtypes=("bfloat16",)))
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
        with pytest.raises(TransferError, match="dtype float32"):
            run(consumer.get(handle, 2, 8, MODEL))
        run(consumer.close())


def _corrupt_payload(producer: ECProducer, handle: Handle) -> None:
    """Flip one payload byte where the producer keeps it."""
    if handle["connector"] in ("shm", "mooncake"):
        assert isinstance(producer, ShmProducer)
        with open(producer.path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            _, header_len = shm_slab.REGION_PREFIX.unpack_from(mm, handle["offset"])
            at = handle["offset"] + shm_slab.REGION_HEADER_BYTES + shm_slab.align(header_len) + 5
            mm[at] ^= 0xFF
    elif handle["connector"] == "tcp":
        assert isinstance(producer, TcpProducer)
        entry = producer._store.get(handle["lease"])
        assert entry is not None
        entry.payload[5] ^= 0xFF
    else:
        with open(handle["path"], "r+b") as f:  # the payload is the file's tail
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte ^ 0xFF]))


def test_corrupted_payload_is_detected(pair: tuple[ECProducer, ECConsumer]) -> None:
    producer, consumer = pair
    handle = producer.put("k", embeddings(8, 64, torch.bfloat16), MODEL)
    _corrupt_payload(producer, handle)
    with pytest.raises(TransferError, match="corrupted"):
        run(consumer.get(handle, 8, 64, MODEL))


def test_handles_cannot_point_outside_the_configured_places(tmp_path: Path) -> None:
    """Even a validly signed handle (a misconfigured producer of the cluster) only reaches slabs and
    files under the consumer's own directories."""
    consumer = make_consumer(config("shm", tmp_path))
    (tmp_path / "fs").mkdir(mode=0o700)
    header = wire.to_handle(wire.make_header("k", MODEL, torch.zeros(1, 4), "0" * 16), "shm")
    header = signing.issue(header, KEY, 60.0, signing.new_lease())

    async def go() -> None:
        shm_handle = resign(header, path="/etc/passwd", slab="0" * 16, offset=128, generation=1, slot=0)
        with pytest.raises(TransferError, match="not an EC slab"):
            await consumer.get(shm_handle, 1, 4, MODEL)
        fs_handle = resign(header, connector="fs", path=str(tmp_path / "fs" / "../x.safetensors"))
        with pytest.raises(TransferError, match="not an EC file"):
            await consumer.get(fs_handle, 1, 4, MODEL)
        with pytest.raises(InvalidHandle, match="unknown connector"):
            await consumer.get(resign(header, connector="carrier-pigeon"), 1, 4, MODEL)
        with pytest.raises(TransferError, match="no fs_dir"):
            await make_consumer(config("shm", tmp_path, fs_dir="")).get(fs_handle, 1, 4, MODEL)
        await consumer.close()

    run(go())


def test_producer_rejects_what_it_cannot_describe(pair: tuple[ECProducer, ECConsumer]) -> None:
    producer, _ = pair
    with pytest.raises(TransferError, match="int64"):
        producer.put("k", torch.zeros(2, 2, dtype=torch.int64), MODEL)
    with pytest.raises(TransferError, match="2-D"):
        producer.put("k", torch.zeros(2, 2, 2), MODEL)
    with pytest.raises(TransferError, match="key"):
        producer.put("", torch.zeros(2, 2), MODEL)


def test_wire_header_round_trips_and_rejects_garbage() -> None:
    header = wire.make_header("k", MODEL, torch.zeros(3, 4, dtype=torch.bfloat16), "0123456789abcdef")
    assert wire.decode(wire.encode(header)) == header
    assert header.version == PROTOCOL_VERSION and header.nbytes == 24 and header.shape == (3, 4)
    assert wire.from_handle(json.loads(json.dumps(wire.to_handle(header, "shm", path="x")))) == header
    with pytest.raises(TransferError, match="malformed"):
        wire.decode(b"\x80not json")


def test_config_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="unknown EC connector"):
        ECConfig(connector="rdma")
    with pytest.raises(ValueError, match="instance"):
        ECConfig(instance="a/b")
    with pytest.raises(ValueError, match="fs_dir"):
        ECConfig(connector="fs")
    with pytest.raises(ValueError, match="at least 1 MiB"):
        ECConfig(shm_bytes=4096)
    with pytest.raises(ValueError, match="needs mooncake_device"):
        ECConfig(connector="mooncake", mooncake_protocol="rdma")
    with pytest.raises(ValueError, match="Mooncake protocol"):
        ECConfig(connector="mooncake", mooncake_protocol="udp")  # type: ignore[arg-type]
    assert ECConfig().shm_bytes == 0  # automatic
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ECConfig(secret="short")
    monkeypatch.setenv("EPD_CLUSTER_SECRET", "from-env-0123456789")
    assert ECConfig().secret == "from-env-0123456789"
    assert "from-env" not in repr(ECConfig())
    monkeypatch.delenv("EPD_CLUSTER_SECRET")
    monkeypatch.delenv("EPD_EC_SECRET", raising=False)
    assert ECConfig().secret == "" and not ECConfig().has_secret  # no built-in development secret
    with pytest.raises(TransferError, match="EPD_CLUSTER_SECRET or --cluster-secret-file"):
        ECConfig().key(HANDLE_PURPOSE)
    assert ECConfig(secret=SECRET).key(HANDLE_PURPOSE) != ECConfig(secret=SECRET).key(TCP_PURPOSE)


# --- lifecycle -----------------------------------------------------------------------------------


def test_released_handle_is_gone(pair: tuple[ECProducer, ECConsumer]) -> None:
    producer, consumer = pair

    async def go() -> None:
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
        await consumer.get(handle, 2, 8, MODEL)
        await consumer.release(handle)
        with pytest.raises(InvalidHandle, match="released"):
            await consumer.get(handle, 2, 8, MODEL)

    run(go())


def test_many_cycles_reuse_the_same_memory(pair: tuple[ECProducer, ECConsumer], kind: str) -> None:
    producer, consumer = pair

    async def go() -> None:
        for i in range(300):
            sent = embeddings(64, 1024, torch.float32, seed=i % 7)  # 256 KiB; 300 of them are 75 MiB
            handle = producer.put(f"k{i}", sent, MODEL)
            assert torch.equal(await consumer.get(handle, 64, 1024, MODEL), sent)
            await consumer.release(handle)

    run(go())
    assert producer.live_handles == 0 and producer.live_entries == 0 and producer.held_bytes == 0
    if isinstance(producer, ShmProducer):
        assert producer.path.stat().st_size == producer.capacity_bytes == 4 << 20
        assert producer.free_bytes == producer.capacity_bytes - shm_slab.SLAB_HEADER_BYTES
        assert [p.name for p in producer.path.parent.iterdir()] == [producer.path.name]
    elif isinstance(producer, FsProducer):
        assert not list(Path(producer._dir).iterdir())


def test_shm_slab_full_of_live_regions_refuses_then_recovers_on_release(tmp_path: Path) -> None:
    with ShmProducer(config("shm", tmp_path, shm_bytes=1 << 20)) as producer:
        consumer = make_consumer(config("shm", tmp_path))
        handles = []
        with pytest.raises(ProducerFull, match="slab is full"):
            for i in range(10):
                handles.append(producer.put(f"k{i}", embeddings(64, 1024, torch.float32), MODEL))
        assert len(handles) == 3  # 3 x 256 KiB (+ headers) fit in 1 MiB, a 4th does not
        # a put of a key already stored still succeeds: it is a lease, not a copy
        handles.append(producer.put("k0", embeddings(64, 1024, torch.float32), MODEL))
        with pytest.raises(TransferError, match="do not fit") as never:
            producer.put("huge", embeddings(512, 1024, torch.float32), MODEL)
        assert not isinstance(never.value, ProducerFull)  # retrying would not help: not a 429
        run(consumer.release(handles[1]))
        handles[1] = producer.put("again", embeddings(64, 1024, torch.float32, seed=3), MODEL)
        for h in handles:
            run(consumer.get(h, 64, 1024, MODEL))
        run(consumer.close())


def test_tcp_producer_is_bounded_by_bytes(tmp_path: Path) -> None:
    with TcpProducer(config("tcp", tmp_path, tcp_bytes=100_000)) as producer:
        producer.put("a", embeddings(64, 256, torch.float32), MODEL)  # 64 KiB
        with pytest.raises(ProducerFull, match="tcp_bytes=100000"):
            producer.put("b", embeddings(64, 256, torch.float32), MODEL)
        producer.put("a", embeddings(64, 256, torch.float32), MODEL)  # a lease on the stored one fits
        assert producer.held_bytes == 64 * 256 * 4


def test_unreleased_handles_are_reclaimed_after_ttl(kind: str, tmp_path: Path) -> None:
    # a TTL of 4 s: on a loaded machine (the suite runs three workers on two cores) three reads of
    # 256 KiB have outlasted two seconds, and tcp's sweeper reclaims what is past its TTL every TTL / 4
    cfg = config(kind, tmp_path, ttl_s=4.0, shm_bytes=1 << 20)
    with closing(make_producer(cfg)) as producer:
        consumer = make_consumer(cfg)
        warm = producer.put("warm", embeddings(2, 8, torch.float32), MODEL)  # a consumer's first read may
        run(consumer.get(warm, 2, 8, MODEL))  # start what it reads with (mooncake: its engine, a second)
        with contextlib.suppress(InvalidHandle):  # on a loaded machine that start can outlast the TTL
            run(consumer.release(warm))
        big = embeddings(64, 1024, torch.float32)  # 256 KiB: the 1 MiB slab holds 3
        stale = [producer.put(f"old{i}", big, MODEL) for i in range(3)]
        time.sleep(4.4)
        fresh = [producer.put(f"new{i}", big, MODEL) for i in range(3)]  # only fits if reclaimed
        assert producer.live_handles == 3 and producer.live_entries == 3
        for handle in fresh:  # read first: on a loaded machine the reads below take time
            assert torch.equal(run(consumer.get(handle, 64, 1024, MODEL)), big)
        for handle in stale:
            with pytest.raises(InvalidHandle, match="expired"):
                run(consumer.get(handle, 64, 1024, MODEL))
        run(consumer.close())


def test_reclaimed_region_reused_by_other_data_is_detected(tmp_path: Path) -> None:
    cfg = config("shm", tmp_path)
    with ShmProducer(cfg) as producer:
        consumer = make_consumer(cfg)
        stale = producer.put("old", embeddings(64, 64, torch.float32, seed=1), MODEL)
        run(consumer.release(stale))
        reuse = producer.put("new", embeddings(64, 64, torch.float32, seed=2), MODEL)
        assert reuse["offset"] == stale["offset"]  # same bytes, now someone else's
        assert reuse["generation"] != stale["generation"]
        with pytest.raises(InvalidHandle, match="released"):
            run(consumer.get(stale, 64, 64, MODEL))
        run(consumer.release(stale))  # a late release must not free the new region
        assert producer.live_handles == 1
        producer.put("third", embeddings(1, 8, torch.float32), MODEL)
        assert torch.equal(run(consumer.get(reuse, 64, 64, MODEL)), embeddings(64, 64, torch.float32, seed=2))
        run(consumer.close())


def test_tcp_bad_secret_is_refused(tmp_path: Path) -> None:
    with TcpProducer(config("tcp", tmp_path)) as producer:
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
        intruder = TcpConsumer(config("tcp", tmp_path))
        intruder._tcp_key = b"guess" * 8  # holds a valid handle but not the connection key
        with pytest.raises(TransferError, match="refused authentication"):
            run(intruder.get(handle, 2, 8, MODEL))
        run(intruder.close())
        friend = make_consumer(config("tcp", tmp_path))
        assert run(friend.get(handle, 2, 8, MODEL)).shape == (2, 8)
        run(friend.close())


def test_tcp_unreachable_producer_fails_cleanly(tmp_path: Path) -> None:
    with TcpProducer(config("tcp", tmp_path)) as producer:
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
    consumer = make_consumer(config("tcp", tmp_path))
    with pytest.raises(TransferError, match="cannot connect"):
        run(consumer.get(handle, 2, 8, MODEL))
    run(consumer.release(handle))  # best effort: logs, does not raise
    run(consumer.close())


def test_tcp_pooled_connection_to_a_restarted_producer_is_replaced(tmp_path: Path) -> None:
    consumer = make_consumer(config("tcp", tmp_path))

    async def go() -> None:
        first = TcpProducer(config("tcp", tmp_path))
        port = first.port
        handle = first.put("k", embeddings(2, 8, torch.float32), MODEL)
        await consumer.get(handle, 2, 8, MODEL)  # leaves an idle pooled connection
        first.close()
        await asyncio.sleep(0.05)
        with TcpProducer(config("tcp", tmp_path, tcp_port=port)) as second:
            handle = second.put("k", embeddings(2, 8, torch.float32, seed=5), MODEL)
            got = await consumer.get(handle, 2, 8, MODEL)
            assert torch.equal(got, embeddings(2, 8, torch.float32, seed=5))
        await consumer.close()

    run(go())


def test_stale_slab_of_dead_pid_is_removed_on_start(tmp_path: Path) -> None:
    cfg = config("shm", tmp_path)
    shm_dir = Path(cfg.shm_dir)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    dead_pid = int(dead.stdout)
    stale = shm_dir / slab_name("old", dead_pid, 1)
    stale.write_bytes(b"\0" * 128)
    alive = shm_dir / slab_name("other", os.getpid(), 2)  # a live owner's slab
    alive.write_bytes(b"\0" * 128)
    # a dead pid in the name but the lock held: owner lives in another pid namespace
    foreign = shm_dir / slab_name("ns", dead_pid, 3)
    foreign.write_bytes(b"\0" * 128)
    unrelated = shm_dir / "something-else"
    unrelated.write_bytes(b"")
    with open(foreign, "rb") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        with ShmProducer(cfg) as producer:
            names = {p.name for p in shm_dir.iterdir()}
            assert names == {alive.name, foreign.name, unrelated.name, producer.path.name}


def test_shm_close_leaves_nothing_in_dev_shm() -> None:
    cfg = ECConfig(connector="shm", shm_bytes=2 << 20, secret=SECRET, instance=f"pytest-close-{os.getpid()}")
    before = set(os.listdir("/dev/shm"))
    producer = ShmProducer(cfg)
    assert producer.path.parent == Path("/dev/shm") and producer.path.name not in before
    assert producer.path.exists()
    producer.put("k", embeddings(2, 8, torch.float32), MODEL)
    producer.close()
    producer.close()
    assert not producer.path.exists()
    assert {n for n in os.listdir("/dev/shm") if n.startswith(f"epd-ec-{cfg.instance}")} == set()
    with pytest.raises(TransferError, match="closed"):
        producer.put("k", embeddings(2, 8, torch.float32), MODEL)


def test_fs_files_of_dead_producers_are_removed_and_writes_are_atomic(tmp_path: Path) -> None:
    cfg = config("fs", tmp_path)
    fs_dir = Path(cfg.fs_dir)
    fs_dir.mkdir(mode=0o700)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, check=True
    )
    from epdserve.transfer.fs import host_tag

    stale = fs_dir / f"epd-ec-x-{int(dead.stdout)}-{host_tag()}-0.safetensors"
    half = fs_dir / f".tmp-epd-ec-x-{int(dead.stdout)}-{host_tag()}-1.safetensors"
    lease = fs_dir / f"{stale.name}.{'ab' * 16}.lease"
    other_host = fs_dir / f"epd-ec-x-{int(dead.stdout)}-00000000-0.safetensors"
    for p in (stale, half, lease, other_host):
        p.write_bytes(b"")
    with FsProducer(cfg) as producer:
        assert {p.name for p in fs_dir.iterdir()} == {other_host.name}
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
        assert not [p for p in fs_dir.iterdir() if p.name.startswith(".tmp-")]
        assert Path(handle["path"]).exists()


def test_routing_consumer_reads_every_kind_at_once(tmp_path: Path) -> None:
    consumer = make_consumer(config("shm", tmp_path))
    producers = [make_producer(config(kind, tmp_path)) for kind in ("shm", "tcp", "fs")]
    try:

        async def go() -> None:
            for i, producer in enumerate(producers):
                sent = embeddings(3, 16, torch.bfloat16, seed=i)
                handle = producer.put(f"k{i}", sent, MODEL)
                assert torch.equal(await consumer.get(handle, 3, 16, MODEL), sent)
                await consumer.release(handle)
            await consumer.close()

        run(go())
    finally:
        for producer in producers:
            producer.close()


def test_concurrent_gets(kind: str, tmp_path: Path) -> None:
    cfg = config(kind, tmp_path, shm_bytes=16 << 20)
    with closing(make_producer(cfg)) as producer:
        consumer = make_consumer(cfg)
        # the 4 MiB one takes the worker-thread path, the others stay on the event loop
        sent = [embeddings(rows, 1024, torch.float32, seed=rows) for rows in (256, 64, 64, 1024, 64)]
        handles = [producer.put(f"k{i}", t, MODEL) for i, t in enumerate(sent)]

        async def go() -> list[torch.Tensor]:
            got = await asyncio.gather(
                *(consumer.get(h, t.shape[0], 1024, MODEL) for h, t in zip(handles, sent, strict=True))
            )
            await asyncio.gather(*(consumer.release(h) for h in handles))
            await consumer.close()
            return list(got)

        for got, expected in zip(run(go()), sent, strict=True):
            assert torch.equal(got, expected)


@pytest.mark.skipif(not HAVE_MOONCAKE, reason="pip install 'epdserve[mooncake]'")
def test_mooncake_handles_stay_inside_their_slab_and_fail_cleanly(tmp_path: Path) -> None:
    """Even a validly signed mooncake handle (a buggy producer of the cluster) is only read within
    the slab it names; an unreachable producer is a TransferError, never a hang or a crash."""
    cfg = config("mooncake", tmp_path, timeout_s=5)
    with closing(make_producer(cfg)) as producer:
        consumer = make_consumer(cfg)
        handle = producer.put("k", embeddings(4, 8, torch.float32), MODEL)
        size = handle["size"]
        for bad in (
            {"offset": size - 64},  # the payload would end past the slab
            {"offset": handle["offset"] + 1},  # not a region boundary
            {"offset": 0},  # the slab header
            {"session": "127.0.0.1:notaport"},
        ):
            with pytest.raises(TransferError) as e:
                run(consumer.get(resign(handle, **bad), 4, 8, MODEL))
            assert not isinstance(e.value, InvalidHandle)
        unreachable = resign(handle, session=f"127.0.0.1:{free_port()}")
        with pytest.raises(TransferError):
            run(consumer.get(unreachable, 4, 8, MODEL))
        forged = {**handle, "offset": handle["offset"] + 64}  # not re-signed
        with pytest.raises(InvalidHandle):
            run(consumer.get(forged, 4, 8, MODEL))
        assert torch.equal(run(consumer.get(handle, 4, 8, MODEL)), embeddings(4, 8, torch.float32))
        run(consumer.close())
