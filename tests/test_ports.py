"""How ``free_port`` picks the ports that roles bind only once their models have loaded."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from epdserve import launcher
from epdserve.launcher import FIXED_PORT_CEILING, FIXED_PORT_FLOOR, ephemeral_ports, free_port


def test_ports_are_picked_below_the_kernel_s_ephemeral_range() -> None:
    """Below the range no outgoing connection gets the port as its local end while a role loads."""
    ephemeral = ephemeral_ports()
    ports = {free_port() for _ in range(50)}
    assert all(FIXED_PORT_FLOOR <= p < min(ephemeral.start, FIXED_PORT_CEILING) for p in ports), sorted(ports)
    assert len(ports) > 40  # picked at random, not the same one each time
    with socket.socket() as s:  # and it is free: a server can listen there
        s.bind(("127.0.0.1", ports.pop()))
        s.listen()


def test_ipv6_hosts_get_a_port_too() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        port = free_port("[::1]")
    except OSError:
        pytest.skip("::1 is not configured here")
    assert FIXED_PORT_FLOOR <= port < ephemeral_ports().start


def test_a_busy_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """The random pick lands on a port with a listener: the next pick is taken instead."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        picks = iter([taken, taken])
        monkeypatch.setattr(launcher, "ephemeral_ports", lambda: range(65535, 65536))
        monkeypatch.setattr(launcher, "FIXED_PORT_FLOOR", 1024)

        class Scripted(random.Random):
            def randrange(self, *args: int) -> int:  # type: ignore[override]
                return next(picks, None) or super().randrange(*args)

        port = free_port(rng=Scripted())
    assert port != taken


def test_the_kernel_picks_when_there_is_no_room_below_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "ephemeral_ports", lambda: range(FIXED_PORT_FLOOR - 100, 65000))
    port = free_port()
    assert 0 < port < 65536


def test_an_unreadable_range_is_linux_s_default(tmp_path: Path) -> None:
    assert ephemeral_ports(tmp_path / "missing") == range(32768, 61000)
    (tmp_path / "range").write_text("40000\t50000\n")
    assert ephemeral_ports(tmp_path / "range") == range(40000, 50001)
    (tmp_path / "bad").write_text("garbage")
    assert ephemeral_ports(tmp_path / "bad") == range(32768, 61000)
