"""The attacks of the EC security review, run against the real connectors: forged, tampered,
foreign, expired and replayed handles; cache hits that must not copy; producer-side release; a slab
that fills; relayed and replayed tcp handshakes; shared fs directories; slab sizing."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch

from epdserve.transfer import shm_slab, signing, tcp
from epdserve.transfer.base import ECConsumer, ECProducer, Handle, InvalidHandle, ProducerFull, TransferError
from epdserve.transfer.config import TCP_PURPOSE, ECConfig
from epdserve.transfer.factory import RoutingConsumer, make_consumer, make_producer
from epdserve.transfer.fs import FsProducer, lease_path
from epdserve.transfer.shm import ShmProducer
from epdserve.transfer.tcp import TcpProducer
from tests.test_transfer import KEY, MODEL, SECRET, config, embeddings, resign, run


@pytest.fixture(params=["shm", "tcp", "fs"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def pair(kind: str, tmp_path: Path) -> Iterator[tuple[ECProducer, RoutingConsumer]]:
    producer = make_producer(config(kind, tmp_path))
    consumer = make_consumer(config(kind, tmp_path))
    assert isinstance(consumer, RoutingConsumer)
    yield producer, consumer
    producer.close()
    run(consumer.close())


def reads(consumer: ECConsumer, handle: Handle, sent: torch.Tensor) -> bool:
    return torch.equal(run(consumer.get(handle, sent.shape[0], sent.shape[1], MODEL)), sent)


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


# --- forged, foreign, expired, replayed ------------------------------------------------------------


def tampered(handle: Handle, tmp_path: Path, decoy_port: int) -> list[Handle]:
    """Every way a client could alter a handle it was given, each keeping the original mac."""
    location = {
        "shm": {"offset": handle.get("offset", 0) + 64, "generation": 1, "slot": 1, "path": str(tmp_path / "x")},
        "tcp": {"host": "127.0.0.2", "port": decoy_port},
        "fs": {"path": str(tmp_path / "fs" / "decoy.safetensors")},
    }[handle["connector"]]
    common = {"key": "other", "checksum": "0" * 16, "lease": "ab" * 16, "expires_at": handle["expires_at"] + 3600}
    forged = [{**handle, name: value} for name, value in {**common, **location}.items()]
    if handle["connector"] == "tcp":
        forged.append({**handle, "host": "127.0.0.1", "port": decoy_port})
    forged.append({k: v for k, v in handle.items() if k != "mac"})
    forged.append({**handle, "mac": "0" * 64})
    forged.append({**handle, "mac": handle["mac"].upper()})
    return forged


def test_forged_handles_are_refused_before_any_io(pair: tuple[ECProducer, RoutingConsumer], tmp_path: Path) -> None:
    producer, consumer = pair
    sent = embeddings(8, 32, torch.float32)
    victim = producer.put("victim", sent, MODEL)
    decoy = socket.create_server(("127.0.0.1", 0))  # where a forged tcp handle would point
    decoy.settimeout(0.2)
    decoy_file = tmp_path / "fs" / "decoy.safetensors"
    decoy_file.parent.mkdir(mode=0o700, exist_ok=True)
    decoy_file.write_bytes(b"precious")
    with closing(decoy):
        for forged in tampered(victim, tmp_path, decoy.getsockname()[1]):
            for attempt in (consumer.get(forged, 8, 32, MODEL), consumer.release(forged)):
                with pytest.raises(InvalidHandle) as err:
                    run(attempt)
                message = str(err.value)
                assert str(tmp_path) not in message and "127.0.0" not in message
                assert str(decoy.getsockname()[1]) not in message
            with pytest.raises(InvalidHandle):
                producer.release(forged)
        with pytest.raises(TimeoutError):
            decoy.accept()  # nobody dialed the decoy
    assert decoy_file.read_bytes() == b"precious"
    # the victim's handle and payload survived every attempt
    assert reads(consumer, victim, sent)
    assert producer.live_handles == 1


def test_non_objects_and_garbage_are_invalid(tmp_path: Path) -> None:
    consumer = make_consumer(config("shm", tmp_path))
    for garbage in (None, "handle", 42, [1, 2], {"mac": 5}, {"mac": "é" * 64}, {"connector": "shm"}):
        with pytest.raises(InvalidHandle):
            run(consumer.get(garbage, 1, 1, MODEL))  # type: ignore[arg-type]
    run(consumer.close())


def test_foreign_and_expired_handles_are_invalid(kind: str, tmp_path: Path) -> None:
    cfg = config(kind, tmp_path, ttl_s=0.3)
    with closing(make_producer(cfg)) as producer:
        sent = embeddings(4, 16, torch.float32)
        handle = producer.put("k", sent, MODEL)
        other = ECConfig(secret="another-cluster-secret-42")
        stranger = make_consumer(config(kind, tmp_path, secret=other.secret))
        with pytest.raises(InvalidHandle, match="signature"):
            run(stranger.get(handle, 4, 16, MODEL))
        # a handle another cluster signed is just as foreign here
        foreign = signing.sign({k: v for k, v in handle.items() if k != "mac"}, other.key("ec-handle"))
        consumer = make_consumer(cfg)
        with pytest.raises(InvalidHandle, match="signature"):
            run(consumer.get(foreign, 4, 16, MODEL))
        assert reads(consumer, handle, sent)
        time.sleep(0.35)
        with pytest.raises(InvalidHandle, match="expired"):
            run(consumer.get(handle, 4, 16, MODEL))
        run(stranger.close())
        run(consumer.close())


def test_consumer_without_a_secret_accepts_nothing(kind: str, tmp_path: Path) -> None:
    with closing(make_producer(config(kind, tmp_path))) as producer:
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
        blind = make_consumer(config(kind, tmp_path, secret=""))
        with pytest.raises(InvalidHandle, match="no cluster credential"):
            run(blind.get(handle, 2, 8, MODEL))
        with pytest.raises(InvalidHandle):
            run(blind.release(handle))
        run(blind.close())


def test_producer_needs_the_cluster_secret(kind: str, tmp_path: Path) -> None:
    with pytest.raises(TransferError, match="set EPD_CLUSTER_SECRET or --cluster-secret-file"):
        make_producer(config(kind, tmp_path, secret=""))
    assert not list((tmp_path / "shm").iterdir())  # nothing was acquired first


def test_replayed_release_does_not_touch_other_leases(pair: tuple[ECProducer, RoutingConsumer]) -> None:
    producer, consumer = pair
    sent = embeddings(8, 32, torch.float32)

    async def go() -> None:
        keeper = producer.put("k", sent, MODEL)
        spent = producer.put("k", sent, MODEL)
        assert torch.equal(await consumer.get(spent, 8, 32, MODEL), sent)
        await consumer.release(spent)
        with pytest.raises(InvalidHandle, match="released"):
            await consumer.get(spent, 8, 32, MODEL)
        fresh = producer.put("k", sent, MODEL)  # a new lease on the same entry
        assert producer.live_entries == 1 and producer.live_handles == 2
        for _ in range(3):
            await consumer.release(spent)
            assert producer.release(spent) is False
        assert producer.live_handles == 2
        for handle in (keeper, fresh):
            assert torch.equal(await consumer.get(handle, 8, 32, MODEL), sent)

    run(go())


# --- leases ----------------------------------------------------------------------------------------


def test_cache_hit_is_a_lease_not_a_copy(pair: tuple[ECProducer, RoutingConsumer]) -> None:
    producer, consumer = pair
    sent = embeddings(16, 64, torch.bfloat16)
    first = producer.put("img", sent, MODEL)
    held = producer.held_bytes
    assert held == sent.numel() * 2
    second = producer.put("img", sent, MODEL)
    assert first["lease"] != second["lease"] and first["mac"] != second["mac"]
    assert producer.live_entries == 1 and producer.live_handles == 2 and producer.held_bytes == held
    run(consumer.release(first))
    assert reads(consumer, second, sent)
    assert producer.live_entries == 1 and producer.live_handles == 1
    run(consumer.release(second))
    assert producer.live_entries == 0 and producer.live_handles == 0 and producer.held_bytes == 0
    # other model, dtype or shape under the same key is another payload
    producer.put("img", sent, MODEL)
    producer.put("img", sent, "other-model")
    producer.put("img", sent.float(), MODEL)
    producer.put("img", sent[:8], MODEL)
    assert producer.live_entries == 4


def test_producer_side_release_frees_the_lease(pair: tuple[ECProducer, RoutingConsumer], tmp_path: Path) -> None:
    producer, consumer = pair
    baseline = producer.free_bytes if isinstance(producer, ShmProducer) else None
    sent = embeddings(32, 64, torch.float32)
    a = producer.put("k", sent, MODEL)
    b = producer.put("k", sent, MODEL)
    assert producer.release(a) is True
    assert producer.release(a) is False  # idempotent
    with pytest.raises(InvalidHandle, match="released"):
        run(consumer.get(a, 32, 64, MODEL))
    assert reads(consumer, b, sent) and producer.live_entries == 1
    # a validly signed handle of another producer is not this one's to release
    with closing(
        make_producer(config(b["connector"], tmp_path, instance="other", fs_dir=str(tmp_path / "fs2")))
    ) as other:
        theirs = other.put("k", sent, MODEL)
        assert producer.release(theirs) is False
        assert other.live_handles == 1
    assert producer.release(b) is True
    assert producer.live_handles == 0 and producer.live_entries == 0 and producer.held_bytes == 0
    if isinstance(producer, ShmProducer):
        assert producer.free_bytes == baseline
    if isinstance(producer, FsProducer):
        assert not list(Path(producer._dir).iterdir())


def test_shm_lease_slots_run_out_into_a_new_copy(tmp_path: Path) -> None:
    with ShmProducer(config("shm", tmp_path)) as producer:
        consumer = make_consumer(config("shm", tmp_path))
        sent = embeddings(4, 16, torch.float32)
        handles = [producer.put("k", sent, MODEL) for _ in range(shm_slab.LEASE_SLOTS + 1)]
        assert len({h["offset"] for h in handles[: shm_slab.LEASE_SLOTS]}) == 1
        assert handles[-1]["offset"] != handles[0]["offset"]
        assert producer.live_entries == 2 and producer.live_handles == shm_slab.LEASE_SLOTS + 1
        assert len({(h["offset"], h["slot"]) for h in handles}) == len(handles)
        for handle in handles:
            assert reads(consumer, handle, sent)
            run(consumer.release(handle))
        assert producer.live_entries == 0
        run(consumer.close())


def test_shm_generations_are_random(tmp_path: Path) -> None:
    with ShmProducer(config("shm", tmp_path)) as producer:
        consumer = make_consumer(config("shm", tmp_path))
        generations = []
        for i in range(4):
            handle = producer.put(f"k{i}", embeddings(1, 8, torch.float32), MODEL)
            generations.append(handle["generation"])
            run(consumer.release(handle))
        assert all(g > 1 << 20 for g in generations) and len(set(generations)) == 4
        run(consumer.close())


def test_full_producer_raises_producer_full_then_recovers(kind: str, tmp_path: Path) -> None:
    if kind == "fs":
        pytest.skip("the fs connector is bounded by its filesystem only")
    cfg = config(kind, tmp_path, shm_bytes=1 << 20, tcp_bytes=800_000)
    with closing(make_producer(cfg)) as producer:
        consumer = make_consumer(cfg)
        big = embeddings(64, 1024, torch.float32)  # 256 KiB
        handles = [producer.put(f"k{i}", big, MODEL) for i in range(3)]
        with pytest.raises(ProducerFull):
            producer.put("k3", big, MODEL)
        run(consumer.release(handles[0]))
        assert reads(consumer, producer.put("k3", big, MODEL), big)
        run(consumer.close())


# --- tcp authentication ----------------------------------------------------------------------------


def test_tcp_relayed_handshake_gives_the_relay_nothing(tmp_path: Path) -> None:
    """A party without the secret relays a real producer's handshake to a real consumer: the producer
    does answer AUTH_OK, but the relay cannot issue a request of its own on that connection."""
    cfg = config("tcp", tmp_path)
    with TcpProducer(cfg) as producer:
        sent = embeddings(4, 16, torch.float32)
        victim = producer.put("victim", sent, MODEL)
        relay = socket.create_server(("127.0.0.1", 0))
        relay.settimeout(10)
        # the consumer only dials what is signed, so the test signs the lure itself
        lure = resign(victim, port=relay.getsockname()[1])
        seen: dict[str, bytes] = {}

        def relay_main() -> None:
            with (
                closing(relay),
                relay.accept()[0] as consumer_side,
                socket.create_connection(("127.0.0.1", producer.port), timeout=10) as producer_side,
            ):
                consumer_side.settimeout(10)
                consumer_side.sendall(recv_exactly(producer_side, len(tcp.HELLO) + tcp.NONCE_BYTES))
                producer_side.sendall(recv_exactly(consumer_side, tcp.NONCE_BYTES + tcp.MAC_BYTES))
                auth = recv_exactly(producer_side, 1 + tcp.MAC_BYTES)
                seen["auth"] = auth[:1]
                consumer_side.sendall(auth)
                seen["withheld"] = consumer_side.recv(4096)  # the consumer's own request
                token = victim["lease"].encode()
                producer_side.sendall(tcp.REQUEST.pack(tcp.OP_GET, len(token)) + token + bytes(tcp.MAC_BYTES))
                seen["answer"] = producer_side.recv(1 << 16)

        thread = threading.Thread(target=relay_main)
        thread.start()
        consumer = make_consumer(cfg)
        with pytest.raises(TransferError):
            run(consumer.get(lure, 4, 16, MODEL))
        thread.join(timeout=20)
        assert seen["auth"] == tcp.AUTH_OK  # the relay got through the handshake...
        assert len(seen["withheld"]) > tcp.REQUEST.size
        assert seen["answer"] == b""  # ...but its own request was dropped unanswered
        assert reads(consumer, victim, sent)
        run(consumer.close())


def test_tcp_requests_cannot_be_replayed_on_a_connection(tmp_path: Path) -> None:
    cfg = config("tcp", tmp_path)
    with TcpProducer(cfg) as producer:
        key = cfg.key(TCP_PURPOSE)
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
        with socket.create_connection(("127.0.0.1", producer.port), timeout=10) as sock:
            sn = recv_exactly(sock, len(tcp.HELLO) + tcp.NONCE_BYTES)[len(tcp.HELLO) :]
            cn = os.urandom(tcp.NONCE_BYTES)
            sock.sendall(cn + tcp.client_proof(key, sn, cn))
            assert recv_exactly(sock, 1 + tcp.MAC_BYTES) == tcp.AUTH_OK + tcp.server_proof(key, sn, cn)
            session = tcp.session_key(key, sn, cn)
            probe = tcp.request_bytes(session, 0, tcp.OP_RELEASE, "cd" * 16)  # an unknown lease
            sock.sendall(probe)
            assert recv_exactly(sock, 1) == bytes([tcp.STATUS_OK])
            sock.sendall(probe)  # the same bytes again
            assert sock.recv(16) == b""
        assert producer.live_handles == 1
        # a request under another connection's session key is refused the same way
        with socket.create_connection(("127.0.0.1", producer.port), timeout=10) as sock:
            sn2 = recv_exactly(sock, len(tcp.HELLO) + tcp.NONCE_BYTES)[len(tcp.HELLO) :]
            cn2 = os.urandom(tcp.NONCE_BYTES)
            sock.sendall(cn2 + tcp.client_proof(key, sn2, cn2))
            recv_exactly(sock, 1 + tcp.MAC_BYTES)
            sock.sendall(tcp.request_bytes(session, 0, tcp.OP_RELEASE, handle["lease"]))
            assert sock.recv(16) == b""
        assert producer.live_handles == 1


def test_tcp_consumer_requires_the_server_to_prove_the_secret(tmp_path: Path) -> None:
    cfg = config("tcp", tmp_path)
    with TcpProducer(cfg) as producer:
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
    fake = socket.create_server(("127.0.0.1", 0))
    fake.settimeout(10)
    seen: dict[str, bytes] = {}

    def fake_main() -> None:
        with closing(fake), fake.accept()[0] as conn:
            conn.settimeout(10)
            conn.sendall(tcp.HELLO + os.urandom(tcp.NONCE_BYTES))
            recv_exactly(conn, tcp.NONCE_BYTES + tcp.MAC_BYTES)
            conn.sendall(tcp.AUTH_OK + os.urandom(tcp.MAC_BYTES))  # claims success, cannot prove it
            seen["after"] = conn.recv(4096)

    thread = threading.Thread(target=fake_main)
    thread.start()
    consumer = make_consumer(cfg)
    with pytest.raises(TransferError, match="could not prove"):
        run(consumer.get(resign(handle, port=fake.getsockname()[1]), 2, 8, MODEL))
    thread.join(timeout=20)
    assert seen["after"] == b""  # the consumer hung up without sending a request
    run(consumer.close())


# --- fs directory ----------------------------------------------------------------------------------


def test_fs_producer_makes_a_private_directory(tmp_path: Path) -> None:
    cfg = config("fs", tmp_path, fs_dir=str(tmp_path / "a" / "fs"))
    with FsProducer(cfg) as producer:
        assert stat.S_IMODE(os.stat(cfg.fs_dir).st_mode) == 0o700
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
        assert lease_path(handle["path"], handle["lease"]).exists()


@pytest.mark.parametrize("flaw", ["group-writable", "other-writable", "other-owner", "symlink"])
def test_fs_directory_that_is_not_private_is_refused(flaw: str, tmp_path: Path) -> None:
    cfg = config("fs", tmp_path)
    fs_dir = Path(cfg.fs_dir)
    with FsProducer(cfg) as producer:
        handle = producer.put("k", embeddings(2, 8, torch.float32), MODEL)
    if flaw == "symlink":
        real = tmp_path / "real"
        fs_dir.rename(real)
        fs_dir.symlink_to(real)
        expected = "symlink"
    elif flaw == "other-owner":
        if os.getuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(fs_dir, 12345, -1)
        expected = "belongs to uid 12345"
    else:
        fs_dir.chmod(0o770 if flaw == "group-writable" else 0o707)
        expected = "writable by group or others"
    with pytest.raises(TransferError, match=expected):
        FsProducer(cfg)
    consumer = make_consumer(cfg)
    with pytest.raises(TransferError, match=expected):
        run(consumer.get(handle, 2, 8, MODEL))
    with pytest.raises(TransferError, match=expected):
        run(consumer.release(handle))
    assert Path(handle["path"]).exists()  # refused, and nothing touched


def test_fs_consumer_never_deletes_on_a_failed_read(tmp_path: Path) -> None:
    cfg = config("fs", tmp_path)
    with FsProducer(cfg) as producer:
        consumer = make_consumer(cfg)
        sent = embeddings(8, 64, torch.float32)
        handle = producer.put("k", sent, MODEL)
        payload = Path(handle["path"])
        with pytest.raises(TransferError, match="placeholders"):
            run(consumer.get(handle, 9, 64, MODEL))
        original = payload.read_bytes()
        payload.write_bytes(original[:-4] + bytes(4))
        with pytest.raises(TransferError, match="corrupted"):
            run(consumer.get(handle, 8, 64, MODEL))
        assert payload.exists() and lease_path(payload, handle["lease"]).exists()
        payload.write_bytes(original)
        assert reads(consumer, handle, sent)
        # a release names only its own lease: another lease keeps the payload
        other = producer.put("k", sent, MODEL)
        run(consumer.release(handle))
        producer.put("unrelated", sent, MODEL)  # sweeps
        assert payload.exists() and reads(consumer, other, sent)
        run(consumer.release(other))
        producer.put("unrelated", sent, MODEL)
        assert not payload.exists()


# --- slab sizing -----------------------------------------------------------------------------------


def fake_statvfs(free: int) -> Any:
    def statvfs(path: str) -> os.statvfs_result:
        return os.statvfs_result((4096, 1, free, free, free, 0, 0, 0, 0, 255))

    return statvfs


@pytest.mark.parametrize(
    ("free", "expected"),
    [(1 << 40, 256 << 20), (64 << 20, 32 << 20), (10_000_003, 5_000_000 // 64 * 64), (1_500_000, 1 << 20)],
)
def test_shm_slab_size_follows_free_space(
    free: int, expected: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "statvfs", fake_statvfs(free))
    cfg = config("shm", tmp_path, shm_bytes=0)
    assert shm_slab.slab_bytes(cfg) == expected
    if expected <= 32 << 20:
        with ShmProducer(cfg) as producer:
            assert producer.capacity_bytes == producer.path.stat().st_size == expected


def test_shm_slab_that_cannot_fit_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "statvfs", fake_statvfs(900_000))
    with pytest.raises(TransferError, match="--shm-size") as err:
        ShmProducer(config("shm", tmp_path, shm_bytes=0))
    assert "--ec-shm-bytes" in str(err.value)
    monkeypatch.setattr(os, "statvfs", fake_statvfs(64 << 20))
    with pytest.raises(TransferError, match="--ec-shm-bytes 134217728 does not fit") as err:
        ShmProducer(config("shm", tmp_path, shm_bytes=128 << 20))
    assert "--shm-size" in str(err.value)
    assert not list((tmp_path / "shm").iterdir())
    assert shm_slab.slab_bytes(config("shm", tmp_path, shm_bytes=(32 << 20) + 5)) == 32 << 20


def test_handles_carry_lease_lifetime_and_signature(pair: tuple[ECProducer, RoutingConsumer]) -> None:
    producer, _ = pair
    before = time.time()
    handle = producer.put("k", embeddings(1, 8, torch.float32), MODEL)
    assert before <= handle["issued_at"] <= time.time()
    assert handle["expires_at"] == pytest.approx(handle["issued_at"] + 120.0)
    assert len(bytes.fromhex(handle["lease"])) >= 16 and len(bytes.fromhex(handle["mac"])) == 32
    assert signing.verify(handle, KEY) is handle
    assert SECRET not in str(handle)
