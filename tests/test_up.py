"""``epdserve up`` as an operator runs it: a real process with real roles, real signals, loopback only.

What must hold (issue 13): a role that dies is restarted on its port and serves again while the
others keep serving; no role outlives ``up`` however it dies, and none leaves its shm slab; a
signal stops it at any time, start-up included; a busy port or a bad flag is a clear usage error.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from epdserve.assets import default_model_dir
from epdserve.bench.workload import image_data_url
from epdserve.launcher import ENGINE_CORE_DIED_EXIT, free_port, is_healthy, process_tree
from epdserve.shapes import ShapesWorld
from epdserve.supervisor import RestartPolicy, Role
from epdserve.up import STOP_TIMEOUT_S, Deployment, StartupError, Topology
from tests.server_utils import http

READY = re.compile(r"ready in [\d.]+s at (?P<url>http://\S+)/v1")
ROLE = re.compile(r"(?:restarted )?(?P<name>\w+)(?: \(attempt \d+\):)? pid (?P<pid>\d+) at (?P<url>http://\S+)")
STARTUP_S = 120.0  # generous: the 2 cores here are shared with the rest of the suite


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie nobody reaped yet has already stopped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def slabs_of(pids: set[int]) -> list[str]:
    from epdserve.transfer.shm_slab import SLAB_RE

    names = [p.name for p in Path("/dev/shm").glob("epd-ec-*")]
    return [n for n in names if (m := SLAB_RE.fullmatch(n)) and int(m["pid"]) in pids]


def wait_for(condition: Callable[[], bool], timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(step)
    return condition()


class Up:
    """``epdserve up`` in its own session, its stdout and stderr in files."""

    def __init__(self, tmp: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.out, self.err = tmp / "up.out", tmp / "up.err"
        self.logs = tmp / "logs"
        cmd = [sys.executable, "-m", "epdserve.cli", "up", *args, "--port", str(self.port), "--log-dir", str(self.logs)]
        with self.out.open("wb") as out, self.err.open("wb") as err:
            # no key of the caller's shell: the tests talk to the public endpoint without one
            clean = {k: v for k, v in os.environ.items() if k not in ("EPD_API_KEY", "EPD_ADMIN_KEY")}
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=err, start_new_session=True, env={**clean, **(env or {})}
            )
        self.seen: set[int] = set()  # every role pid ever reported, for the clean-up checks

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def roles(self) -> dict[str, tuple[int, str]]:
        """name -> (pid, url), the latest start of each role as ``up`` reported it."""
        found: dict[str, tuple[int, str]] = {}
        for m in ROLE.finditer(self.stderr()):
            found[m["name"]] = (int(m["pid"]), m["url"])
            self.seen.add(int(m["pid"]))
        return found

    def wait_ready(self, timeout: float = STARTUP_S) -> str:
        def ready() -> bool:
            return READY.search(self.out.read_text()) is not None or self.proc.poll() is not None

        wait_for(ready, timeout, 0.2)
        m = READY.search(self.out.read_text())
        assert m, f"up did not get ready (rc {self.proc.poll()}):\n{self.stderr()}\n{self.role_logs()}"
        self.roles()
        return m["url"]

    def role_logs(self) -> str:
        logs = sorted(self.logs.glob("*.log")) if self.logs.is_dir() else []
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in logs)

    def wait_restarted(self, name: str, old_pid: int, timeout: float = STARTUP_S) -> tuple[int, str]:
        """The new (pid, url) of ``name`` once it was restarted and answers /health."""

        def healthy_again() -> bool:
            pid, url = self.roles().get(name, (old_pid, ""))
            return pid != old_pid and is_healthy(url)

        assert wait_for(healthy_again, timeout, 0.2), f"{name} not restarted:\n{self.stderr()}\n{self.role_logs()}"
        return self.roles()[name]

    def kill_all(self) -> None:
        """Whatever happened in the test: nothing of ours survives it, not even a slab."""
        from epdserve.up import remove_slabs_of

        self.roles()
        if self.proc.poll() is None:  # the polite way first: up stops its roles, they unlink their slabs
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        for pid in self.seen:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        wait_for(lambda: not any(alive(p) for p in self.seen), 10)
        remove_slabs_of(self.seen)


@contextlib.contextmanager
def up(tmp: Path, *args: str, port: int | None = None, env: dict[str, str] | None = None) -> Iterator[Up]:
    u = Up(tmp, *args, port=port, env=env)
    try:
        yield u
    finally:
        u.kill_all()


def assert_all_gone(u: Up, timeout: float = 10.0) -> None:
    pids = set(u.seen)
    assert pids, "no role was reported started"
    assert wait_for(lambda: not any(alive(p) for p in pids), timeout), (
        f"still running after {timeout}s: {[p for p in pids if alive(p)]}"
    )
    assert slabs_of(pids) == [], "a role left its shm slab behind"


def chat(url: str, content: object, timeout: float = 60.0) -> tuple[int, str]:
    body = {"model": "shapes-qwen2vl", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    status, raw = http("POST", url + "/v1/chat/completions", json.dumps(body).encode(), timeout=timeout)
    return status, raw.decode(errors="replace")


def image_content(seed: int) -> list[dict]:
    img = ShapesWorld(seed).scene().render()
    return [{"type": "image_url", "image_url": {"url": image_data_url(img)}}, {"type": "text", "text": "Describe."}]


def test_restart_backoff_doubles_to_the_cap() -> None:
    p = RestartPolicy()
    assert [p.delay(n) for n in range(1, 8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    with pytest.raises(ValueError):
        RestartPolicy(first_delay_s=20.0, max_delay_s=10.0)


def test_slab_cleanup_removes_only_unlocked_slabs_of_our_roles(tmp_path: Path) -> None:
    import fcntl

    from epdserve.transfer.shm_slab import slab_name
    from epdserve.up import remove_slabs_of

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(done.stdout)  # a role that died without closing its producer
    left = tmp_path / slab_name("encoder-1", pid, 1)
    held = tmp_path / slab_name("encoder-2", pid, 2)  # the pid reused by a live producer: it holds the lock
    foreign = tmp_path / slab_name("encoder-3", pid + 1, 3)  # not one of our roles
    for p in (left, held, foreign):
        p.write_bytes(b"x")
    with held.open("rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        assert remove_slabs_of({pid}, tmp_path) == [left]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([held.name, foreign.name])


# A stand-in role for the start-up rules: a real process with a real /health. Each start appends a
# line to its ``lives`` file; ``plan`` says, per life, how it ends: "serve" (forever), "exit N" (at
# once, with code N), "serve-then-exit N" (healthy for a second, then code N); each life that serves
# appends a line to ``serving`` once it listens. A "router" answers /health with {"pds": 1} only
# once its target's second life serves, as the real router counts only healthy roles.
ROLE_SCRIPT = """
import http.server, json, pathlib, sys, threading, time
port, lives, plan, target = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3].split(","), sys.argv[4]
with lives.open("a") as f:
    f.write("life\\n")
life = plan[min(len(lives.read_text().splitlines()), len(plan)) - 1]
if life.startswith("exit"):
    sys.exit(int(life.split()[1]))
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        seen = target == "-" or len(pathlib.Path(target).read_text().splitlines()) >= 2
        body = json.dumps({"status": "ok", "pds": int(seen)}).encode()
        self.send_response(200 if target == "-" or seen else 503)
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
with lives.with_suffix(".serving").open("a") as f:
    f.write("life\\n")
if life.startswith("serve-then-exit"):
    time.sleep(1.0)
    sys.exit(int(life.split()[1]))
time.sleep(600)
"""


@dataclass
class ScriptRole(Role):
    lives: Path = Path()
    plan: str = "serve"
    target: str = "-"

    def launch(self) -> None:
        port = self.url.rsplit(":", 1)[1]
        argv = [sys.executable, "-c", ROLE_SCRIPT, port, str(self.lives), self.plan, self.target]
        self.proc = subprocess.Popen(argv, start_new_session=True)
        self.started_at = time.monotonic()
        self.pids.append(self.proc.pid)


def script_deployment(tmp_path: Path, **plans: str) -> tuple[Deployment, dict[str, ScriptRole]]:
    deployment = Deployment(Topology.parse("1e+1pd"), None, restart=RestartPolicy(first_delay_s=0.1, poll_s=0.05))
    deployment.startup_timeout_s = 60.0
    roles: dict[str, ScriptRole] = {}
    for name, plan in plans.items():
        target = str(tmp_path / f"{plan.split(':')[1]}.serving") if plan.startswith("router:") else "-"
        role = ScriptRole(name, f"http://127.0.0.1:{free_port()}", [], lives=tmp_path / f"{name}.lives")
        role.plan, role.target = plan.split(":")[0], target
        role.launch()
        deployment.roles.append(role)
        roles[name] = role
    return deployment, roles


def test_a_role_failing_before_it_was_healthy_fails_the_start(tmp_path: Path) -> None:
    deployment, roles = script_deployment(tmp_path, encoder0="serve", pd0="exit 1")
    try:
        with pytest.raises(StartupError, match=r"pd0 exited with code 1 during start-up"):
            deployment._wait(list(roles.values()))
    finally:
        deployment.stop()


def test_a_role_whose_engine_core_died_during_start_up_is_restarted(tmp_path: Path) -> None:
    # its exit code says it had started: an early client may already have been served by it
    deployment, roles = script_deployment(tmp_path, pd0=f"exit {ENGINE_CORE_DIED_EXIT},serve")
    try:
        deployment._wait(list(roles.values()))
        assert len(roles["pd0"].pids) == 2 and roles["pd0"].proc.poll() is None
    finally:
        deployment.stop()


def test_a_role_dying_after_it_was_healthy_is_restarted_while_the_router_looks(tmp_path: Path) -> None:
    # the race a client can win: the role was healthy (the router may have served with it), then
    # died before the router had found every role; the start goes on, the role restarted
    deployment, roles = script_deployment(tmp_path, pd0="serve-then-exit 0,serve", router="router:pd0")
    try:
        deployment._wait(list(roles.values()), roles["router"], {"pds": 1})
        assert len(roles["pd0"].pids) == 2 and is_healthy(roles["pd0"].url)
    finally:
        deployment.stop()


# A stand-in role for the stop order: on SIGTERM it writes when the signal came, lingers ``linger``
# seconds (a router giving back leases as it closes), writes when it exits, and exits.
STOP_SCRIPT = """
import pathlib, signal, sys, time
out, linger = pathlib.Path(sys.argv[1]), float(sys.argv[2])
def stop(*_):
    out.write_text(f"{time.monotonic()}\\n")
    time.sleep(linger)
    with out.open("a") as f:
        f.write(f"{time.monotonic()}\\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
out.with_suffix(".ready").touch()
while True:
    time.sleep(1)
"""


@dataclass
class StopRole(Role):
    out: Path = Path()
    linger: float = 0.0

    def launch(self) -> None:
        argv = [sys.executable, "-c", STOP_SCRIPT, str(self.out), str(self.linger)]
        self.proc = subprocess.Popen(argv, start_new_session=True)
        self.pids.append(self.proc.pid)


def stop_times(tmp_path: Path, router_linger: float) -> tuple[dict[str, list[float]], float]:
    """Stop a deployment of stand-ins (started encoder, PD worker, router, as ``up`` starts them);
    per role the monotonic times of its SIGTERM (and of its exit, when it exited by itself), and how
    long ``stop`` took."""
    deployment = Deployment(Topology.parse("1e+1pd"), None)
    lingers = {"encoder0": 0.0, "pd0": 0.0, "router": router_linger}
    for name, linger in lingers.items():
        role = StopRole(name, f"http://127.0.0.1:{free_port()}", [], out=tmp_path / f"{name}.stop", linger=linger)
        role.launch()
        deployment.roles.append(role)
    assert wait_for(lambda: all((tmp_path / f"{n}.ready").exists() for n in lingers), 30)
    t0 = time.monotonic()
    deployment.stop()
    took = time.monotonic() - t0
    times = {n: [float(x) for x in (tmp_path / f"{n}.stop").read_text().split()] for n in lingers}
    return times, took


def test_stop_ends_the_router_before_the_roles_behind_it(tmp_path: Path) -> None:
    # the router closing gives the encoders back its last requests' leases: they must still be up
    times, took = stop_times(tmp_path, router_linger=1.0)
    router_exit = times["router"][1]
    assert times["encoder0"][0] >= router_exit and times["pd0"][0] >= router_exit, times
    assert took < STOP_TIMEOUT_S


def test_a_router_that_does_not_stop_holds_the_others_back_half_the_grace(tmp_path: Path) -> None:
    times, took = stop_times(tmp_path, router_linger=60.0)
    assert len(times["router"]) == 1  # killed at the end of its grace, not exited
    waited = times["encoder0"][0] - times["router"][0]
    assert STOP_TIMEOUT_S / 2 - 0.5 <= waited <= STOP_TIMEOUT_S / 2 + 2.0, times
    assert took < STOP_TIMEOUT_S + 5.0


def answers_hi(url: str) -> bool:
    """Whether the deployment at ``url`` answers a short chat request."""
    body = {"model": "shapes-qwen2vl", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(
        url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return bool(r.status == 200)


def test_roles_get_distinct_ports_when_the_kernel_offers_one_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role binds its port only once it has loaded, so until then the kernel may offer the same
    free port again: every role still gets its own, and the deployment serves."""
    import epdserve.up as up_module

    offered: list[int] = []

    def twice(host: str = "127.0.0.1") -> int:  # each free port offered twice in a row
        if not offered or offered.count(offered[-1]) == 2:
            offered.append(free_port(host))
        else:
            offered.append(offered[-1])
        return offered[-1]

    monkeypatch.setattr(up_module, "free_port", twice)
    d = Deployment(Topology.parse("2e+1pd"), None, port=free_port(), log_dir=tmp_path, ec_connector="tcp")
    d.start()
    try:
        urls = [r.url for r in d.roles]
        assert len(set(urls)) == len(urls) == 4, urls
        assert len(offered) > len(set(offered))  # the same port was offered again, and passed over
        assert answers_hi(d.url)
    finally:
        d.stop()


def test_a_port_taken_before_its_role_listens_starts_the_roles_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel offers a free port to anyone who asks: one that another process takes before the
    role we gave it listens costs a new start on other ports, not the deployment. The public port
    given as 0 is ours to pick too."""
    import epdserve.up as up_module

    busy: list[socket.socket] = []
    calls: list[int] = []

    def taken_at_second_call(host: str = "127.0.0.1") -> int:  # the first role's port, first start
        calls.append(0)
        if len(calls) != 2:
            return free_port(host)
        busy.append(socket.create_server((host, 0)))
        return busy[-1].getsockname()[1]

    monkeypatch.setattr(up_module, "free_port", taken_at_second_call)
    d = Deployment(Topology.parse("1e+1pd"), None, port=0, log_dir=tmp_path, verbose=True)
    lines: list[str] = []
    d.line = lambda text, *args, **kwargs: lines.append(text)  # type: ignore[method-assign]
    try:
        d.start()
        taken = busy[0].getsockname()[1]
        assert d.port != 0 and all(not r.url.endswith(f":{taken}") for r in d.roles)
        assert any(f"encoder0's port {taken} was taken before it could listen: starting again" in t for t in lines)
        assert answers_hi(d.url)
    finally:
        d.stop()
        for b in busy:
            b.close()


def test_ports_taken_at_every_start_fail_it_saying_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import epdserve.up as up_module

    busy: list[socket.socket] = []

    def always_taken(host: str = "127.0.0.1") -> int:
        busy.append(socket.create_server((host, 0)))
        return busy[-1].getsockname()[1]

    monkeypatch.setattr(up_module, "free_port", always_taken)
    d = Deployment(Topology.parse("1e+1pd"), None, port=free_port(), log_dir=tmp_path)
    try:
        with pytest.raises(
            StartupError, match=r"(encoder0|pd0|router)'s port \d+ was taken before it could listen, 3 times"
        ):
            d.start()
        assert d.roles == []
    finally:
        d.stop()
        for b in busy:
            b.close()


def test_busy_port_is_a_usage_error_and_starts_nothing(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with up(tmp_path, "--topology", "1e+1pd", port=port) as u:
            assert u.proc.wait(timeout=30) == 2
            err = u.stderr()
            assert f"port {port} on 127.0.0.1 is in use; choose another with --port" in err
            assert u.roles() == {}, "a role was started on a busy port"
            assert "ready" not in u.out.read_text()


def test_bad_topology_is_a_usage_error(tmp_path: Path) -> None:
    with up(tmp_path, "--topology", "3e") as u:
        assert u.proc.wait(timeout=30) == 2
        err = u.stderr()
        assert "usage: epdserve up" in err and "argument --topology" in err
        assert "Traceback" not in err


def test_role_failing_at_startup_names_it_and_stops_everything(tmp_path: Path) -> None:
    # a config every role accepts, without weights: the roles fail while loading the model
    broken = tmp_path / "no-weights"
    broken.mkdir()
    for f in default_model_dir().glob("*.json"):
        shutil.copy(f, broken / f.name)
    with up(tmp_path, "--topology", "1e+1pd", "--model", str(broken)) as u:
        assert u.proc.wait(timeout=60) == 1
        err = u.stderr()
        m = re.search(r"(encoder0|pd0) exited with code \d+ during start-up \(its log: (\S+)\)", err)
        assert m, err
        assert Path(m[2]) == u.logs / f"{m[1]}.log" and Path(m[2]).is_file()
        assert "ready" not in u.out.read_text()
        assert u.roles()  # the roles started (the router beside the others) ...
        assert_all_gone(u, timeout=5)  # ... are all stopped


def test_sigint_during_startup_stops_promptly(tmp_path: Path) -> None:
    with up(tmp_path, "--topology", "1e+1pd") as u:
        assert wait_for(lambda: len(u.roles()) >= 2, 60), u.stderr()
        time.sleep(1.0)  # the roles are loading their models, up is waiting for their health
        assert "ready" not in u.out.read_text(), "too slow a machine to interrupt the start-up"
        t0 = time.monotonic()
        started = set(u.roles())
        u.proc.send_signal(signal.SIGINT)
        assert u.proc.wait(timeout=15) == 0
        assert time.monotonic() - t0 < 10
        assert set(u.roles()) == started, "up went on starting roles after SIGINT"
        assert_all_gone(u, timeout=5)


def proc_env(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(kv.decode().split("=", 1) for kv in raw if b"=" in kv)


def proc_cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:  # gone meanwhile
        return b""


def proc_args(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def test_sighup_of_up_stops_every_role(tmp_path: Path) -> None:
    keys = {"EPD_API_KEY": "public-key-for-test", "EPD_ADMIN_KEY": "admin-key-for-test"}
    # 127.0.0.2 is loopback too: enough to tell the public host from the internal one
    with up(tmp_path, "--topology", "1e+1pd", "--host", "127.0.0.2", env=keys) as u:
        assert u.wait_ready() == f"http://127.0.0.2:{u.port}"
        roles = u.roles()
        assert sorted(roles) == ["encoder0", "pd0", "router"]
        assert roles["router"][1] == f"http://127.0.0.2:{u.port}"
        # credentials: one cluster secret in every environment and on no command line; the API key
        # only where the public endpoint is, the admin key only in the router; workers internal-only
        envs = {name: proc_env(pid) for name, (pid, _) in roles.items()}
        secrets = {env["EPD_CLUSTER_SECRET"] for env in envs.values()}
        assert len(secrets) == 1
        secret = secrets.pop()
        assert len(secret) >= 32 and secret != os.environ.get("EPD_CLUSTER_SECRET"), "not generated by up"
        assert all(secret not in " ".join(proc_args(pid)) for pid, _ in roles.values())
        assert envs["router"]["EPD_API_KEY"] == keys["EPD_API_KEY"]
        assert envs["router"]["EPD_ADMIN_KEY"] == keys["EPD_ADMIN_KEY"]
        for name in ("encoder0", "pd0"):
            assert "EPD_API_KEY" not in envs[name] and "EPD_ADMIN_KEY" not in envs[name]
            args = proc_args(roles[name][0])
            assert args[args.index("--host") + 1] == "127.0.0.1"
            assert roles[name][1].startswith("http://127.0.0.1:")
        assert "--internal-only" in proc_args(roles["pd0"][0])
        assert slabs_of(u.seen), "the encoder has no shm slab to leave behind: the check below proves nothing"
        u.proc.send_signal(signal.SIGHUP)
        assert u.proc.wait(timeout=15) == 0
        assert_all_gone(u)


def test_killed_roles_are_restarted_and_killed_up_leaves_nothing(tmp_path: Path) -> None:
    with up(tmp_path, "--topology", "1e+1pd") as u:
        url = u.wait_ready()
        enc_pid, enc_url = u.roles()["encoder0"]

        # the encoder: text keeps working while it is down, images work again once it is back
        os.kill(enc_pid, signal.SIGKILL)
        down_since = time.monotonic()
        texts = 0
        while not is_healthy(enc_url) or u.roles()["encoder0"][0] == enc_pid:
            status, body = chat(url, "Say hi.")
            assert status == 200, body
            texts += 1
            time.sleep(0.2)  # a few texts prove it; more would only slow the encoder's restart
            assert time.monotonic() - down_since < STARTUP_S, u.stderr()
        assert texts >= 1
        new_pid, new_url = u.wait_restarted("encoder0", enc_pid)
        assert new_url == enc_url and new_pid != enc_pid
        assert "restarted encoder0 (attempt 1)" in u.stderr()
        # the router re-admits it on its next probe (every 2 s)
        assert wait_for(lambda: chat(url, image_content(1))[0] == 200, 15, 0.5), chat(url, image_content(1))

        # the PD worker and the router: each comes back on its port and serves again
        for name in ("pd0", "router"):
            pid, role_url = u.roles()[name]
            os.kill(pid, signal.SIGKILL)
            _, again_url = u.wait_restarted(name, pid)
            assert again_url == role_url
            assert wait_for(lambda: chat(url, image_content(2))[0] == 200, 15, 0.5), f"not serving after {name}"

        # the PD worker's engine core: the worker exits, saying so, and is restarted like any role
        pid, role_url = u.roles()["pd0"]
        cores = [p for p in process_tree([pid])[1:] if b"epdserve.engine.core_proc" in proc_cmdline(p)]
        assert len(cores) == 1, process_tree([pid])
        restarts = u.stderr().count("restarted pd0")
        os.kill(cores[0], signal.SIGKILL)
        _, again_url = u.wait_restarted("pd0", pid)
        assert again_url == role_url and u.stderr().count("restarted pd0") == restarts + 1
        assert wait_for(lambda: chat(url, image_content(3))[0] == 200, 15, 0.5), "not serving after the core died"

        # up itself, killed: every role (restarted ones too) gets SIGTERM from the kernel and ends
        u.roles()
        os.kill(u.proc.pid, signal.SIGKILL)
        u.proc.wait(timeout=10)
        assert_all_gone(u)


def test_killing_an_encoder_under_image_load_fails_no_request(tmp_path: Path) -> None:
    with up(tmp_path, "--topology", "2e+1pd") as u:
        url = u.wait_ready()
        results: list[tuple[int, str]] = []
        stop = threading.Event()

        def load(offset: int) -> None:
            seed = offset
            while not stop.is_set():
                results.append(chat(url, image_content(1000 + seed)))  # distinct images: no cache hits
                seed += 2
                stop.wait(0.2)  # a steady load, not one that slows the encoder's restart

        workers = [threading.Thread(target=load, args=(i,)) for i in range(2)]
        for w in workers:
            w.start()
        try:
            assert wait_for(lambda: len(results) >= 2, 60), results
            pid, _ = u.roles()["encoder0"]
            os.kill(pid, signal.SIGKILL)
            at_kill = len(results)
            u.wait_restarted("encoder0", pid)
            done = len(results)
            assert done - at_kill >= 2, "too few requests while the encoder was down to prove anything"
            assert wait_for(lambda: len(results) >= done + 4, 60)  # and it serves after the restart
        finally:
            stop.set()
            for w in workers:
                w.join(timeout=70)
        failed = [r for r in results if r[0] != 200]
        assert failed == [], f"{len(failed)} of {len(results)} failed, e.g. {failed[:2]}"
        u.proc.send_signal(signal.SIGTERM)
        assert u.proc.wait(timeout=15) == 0
        assert_all_gone(u)


def test_pinned_engine_cores_get_cores_of_their_own() -> None:
    """Behind encoders each language-model worker's engine core has its own core(s); encoders and
    the workers' front ends share the rest. Without encoders each worker keeps its share whole."""
    from epdserve.up import CorePlan, Topology, plan_cores

    plan = plan_cores(Topology.parse("1e+1pd"), [0, 1])
    assert plan == CorePlan({"encoder0": [0], "pd0": [0]}, {"pd0": [1]})
    assert plan.by_process() == {"encoder0": [0], "pd0": [0], "pd0 engine": [1]}
    plan = plan_cores(Topology.parse("2e+2pd"), list(range(8)))
    assert plan.roles["encoder0"] == [0, 2] and plan.roles["encoder1"] == [1, 3]
    assert plan.roles["pd0"] == plan.roles["pd1"] == [0, 1, 2, 3]
    assert plan.engines == {"pd0": [4, 6], "pd1": [5, 7]}
    plan = plan_cores(Topology.parse("1e+1p+1d"), [0, 1])
    assert plan.engines == {"prefill0": [1], "decode0": [1]} and plan.roles["decode0"] == [0]
    assert plan_cores(Topology.parse("1p+1d"), [0, 1]) == CorePlan({"prefill0": [0], "decode0": [1]}, {})
    assert plan_cores(Topology.parse("aggregated"), [0, 1]) == CorePlan({}, {})
    assert plan_cores(Topology.parse("1e+1pd"), [0]) == CorePlan({}, {})


def test_engine_cpus_are_a_core_list() -> None:
    from epdserve.engine.config import EngineConfig, cpu_list

    assert cpu_list("") == () and cpu_list("1") == (1,) and cpu_list("0-2,6,1") == (0, 1, 2, 6)
    for bad in ("x", "3-1", "1-", "-1", "1;2"):
        with pytest.raises(ValueError, match="core list"):
            EngineConfig(cpus=bad)


def test_process_tree_finds_a_role_and_what_it_started() -> None:
    code = (
        "import subprocess, sys, time\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        tree = process_tree([child.pid])
        assert tree[0] == child.pid and grandchild in tree and os.getpid() not in tree
        assert len(tree) == len(set(tree))
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
