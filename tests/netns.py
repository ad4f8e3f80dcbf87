"""Network namespaces as separate hosts, for multi-host tests.

``Hosts`` makes one namespace per host name, each with one veth end on a bridge in this
(root) namespace, addresses from 198.18.0.0/15 (reserved for network testing; nothing is routed
out), and an ``/etc/hosts`` of its own (``ip netns exec`` mounts ``/etc/netns/<ns>/hosts``), so
names resolve through the real resolver. The test process reaches every host through the bridge.
Everything it made is removed on exit, whatever happened; processes started with ``start`` are
stopped first.

    with Hosts(["router", "encoder0", "pd0"]) as net:
        p = net.start("pd0", ["serve", "--host", net.addr("pd0"), ...])
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

from epdserve.launcher import stop

SUBNET = "198.18.{}.{}"  # the test range; one /24 per Hosts
BRIDGE_HOST = 254  # the root namespace's address on the bridge


class NamespacesUnavailable(RuntimeError):
    """This machine cannot make network namespaces (not root, no ``ip``, no kernel support)."""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def namespaces_unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can."""
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    name = f"epdt-probe-{os.getpid()}"
    try:
        _ip("netns", "add", name)
    except (subprocess.CalledProcessError, OSError) as e:
        return f"ip netns add failed: {getattr(e, 'stderr', b'').decode().strip() or e}"
    _ip("netns", "del", name)
    return None


class Hosts:
    def __init__(
        self, names: Sequence[str], subnet: int | None = None, hosts: Mapping[str, Sequence[str]] = {}
    ) -> None:
        """``names``: the hosts; ``hosts``: extra name → host names entries for every host's
        /etc/hosts (a name listed with several hosts resolves to all their addresses)."""
        self.tag = f"epdt{os.getpid() % 100000}"
        self.subnet = subnet if subnet is not None else 100 + os.getpid() % 100
        self.names = list(names)
        self.extra = {k: list(v) for k, v in hosts.items()}
        self.bridge = f"{self.tag}br"
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return f"{self.tag}-{self.names.index(host)}"

    def addr(self, host: str) -> str:
        return SUBNET.format(self.subnet, self.names.index(host) + 1)

    @property
    def gateway(self) -> str:
        """This namespace's address on the bridge."""
        return SUBNET.format(self.subnet, BRIDGE_HOST)

    def __enter__(self) -> Hosts:
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(self.bridge)
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, host in enumerate(self.names):
                ns, veth = self.ns(host), f"{self.tag}v{i}"
                self._hosts_file(ns)
                _ip("netns", "add", ns)
                self._made.append(ns)
                _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
                self._made.append(veth)
                _ip("link", "set", veth, "master", self.bridge)
                _ip("link", "set", veth, "up")
                _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def _hosts_file(self, ns: str) -> None:
        lines = ["127.0.0.1 localhost"]
        lines += [f"{self.addr(h)} {h}" for h in self.names]
        lines += [f"{self.addr(h)} {name}" for name, hosts in self.extra.items() for h in hosts]
        d = Path("/etc/netns") / ns
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text("\n".join(lines) + "\n")

    def start(
        self, host: str, args: Sequence[str], env: Mapping[str, str] | None = None, log: Path | None = None
    ) -> subprocess.Popen:
        """``epdserve <args>`` inside ``host``'s namespace."""
        cmd = ["ip", "netns", "exec", self.ns(host), sys.executable, "-m", "epdserve.cli", *args]
        out = open(log, "ab") if log else None  # noqa: SIM115 - the child holds its own copy
        try:
            proc = subprocess.Popen(
                cmd,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                stdout=out or subprocess.DEVNULL,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
            )
        finally:
            if out:
                out.close()
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in reversed(self._procs):
            stop(proc)
        namespaces = [m for m in self._made if m.startswith(f"{self.tag}-")]
        for ns in namespaces:
            self._kill_all(ns)
        for made in reversed(self._made):
            try:
                if made in namespaces:
                    _ip("netns", "del", made)
                else:
                    # a link (veth end or bridge) deleted here goes now; one left to its
                    # namespace's end would go only when the kernel gets round to it
                    _ip("link", "del", made)
            except subprocess.CalledProcessError:
                pass
            shutil.rmtree(Path("/etc/netns") / made, ignore_errors=True)
        self._made.clear()

    @staticmethod
    def _kill_all(ns: str, timeout: float = 15.0) -> None:
        """Every process still inside ``ns`` (a role's children, one slow to exit): killed and
        gone, so that deleting the namespace frees its links at once."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
            pids = [int(p) for p in out.split()]
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def leftovers(self) -> list[str]:
        """Namespaces and links of this Hosts still present (a test asserts none)."""
        ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
        return [line.split()[0] for line in ns.splitlines() if line.startswith(self.tag)] + [
            line.split(":")[1].strip() for line in links.splitlines() if self.tag in line
        ]
