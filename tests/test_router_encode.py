"""The router's encoder calls against scripted encoders on real sockets: what it sends (signed,
with the request id), kept-alive connections, and what each kind of answer does: a busy or broken
encoder's items go to another, a garbled answer is not trusted, a slow one times the request out,
and leases go back to the encoder that issued them."""

from __future__ import annotations

import asyncio
import json
import logging

import msgspec
import pytest

from epdserve.api.auth import AuthConfig
from epdserve.api.errors import Overloaded, Timeout, WorkerFailed
from epdserve.api.metrics import Metrics
from epdserve.api.protocol import ChatRequest
from epdserve.api.tracing import Tracing
from epdserve.encoder.protocol import EncodedItem, EncodeResponse, encode_response
from epdserve.launcher import free_port
from epdserve.router.config import RouterConfig
from epdserve.router.encode import Encodes
from epdserve.router.metrics import RouterMetrics
from epdserve.router.refs import MediaRef
from epdserve.router.workers import MAX_CALL_ANSWER_BYTES, WorkerPools
from epdserve.security.credentials import ClusterCredential
from epdserve.security.peers import PEER_HEADER, PeerVerifier
from tests.scripted_http import Reply, Server, answer

IMAGE = "data:image/png;base64,AAAA"


def item(n: int) -> EncodedItem:
    return EncodedItem(uuid=f"u{n}", modality="image", grid_thw=(1, 2, 2), num_embeddings=1, dtype="float32",
                       shape=(1, 8), ec_handle={"lease": n}, status="computed")  # fmt: skip


def encoded(count: int = 1) -> bytes:
    return encode_response(EncodeResponse(items=[item(n) for n in range(count)]))


def replies(status: int, *bodies: bytes) -> Reply:
    """Answers ``status`` with the n-th body to the n-th request (the last one from then on)."""

    async def reply(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
        writer.write(answer(status, bodies[min(n, len(bodies)) - 1], "Content-Type: application/json"))
        await writer.drain()
        return True

    return reply


def encodes_for(*urls: str) -> tuple[Encodes, RouterMetrics, ClusterCredential]:
    cluster = ClusterCredential.generate()
    config = RouterConfig(  # round robin: each encoder is tried first in turn
        encoders=urls, encoder_policy="round_robin", auth=AuthConfig(cluster=cluster), encode_timeout_s=1.0
    )
    metrics = RouterMetrics.create(Metrics())
    workers = WorkerPools(config, metrics.registry)
    return Encodes(config, metrics, workers, Tracing("test", "")), metrics, cluster


def counted(metrics: RouterMetrics, name: str) -> float:
    return metrics.registry.registry.get_sample_value(f"epd_{name}") or 0.0


def verified(cluster: ClusterCredential, url: str, path: str, headers: dict[str, str], body: bytes) -> bool:
    """The request carried a valid proof of the cluster credential, addressed to ``url``'s server."""
    host, port = url.removeprefix("http://").split(":")
    PeerVerifier(cluster).verify(headers.get(PEER_HEADER.lower()), "POST", path, body, (host, int(port)))
    return True


def refs(count: int = 1) -> list[MediaRef]:
    return [MediaRef(message=0, part=n, modality="image", url=IMAGE) for n in range(count)]


def test_items_are_encoded_by_a_signed_call_on_one_kept_connection() -> None:
    async def run() -> None:
        server = Server(replies(200, encoded(2)))
        async with server as url:
            encodes, _, cluster = encodes_for(url)
            for rid in ("req-1", "req-2"):
                rs = refs(2)
                await encodes.encode("m", rs, rid=rid)
                assert [r.result.ec_handle for r in rs if r.result] == [{"lease": 0}, {"lease": 1}]
                assert all(r.encoder == url for r in rs)
            encodes.workers.http.close()
        assert server.connections == 1  # the second call reused the first's connection
        for (line, headers, body), rid in zip(server.requests, ("req-1", "req-2"), strict=True):
            assert line == "POST /v1/encode HTTP/1.1" and headers["x-request-id"] == rid
            sent = json.loads(body)
            assert [i["url"] for i in sent["items"]] == [IMAGE, IMAGE] and sent["model"] == "m"
            assert verified(cluster, url, "/v1/encode", headers, body)

    asyncio.run(run())


@pytest.mark.parametrize(
    ("first", "healthy_after", "retried"),
    [
        ((429, b'{"error": "busy"}'), True, 1),  # busy: kept healthy
        ((500, b'{"error": "oops"}'), True, 1),  # it answered: its probe judges it
        ((403, b'{"error": "no"}'), False, 1),  # does not know the credential: misconfigured
        ((200, b'{"items": "nonsense"}'), True, 1),  # not an encode answer: not trusted
        ((200, b"\x00garbage"), True, 1),
        ((200, b" " * (MAX_CALL_ANSWER_BYTES + 1)), False, 1),  # an answer past any encoder's: broken
    ],
)
def test_a_failed_call_s_items_go_to_the_other_encoder(
    first: tuple[int, bytes], healthy_after: bool, retried: int
) -> None:
    async def run() -> None:
        bad, good = Server(replies(*first)), Server(replies(200, encoded()))
        async with bad as bad_url, good as good_url:
            encodes, metrics, _ = encodes_for(bad_url, good_url)
            for _ in range(2):  # whichever is tried first, the item ends on the good one
                rs = refs()
                await encodes.encode("m", rs)
                assert rs[0].encoder == good_url and rs[0].result is not None
            encodes.workers.http.close()
            assert encodes.workers.encoders.workers[bad_url].healthy is healthy_after
        assert len(bad.requests) >= retried
        assert counted(metrics, "router_encoder_retries_total") >= retried

    asyncio.run(run())


def test_every_encoder_busy_is_overloaded_and_every_one_broken_fails_the_request() -> None:
    async def run() -> None:
        busy = Server(replies(429, b"{}"))
        async with busy as url:
            encodes, _, _ = encodes_for(url)
            with pytest.raises(Overloaded):
                await encodes.encode("m", refs())
        broken = Server(replies(502, b"{}"))
        async with broken as url:
            encodes, _, _ = encodes_for(url)
            with pytest.raises(WorkerFailed):
                await encodes.encode("m", refs())

    asyncio.run(run())


def test_an_encoder_that_cannot_be_reached_is_marked_failed() -> None:
    async def run() -> None:
        good = Server(replies(200, encoded()))
        async with good as good_url:
            dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
            encodes, _, _ = encodes_for(dead, good_url)
            for _ in range(2):
                rs = refs()
                await encodes.encode("m", rs)
                assert rs[0].encoder == good_url
            assert not encodes.workers.encoders.workers[dead].healthy
            encodes.workers.http.close()

    asyncio.run(run())


def test_an_encoder_past_the_timeout_times_the_request_out() -> None:
    async def run() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            await reader.read()  # never answers
            return False

        server = Server(silent)
        async with server as url:
            encodes, _, _ = encodes_for(url)
            with pytest.raises(Timeout):
                await encodes.encode("m", refs())
            assert encodes.workers.encoders.workers[url].outstanding == 0
            assert encodes.workers.encoders.workers[url].healthy

    asyncio.run(run())


def test_more_items_or_leases_than_asked_are_given_back() -> None:
    async def run() -> None:
        server = Server(replies(200, encoded(3), b'{"released": 3}'))  # 3 items for 1 asked, then the release
        async with server as url:
            encodes, metrics, cluster = encodes_for(url)
            with pytest.raises(WorkerFailed):
                await encodes.encode("m", refs())
            await encodes.drain()
            encodes.workers.http.close()
        line, headers, body = server.requests[1]
        assert line == "POST /v1/release HTTP/1.1"
        assert msgspec.json.decode(body)["handles"] == [{"lease": 0}, {"lease": 1}, {"lease": 2}]
        assert verified(cluster, url, "/v1/release", headers, body)
        assert counted(metrics, "router_leases_released_total") == 3

    asyncio.run(run())


def test_a_refused_release_is_logged_and_not_counted(caplog: pytest.LogCaptureFixture) -> None:
    async def run() -> None:
        server = Server(replies(401, b'{"error": "who"}'))
        async with server as url:
            encodes, metrics, _ = encodes_for(url)
            with caplog.at_level(logging.WARNING):
                encodes.release({url: [{"lease": 1}]})
                encodes.release({f"http://127.0.0.1:{free_port()}": [{"lease": 2}]})  # unreachable
                await encodes.drain()
            encodes.workers.http.close()
        assert counted(metrics, "router_leases_released_total") == 0
        assert "refused to release 1 leases (HTTP 401" in caplog.text
        assert "could not release 1 leases" in caplog.text

    asyncio.run(run())


def test_a_client_that_leaves_closes_the_call_to_its_encoder() -> None:
    """The encode of a request whose client left is not left to run: the call is closed at once (its
    encoder then drops the items it still queues), not when the encoder answers."""

    async def run() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> bool:
            await reader.read()  # answers nothing until the caller closes
            server.closed_by_client.set()
            return False

        server = Server(silent)
        async with server as url:
            config = RouterConfig(encoders=(url,), auth=AuthConfig(cluster=ClusterCredential.generate()))
            metrics = RouterMetrics.create(Metrics())
            encodes = Encodes(config, metrics, WorkerPools(config, metrics.registry), Tracing("test", ""))
            req = msgspec.json.decode(
                b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', type=ChatRequest
            )
            handler = asyncio.ensure_future(encodes.encode_for(req, refs()))
            while not server.requests:
                await asyncio.sleep(0.01)
            handler.cancel()  # the client left
            await asyncio.wait_for(server.closed_by_client.wait(), 5)  # the timeout is far later
            assert config.encode_timeout_s > 30
            await encodes.drain()
            encodes.workers.http.close()

    asyncio.run(run())
