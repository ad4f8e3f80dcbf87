"""Workers that register themselves (heartbeats, eviction) and workers found through DNS."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from epdserve.api.registration import RegistrationConfig, is_wildcard
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.router.discovery import DiscoveryError, DnsSource, Leases, is_worker_url, split_sources
from tests.server_utils import http, running

ADMIN_KEY = "admin-key-for-discovery-tests"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


def test_dns_sources_parse_and_plain_urls_pass_through() -> None:
    urls, sources = split_sources(("http://10.0.0.1:8001", "dns+http://enc.ns.svc:8001", "dns+https://e:9"))
    assert urls == ["http://10.0.0.1:8001"]
    assert sources == [DnsSource("http", "enc.ns.svc", 8001), DnsSource("https", "e", 9)]
    assert str(sources[0]) == "dns+http://enc.ns.svc:8001"
    for bad in ("dns+http://enc", "dns+http://enc:80/path", "dns+http://:80", "dns+http://e:80?x=1"):
        with pytest.raises(DiscoveryError):
            DnsSource.parse(bad)


def test_a_name_stands_for_every_address_it_resolves_to() -> None:
    async def main() -> None:
        assert "http://127.0.0.1:8123" in await DnsSource("http", "localhost", 8123).resolve()
        assert await DnsSource("http", "no-such-host.invalid", 1).resolve() == set()

    asyncio.run(main())


def test_worker_urls_are_bare_base_urls() -> None:
    assert is_worker_url("http://10.1.2.3:8000") and is_worker_url("https://pd-0.pd:8002/")
    for bad in ("ftp://x:1", "http://user:pw@x:1", "http://x:1/v1", "http://x:1?a", "http://:1", "http://x:99999"):
        assert not is_worker_url(bad), bad


def test_leases_lapse_unless_renewed() -> None:
    leases = Leases()
    leases.renew("encoder", "http://a:1", ttl_s=3, now=0)
    leases.renew("pd", "http://b:1", ttl_s=3, now=0)
    leases.renew("encoder", "http://a:1", ttl_s=3, now=2)
    assert leases.expired(now=4) == [("pd", "http://b:1")]
    assert leases.held("encoder", "http://a:1") and not leases.held("pd", "http://b:1")
    leases.drop("encoder", "http://a:1")
    assert leases.expired(now=100) == []


def test_registration_config_needs_an_address_peers_can_dial() -> None:
    assert is_wildcard("0.0.0.0") and is_wildcard("::") and not is_wildcard("10.0.0.1") and not is_wildcard("pd")
    reg = RegistrationConfig(register_with="http://router:8000", admin_key="k")
    with pytest.raises(ValueError, match="advertise-host"):
        reg.advertised("0.0.0.0")
    assert RegistrationConfig(advertise_host="10.0.0.7").advertised("0.0.0.0") == "10.0.0.7"
    assert RegistrationConfig().advertised("0.0.0.0") == "0.0.0.0"  # not registering: nobody dials it by name
    with pytest.raises(ValueError, match="admin key"):
        RegistrationConfig(register_with="http://router:8000")
    with pytest.raises(ValueError, match="http"):
        RegistrationConfig(register_with="router:8000", admin_key="k")


def workers(url: str, role: str) -> dict[str, bool]:
    status, body = http("GET", url + "/v1/workers", headers=ADMIN)
    assert status == 200, body
    return {w["url"]: w["healthy"] for w in json.loads(body)[role]}


def wait_for(predicate, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_workers_register_renew_and_leave_and_silent_ones_are_evicted() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    static = "http://127.0.0.1:12"  # a PD worker from the command line
    args = ["router", "--port", str(port), "--probe-interval", "0.2", "--pds", static]
    router = start_role(args, env={"EPD_ADMIN_KEY": ADMIN_KEY})
    try:
        wait_for(lambda: _answers(url))
        # an encoder registers itself as soon as it listens, and deregisters when it stops
        enc_port = free_port()
        enc_url = f"http://127.0.0.1:{enc_port}"
        encoder = start_role(
            ["encoder", "--port", str(enc_port), "--register-with", url, "--heartbeat-s", "0.5"],
            env={"EPD_ADMIN_KEY": ADMIN_KEY},
        )
        try:
            wait_healthy(enc_url, encoder)
            wait_for(lambda: workers(url, "encoders") == {enc_url: True})
            time.sleep(2.0)  # several leases' worth of time: its heartbeats keep it
            assert workers(url, "encoders") == {enc_url: True}
        finally:
            stop(encoder)
        wait_for(lambda: workers(url, "encoders") == {})
        # a registration whose heartbeats stop (a worker killed, a partition) lapses
        with running(["encoder"]) as silent:
            body = json.dumps({"role": "encoder", "url": silent, "heartbeat_s": 0.3}).encode()
            assert http("POST", url + "/v1/workers", body, headers=ADMIN)[0] == 200
            assert silent in workers(url, "encoders")
            wait_for(lambda: silent not in workers(url, "encoders"), timeout=10)
            # registered by hand (no heartbeat): it stays until removed
            body = json.dumps({"role": "encoder", "url": silent}).encode()
            assert http("POST", url + "/v1/workers", body, headers=ADMIN)[0] == 200
            time.sleep(1.5)
            assert silent in workers(url, "encoders")
        # an address where nothing holds the cluster credential is not registered
        body = json.dumps({"role": "pd", "url": "http://127.0.0.1:9"}).encode()
        status, raw = http("POST", url + "/v1/workers", body, headers=ADMIN)
        assert status == 403 and b"credential challenge" in raw, raw
        assert "http://127.0.0.1:9" not in workers(url, "pds")
        # what a registration may say is checked
        for bad in (
            {"role": "pd", "url": "http://127.0.0.1:11/v1"},
            {"role": "pd", "url": "http://u:p@127.0.0.1:11"},
            {"role": "pd", "url": "http://127.0.0.1:11", "heartbeat_s": 0},
            {"role": "pd", "url": "http://127.0.0.1:11", "heartbeat_s": "5"},
            {"role": "pd", "url": "http://127.0.0.1:11", "heartbeat_s": 1e9},
        ):
            status, raw = http("POST", url + "/v1/workers", json.dumps(bad).encode(), headers=ADMIN)
            assert status == 400, (bad, raw)
        assert "http://127.0.0.1:11" not in workers(url, "pds")
        # a worker deregistering does not take the command line's entry for its URL with it; the
        # admin's removal does
        leaving = json.dumps({"role": "pd", "url": static, "heartbeat_s": 1}).encode()
        assert json.loads(http("DELETE", url + "/v1/workers", leaving, headers=ADMIN)[1]) == {"removed": False}
        assert static in workers(url, "pds")
        removal = json.dumps({"role": "pd", "url": static}).encode()
        assert json.loads(http("DELETE", url + "/v1/workers", removal, headers=ADMIN)[1]) == {"removed": True}
        assert static not in workers(url, "pds")
    finally:
        stop(router)


def _answers(url: str) -> bool:
    try:
        return http("GET", url + "/v1/workers", headers=ADMIN)[0] == 200
    except OSError:
        return False


def test_the_router_finds_workers_by_dns_name() -> None:
    with running(["serve", "--max-model-len", "512", "--num-kv-blocks", "64"]) as pd:
        pd_port = pd.rsplit(":", 1)[1]
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        router = start_role(
            ["router", "--port", str(port), "--pds", f"dns+http://localhost:{pd_port}", "--dns-interval-s", "0.5"],
            env={"EPD_ADMIN_KEY": ADMIN_KEY},
        )
        try:
            wait_healthy(url, router)
            assert f"http://127.0.0.1:{pd_port}" in workers(url, "pds")
            body = {"model": "shapes-qwen2vl", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            assert http("POST", url + "/v1/chat/completions", json.dumps(body).encode())[0] == 200
        finally:
            stop(router)
    with pytest.raises(SystemExit):
        from epdserve import cli

        cli.router_config(cli.build_parser(only="router").parse_args(["router", "--pds", "dns+http://nameonly"]))
