"""Internal credentials as an attacker would try them: requests captured by one peer replayed to
another (or again, or late), workers registered at addresses they should not be, a process without
the cluster secret registered with the admin key, and one prompt's KV continued as another's.

Real processes on loopback (a router, encoder, PD, prefill and decode workers) and, as the
attacker, small real HTTP servers in this process."""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from subprocess import Popen

import pytest

from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.router.membership import WorkerNetworks
from epdserve.security import peers
from epdserve.security.credentials import ClusterCredential
from tests.server_utils import http, signed_headers

ADMIN_KEY = "admin-0123456789abcdef"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
MODEL = "shapes-qwen2vl"
LM_ARGS = ["--max-model-len", "512", "--num-kv-blocks", "64"]


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class Spy:
    """A little HTTP server posing as a worker: it records everything it is sent. With
    ``cluster`` it holds the secret (a compromised worker host) and answers the admission
    challenge; without, it tries a made-up answer."""

    cluster: ClusterCredential | None = None
    seen: list[Seen] = field(default_factory=list)
    url: str = ""

    def serve(self) -> ThreadingHTTPServer:
        spy = self
        verifier = peers.PeerVerifier(self.cluster) if self.cluster is not None else None

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, status: int, body: dict) -> None:
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def _handle(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                spy.seen.append(Seen(self.command, self.path, dict(self.headers), body))
                if self.path == "/health":
                    self._answer(200, {"status": "ok"})
                elif self.path == "/v1/attest":
                    info = json.loads(body)
                    proof = "0" * 64
                    if verifier is not None:
                        proof = verifier.attest(info["target"], info["nonce"], self.connection.getsockname())
                    self._answer(200, {"proof": proof})
                else:  # whatever it is, the spy keeps it and fails: the router retries elsewhere
                    self._answer(503, {"error": {"message": "spy", "type": "server_error"}})

            do_GET = do_POST = do_DELETE = _handle

            def log_message(self, *args: object) -> None:
                pass

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        threading.Thread(target=server.serve_forever, daemon=True).start()
        return server


@contextmanager
def spying(cluster: ClusterCredential | None) -> Iterator[Spy]:
    spy = Spy(cluster)
    server = spy.serve()
    try:
        yield spy
    finally:
        server.shutdown()
        server.server_close()


@dataclass
class Deployment:
    router: str
    encoder: str
    pd: str
    prefill: str
    decode: str


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    ports = [free_port() for _ in range(5)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs: list[Popen] = []
    try:
        for args, url in (
            (["encoder"], urls[1]),
            (["serve", *LM_ARGS, "--internal-only"], urls[2]),
            (["serve", *LM_ARGS, "--internal-only", "--role", "prefill"], urls[3]),
            (["serve", *LM_ARGS, "--internal-only", "--role", "decode"], urls[4]),
        ):
            procs.append(start_role([*args, "--port", url.rsplit(":", 1)[1]]))
        for proc, url in zip(procs, urls[1:], strict=True):
            wait_healthy(url, proc)
        router = ["router", "--port", str(ports[0]), "--encoders", urls[1], "--pds", urls[2], "--probe-interval", "0.3"]
        procs.append(start_role(router, env={"EPD_ADMIN_KEY": ADMIN_KEY}))
        wait_healthy(urls[0], procs[-1])
        yield Deployment(*urls)
    finally:
        for p in reversed(procs):
            stop(p)


def chat(text: str, **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, **extra}


def register(d: Deployment, role: str, url: str) -> tuple[int, dict]:
    status, raw = http("POST", d.router + "/v1/workers", json.dumps({"role": role, "url": url}).encode(), headers=ADMIN)
    return status, json.loads(raw)


def workers(d: Deployment) -> dict[str, list[str]]:
    status, raw = http("GET", d.router + "/v1/workers", headers=ADMIN)
    assert status == 200
    return {role: [w["url"] for w in ws] for role, ws in json.loads(raw).items()}


def replay(seen: Seen, base: str) -> tuple[int, dict]:
    """``seen`` sent again, byte for byte, to the worker at ``base``."""
    keep = {k: v for k, v in seen.headers.items() if k.lower() not in ("host", "content-length")}
    status, raw = http(seen.method, base + seen.path, seen.body or None, headers=keep)
    return status, json.loads(raw) if raw else {}


# ---------------------------------------------------------------------------- per-request proofs


def test_a_request_captured_by_one_worker_is_refused_by_another(deployment: Deployment) -> None:
    """A worker that holds the secret (a compromised host) and joined legitimately captures the
    router's requests to it: none of them works on any other worker."""
    cluster = ClusterCredential.load()
    with spying(cluster) as spy:
        status, out = register(deployment, "pd", spy.url)
        assert status == 200, out
        for i in range(6):  # some land on the spy (it answers 503: that client sees the failure)
            http("POST", deployment.router + "/v1/chat/completions", json.dumps(chat(f"hi {i}")).encode())
            if any(s.path == "/v1/chat/completions" for s in spy.seen):
                break
        captured = [s for s in spy.seen if peers.PEER_HEADER in s.headers]
        assert any(s.path == "/v1/chat/completions" for s in captured), [s.path for s in spy.seen]
        for s in captured:
            for victim in (deployment.pd, deployment.decode):
                status, err = replay(s, victim)
                assert status == 403 and "addressed to" in err["error"]["message"], (s.path, victim, err)
        # nothing the spy saw carries a reusable secret: no bearer token, no static header
        assert not any("authorization" in {k.lower() for k in s.headers} for s in spy.seen)
        http(
            "DELETE",
            deployment.router + "/v1/workers",
            json.dumps({"role": "pd", "url": spy.url}).encode(),
            headers=ADMIN,
        )


def test_a_proof_works_once_and_only_within_its_window(deployment: Deployment) -> None:
    url = deployment.pd + "/v1/chat/completions"
    body = json.dumps(chat("once")).encode()
    headers = signed_headers("POST", url, body)
    assert http("POST", url, body, headers=headers)[0] == 200
    status, raw = http("POST", url, body, headers=headers)  # the same request again
    assert status == 401 and b"used before" in raw, raw
    # late (or early): a request signed outside the window
    for skew in (-2 * peers.WINDOW_S, 2 * peers.WINDOW_S):
        late = signed_headers("POST", url, body, now=time.time() + skew)
        status, raw = http("POST", url, body, headers=late)
        assert status == 401 and b"expired" in raw, raw
    # bound to the body and the path: another body or path under the same proof fails
    fresh = signed_headers("POST", url, body)
    status, raw = http("POST", url, json.dumps(chat("other")).encode(), headers=fresh)
    assert status == 401 and b"does not verify" in raw, raw
    fresh = signed_headers("GET", deployment.pd + "/v1/kv/digest")
    assert http("GET", deployment.pd + "/v1/load", headers=fresh)[0] == 401
    assert http("GET", deployment.pd + "/v1/kv/digest", headers=fresh)[0] == 200
    # the worker keeps serving the router
    assert http("POST", deployment.router + "/v1/chat/completions", json.dumps(chat("still")).encode())[0] == 200


# ---------------------------------------------------------------------------- who may join


def test_registration_refuses_addresses_outside_the_worker_networks(deployment: Deployment) -> None:
    for url in (
        "http://169.254.169.254:80",  # cloud metadata
        "http://169.254.10.1:8000",  # link-local
        "http://[fe80::1]:8000",
        "http://[fd00:ec2::254]:80",
        "http://100.100.100.200:80",
        "http://10.11.12.13:8000",  # not the deployment's (the router listens on loopback)
    ):
        status, err = register(deployment, "pd", url)
        assert status == 403 and "not registered" in err["error"]["message"], (url, err)
        assert url not in workers(deployment)["pds"]
    # the networks the operator names, never the link-local ones within them
    nets = WorkerNetworks.of(("0.0.0.0/0", "::/0"), "0.0.0.0")
    assert nets.allows(ipaddress.ip_address("10.1.2.3"))
    for ip in ("169.254.169.254", "fe80::1", "fd00:ec2::254", "100.100.100.200", "::ffff:169.254.169.254"):
        assert not nets.allows(ipaddress.ip_address(ip)), ip
    assert WorkerNetworks.of((), "127.0.0.1").networks == WorkerNetworks.of(("127.0.0.0/8", "::1/128"), "x").networks


def test_a_process_without_the_secret_gets_nothing(deployment: Deployment) -> None:
    for role in ("pd", "encoder"):
        with spying(None) as spy:
            status, err = register(deployment, role, spy.url)
            assert status == 403 and "credential challenge" in err["error"]["message"], err
            assert spy.url not in workers(deployment)[f"{role}s"]
            for i in range(3):
                assert (
                    http("POST", deployment.router + "/v1/chat/completions", json.dumps(chat(f"x {i}")).encode())[0]
                    == 200
                )
            # all it ever got is the challenge: a nonce and its own address, nothing that authenticates
            assert [(s.method, s.path) for s in spy.seen] == [("POST", "/v1/attest")]
            (seen,) = spy.seen
            assert set(json.loads(seen.body)) == {"nonce", "target"}
            assert not {k.lower() for k in seen.headers} & {peers.PEER_HEADER.lower(), "authorization"}


def test_a_dns_record_pointing_at_a_process_without_the_secret_brings_it_nothing() -> None:
    with spying(None) as spy:
        port = free_port()
        router_url = f"http://127.0.0.1:{port}"
        args = ["router", "--port", str(port), "--pds", f"dns+http://localhost:{spy.url.rsplit(':', 1)[1]}"]
        router = start_role(
            [*args, "--dns-interval-s", "0.2", "--probe-interval", "0.2"], env={"EPD_ADMIN_KEY": ADMIN_KEY}
        )
        try:
            deadline = time.monotonic() + 30
            while sum(s.path == "/v1/attest" for s in spy.seen) < 3:  # asked again at every resolution
                assert time.monotonic() < deadline, [s.path for s in spy.seen]
                time.sleep(0.1)
            status, raw = http("GET", router_url + "/v1/workers", headers=ADMIN)
            assert status == 200 and json.loads(raw)["pds"] == []
            assert http("GET", router_url + "/health")[0] == 503
        finally:
            stop(router)
        assert {s.path for s in spy.seen} == {"/v1/attest"}
        assert not any({k.lower() for k in s.headers} & {peers.PEER_HEADER.lower(), "authorization"} for s in spy.seen)


def test_a_challenge_relayed_to_a_real_worker_is_not_answered(deployment: Deployment) -> None:
    """A process without the secret cannot borrow a real worker's answer for its own address."""
    body = json.dumps({"nonce": peers.challenge(), "target": "127.0.0.1:9"}).encode()
    status, raw = http("POST", deployment.pd + "/v1/attest", body)
    assert status == 403 and b"not this instance" in raw, raw


# ---------------------------------------------------------------------------- KV bound to its prompt


def test_a_kv_handle_continues_only_its_own_prompt(deployment: Deployment) -> None:
    def prefill(text: str) -> tuple[dict, int]:
        url = deployment.prefill + "/v1/chat/completions"
        body = json.dumps(chat(text, kv_transfer_params={"do_remote_decode": True})).encode()
        status, raw = http("POST", url, body, headers=signed_headers("POST", url, body))
        assert status == 200, raw
        answer = json.loads(raw)
        kv = answer["kv_transfer_params"]
        assert kv and kv["kv_handle"], raw
        return kv, answer["usage"]["prompt_tokens"]

    def decode(text: str, kv: dict) -> tuple[int, dict]:
        url = deployment.decode + "/v1/chat/completions"
        body = json.dumps(chat(text, kv_transfer_params=kv)).encode()
        status, raw = http("POST", url, body, headers=signed_headers("POST", url, body))
        return status, json.loads(raw)

    a = "The cat sat on a mat."
    kv_a, length_a = prefill(a)
    # another prompt of the same length (token count): only its content tells them apart
    b = next(
        b
        for b in ("The cat sat on a hat.", "The cat sat on a map.", "The hat sat on a cat.")
        if prefill(b)[1] == length_a
    )
    status, err = decode(b, kv_a)  # same length (same token count), another prompt
    assert status == 400 and "another prompt" in err["error"]["message"], err
    status, out = decode(a, prefill(a)[0])  # its own prompt: continued
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] is not None


# ---------------------------------------------------------------------------- the scheme itself


def test_a_proof_verifies_only_for_its_target_request_and_time() -> None:
    cluster = ClusterCredential.generate()
    v = peers.PeerVerifier(cluster, names=("worker-0.ns",))
    sock = ("10.0.0.5", 8001)
    body = b'{"x": 1}'

    def check(url: str, method: str = "POST", path: str = "/v1/encode", data: bytes = body, **kw: float) -> None:
        header = peers.sign(cluster, "POST", url, body, **kw)[peers.PEER_HEADER]
        v.verify(header, method, path, data, sock)

    check("http://10.0.0.5:8001/v1/encode")
    check("http://Worker-0.NS:8001/v1/encode")  # its advertised name, on its port
    for url in ("http://10.0.0.6:8001/v1/encode", "http://10.0.0.5:8002/v1/encode", "http://evil:8001/v1/encode"):
        with pytest.raises(peers.WrongPeer):
            check(url)
    with pytest.raises(peers.PeerAuthError, match="does not verify"):
        check("http://10.0.0.5:8001/v1/encode", path="/v1/release")
    with pytest.raises(peers.PeerAuthError, match="does not verify"):
        check("http://10.0.0.5:8001/v1/encode", method="GET")
    with pytest.raises(peers.PeerAuthError, match="does not verify"):
        check("http://10.0.0.5:8001/v1/encode", data=b'{"x": 2}')
    with pytest.raises(peers.PeerAuthError, match="expired"):
        check("http://10.0.0.5:8001/v1/encode", now=time.time() - peers.WINDOW_S - 5)
    other = peers.sign(ClusterCredential.generate(), "POST", "http://10.0.0.5:8001/v1/encode", body)
    with pytest.raises(peers.PeerAuthError, match="does not verify"):
        v.verify(other[peers.PEER_HEADER], "POST", "/v1/encode", body, sock)
    for garbage in ("", "v2 x", "v1 target=a ts=1", "v1 target=a ts=x nonce=00 mac=00", "v1 " + "a" * 600):
        with pytest.raises(peers.PeerAuthError):
            v.verify(garbage, "POST", "/v1/encode", body, sock)


def test_the_replay_cache_is_bounded_and_forgets_only_expired_nonces() -> None:
    cache = peers.ReplayCache(capacity=3)
    assert all(cache.first_use(n, until=100.0, now=0.0) for n in "abc")
    assert not cache.first_use("a", until=100.0, now=1.0)  # a replay
    assert not cache.first_use("d", until=100.0, now=1.0)  # full of live nonces: refused, not evicted
    assert not cache.first_use("b", until=100.0, now=2.0)
    assert cache.first_use("d", until=300.0, now=101.0)  # a, b, c expired with their window
    assert not cache.first_use("d", until=300.0, now=102.0)


def test_the_prompt_digest_tells_prompts_and_media_apart() -> None:
    from epdserve.transfer.kv import prompt_digest

    base = prompt_digest([1, 2, 3, 4], [("img-a", 1, 2)])
    assert base == prompt_digest([1, 2, 3, 4], [("img-a", 1, 2)])
    assert base != prompt_digest([1, 2, 3, 5], [("img-a", 1, 2)])
    assert base != prompt_digest([1, 2, 3, 4], [("img-b", 1, 2)])  # same placeholders, another image
    assert base != prompt_digest([1, 2, 3, 4], [("img-a", 0, 2)])
