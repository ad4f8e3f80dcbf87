"""``epdserve up``: start a whole topology on this machine, keep it running, stop it cleanly.

Topologies: ``aggregated`` (one ``serve`` process doing E+P+D), ``<N>e+<M>pd`` (N encoder
instances, M prefill+decode instances, one router on the public port), ``<N>e+<P>p+<D>d`` (prefill
and decode instances apart, the prompt's KV moved between them by the KV connector) and ``<P>p+<D>d``
(no encoders: the router forwards raw media to prefill and decode instances that load the vision
tower). Every role is its own process (its own process group), optionally pinned to cores.

- Only the public role (router, or the aggregated server) binds ``host``; the roles behind it bind
  and are addressed at 127.0.0.1, and PD workers behind a router accept only cluster callers.
- Every role gets the cluster secret in its environment (never on a command line, where ``ps``
  shows it); the API key reaches only the public role, the admin key only the router.
- A role that dies after it was healthy is restarted on its port (``epdserve.supervisor``), during
  start-up too; one that fails before it was ever healthy stops everything.
- Children cannot outlive ``up``: each gets SIGTERM from the kernel when ``up`` dies, however it
  dies, and SIGINT/SIGTERM/SIGHUP stop everything at any time (a second one kills at once).

Exit codes of ``run_up``: 0 after a stop asked for by a signal, 1 when a role failed to start,
2 when the public port is taken or the topology does not fit the machine (argparse also exits 2
on bad flags).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Collection
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from epdserve.common.core_board import make_board
from epdserve.integrations.vllm.launch import SIZES_ITSELF as VLLM_SIZES_ITSELF
from epdserve.integrations.vllm.launch import START_TIMEOUT_S as VLLM_START_S
from epdserve.integrations.vllm.launch import (
    WRAPPER,
    VllmNotFound,
    find_vllm,
    serve_command,
    vllm_cpu_binding,
    wrapper_args,
)
from epdserve.launcher import (
    ENGINE_CORE_DIED_EXIT,
    PORT_IN_USE_EXIT,
    Cancelled,
    free_port,
    is_healthy,
    port_available,
)
from epdserve.models.config import ModelConfig, check_model_dir
from epdserve.security.credentials import ADMIN_KEY_ENV, API_KEY_ENV, CLUSTER_SECRET_ENV, ClusterCredential
from epdserve.sizing import Settings, TooLargeError
from epdserve.store.mooncake_master import MooncakeMaster, start_master
from epdserve.supervisor import RestartPolicy, Role, Supervisor, exit_reason
from epdserve.topology import CorePlan, Topology, cpu_spec, describe, plan_cores
from epdserve.transfer.config import Connector

if TYPE_CHECKING:
    from epdserve.router.dispatch import Dispatch

__all__ = ["Deployment", "PortInUseError", "Role", "StartupError", "Topology", "plan_cores", "run_up"]

LM_ENGINES = ("epdserve", "vllm")  # what runs the language-model instances behind the encoders
INTERNAL_HOST = "127.0.0.1"  # roles behind the public endpoint are reachable from this machine only
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
STARTUP_POLL_S = 0.05  # how often start-up looks at the roles and the router
STOP_TIMEOUT_S = 8.0  # grace for all roles together after SIGTERM, then SIGKILL
PORT_TRIES = 3  # starts of the roles when a port we picked is taken before its role listens


class StartupError(RuntimeError):
    """A role did not come up; everything started has been stopped."""


class PortInUseError(StartupError):
    """The public port cannot be bound; nothing was started."""


class PortTaken(StartupError):
    """A port ``up`` picked (a role's behind the router, or the public one given as 0) was taken by
    another process before its role could listen: the start is tried again on other ports."""


def http_host(host: str) -> str:
    """How to reach a server bound to ``host`` from this machine, as a URL host."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def open_api_warning(host: str, api_key: str) -> str | None:
    """The warning for a public API anyone on the network may use: ``host`` is not loopback and
    no API key is set (None: nothing to warn about)."""
    if api_key or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:
        pass  # a host name: it may resolve to any interface
    return (
        f"WARNING: the API on {host} is open to anyone who can reach it (no API key): set {API_KEY_ENV} "
        "(or --api-key), or listen on --host 127.0.0.1"
    )


class Deployment:
    """The roles of one topology on this machine. ``start`` blocks until all are healthy,
    ``supervise`` keeps them running until ``request_stop``, ``stop`` ends them."""

    def __init__(
        self,
        topology: Topology,
        model: str | None,
        host: str = "127.0.0.1",
        port: int = 8000,
        pin: bool = False,
        ec_connector: Connector = "shm",
        kv_connector: Connector = "shm",
        extra_pd_args: list[str] | None = None,
        log_dir: Path | None = None,
        extra_router_args: list[str] | None = None,
        extra_encoder_args: list[str] | None = None,
        extra_args: list[str] | None = None,
        api_key: str = "",
        admin_key: str = "",
        cluster: ClusterCredential | None = None,
        restart: RestartPolicy | None = None,
        startup_timeout_s: float = 180.0,
        verbose: bool = False,
        mooncake_master: bool = False,
        dispatch: Dispatch = "always",
        sizing: Settings | None = None,
        log_json: bool = False,
        lm_engine: str = "epdserve",
        vllm_args: list[str] | None = None,
        vllm_ec_extra: dict | None = None,
        served_model_name: str = "",
        lend_cores: bool = True,
    ) -> None:
        if lm_engine not in LM_ENGINES:
            raise ValueError(f"unknown language-model engine {lm_engine!r}; choose from {LM_ENGINES}")
        if lm_engine == "vllm" and (not topology.encoders or topology.split):
            raise ValueError("--lm-engine vllm runs the <N>e+<M>pd topologies (e.g. 1e+1pd, 2e+2pd) only")
        self.topology = topology
        self.model = model
        self.model_args = ["--model", model] if model else []
        self.host = host
        self.any_port = port == 0  # the public port is ours to pick (and to pick again)
        self.port = port
        self.ports: set[int] = {port}  # every port handed to a role of this deployment
        self.pin = pin
        self.ec_connector = ec_connector
        self.kv_connector = kv_connector
        self.extra_pd_args = extra_pd_args or []  # PD workers and the aggregated server
        self.extra_router_args = extra_router_args or []
        self.extra_encoder_args = extra_encoder_args or []
        self.extra_args = extra_args or []  # every role (media limits: each role that fetches media has them)
        self.log_dir = log_dir
        self.api_key = api_key
        self.admin_key = admin_key
        # in-process callers (tests, benchmarks) talk to internal roles with the environment's
        # credential when there is one; ``epdserve up`` passes its own (generated or from a file)
        self.cluster = cluster or ClusterCredential.load() or ClusterCredential.generate()
        self.restart = restart or RestartPolicy()
        self.startup_timeout_s = max(startup_timeout_s, VLLM_START_S if lm_engine == "vllm" else 0.0)
        self.verbose = verbose  # one line per role start and restart on stderr
        self.mooncake_master = mooncake_master  # start a Mooncake master: encoders share outputs through it
        self.master: MooncakeMaster | None = None
        self.dispatch = dispatch  # behind encoders: where the router has media encoded
        self.sizing = sizing  # what sizes the roles' memory; None: no size check (``up --force``)
        self.log_json = log_json  # up's own lines as JSON objects (``--log-format json``)
        self.lm_engine = lm_engine  # vllm: ``vllm serve`` instances with epdserve's EC connector
        self.vllm_args = vllm_args or []  # the operator's own ``vllm serve`` flags, verbatim
        self.vllm_ec_extra = vllm_ec_extra or {}  # the connector's ec_connector_extra_config
        self.served_model_name = served_model_name
        # pinned behind encoders: roles borrow the cores of idle roles through a board (kernels.lending)
        self.lend_cores = lend_cores
        self.board: Path | None = None
        self.vllm = ""  # the ``vllm`` executable, found at start
        self.roles: list[Role] = []
        self.fs_dir: Path | None = None
        self.startup_s = 0.0
        self.stop_signal = 0  # the signal that asked us to stop (0: none yet)
        self.stopping = False

    @property
    def url(self) -> str:
        return f"http://{http_host(self.host)}:{self.port}"

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Make ``start`` and ``supervise`` return soon (safe from a signal handler)."""
        self.stop_signal = self.stop_signal or signum

    def _free_port(self, host: str = INTERNAL_HOST) -> int:
        """A free port no role of this deployment was given before (in this start or an earlier
        try): a role binds its port only once it has loaded, so until then the kernel may offer
        the same free port again."""
        port = free_port(host)
        while port in self.ports:
            port = free_port(host)
        self.ports.add(port)
        return port

    def _say(self, text: str) -> None:
        if self.verbose:
            self.line(text)

    def line(self, text: str, level: str = "INFO", out: TextIO | None = None, **fields: object) -> None:
        """One of ``up``'s own lines (stderr unless ``out``): text, or with ``log_json`` one JSON
        object as the roles write them (``fields`` added as keys)."""
        if self.log_json:
            now = time.time()
            stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
            record = {"time": stamp, "level": level, "logger": "epdserve.up", "message": text, **fields}
            print(json.dumps(record), file=out or sys.stderr, flush=True)
        else:
            print(f"epdserve up: {'error: ' if level == 'ERROR' else ''}{text}", file=out or sys.stderr, flush=True)

    def _env(self, public: bool, router: bool) -> dict[str, str | None]:
        return {
            CLUSTER_SECRET_ENV: self.cluster.secret.decode(),
            API_KEY_ENV: (self.api_key or None) if public else None,
            ADMIN_KEY_ENV: (self.admin_key or None) if router else None,
        }

    def _launch(
        self,
        name: str,
        args: list[str],
        port: int,
        cpus: list[int] | None,
        public: bool = False,
        module: str = "epdserve.cli",
        env: dict[str, str] | None = None,
    ) -> Role:
        if self.stop_signal:
            raise Cancelled(name)
        host = self.host if public else INTERNAL_HOST
        log = str(self.log_dir / f"{name}.log") if self.log_dir else None
        role_env: dict[str, str | None] = {**(env or {}), **self._env(public, router=name == "router")}
        if module == "epdserve.cli":  # a vLLM instance's command line names its address itself
            args = [*args, "--host", host, "--port", str(port)]
        role = Role(name, f"http://{http_host(host)}:{port}", args, cpus, log, role_env, module=module)
        try:
            role.launch()
        except OSError as e:  # e.g. taskset missing for --pin-cores
            raise StartupError(f"could not start {name}: {e}") from None
        self.roles.append(role)
        self._say(f"{name} pid {role.proc.pid} at {role.url}" + (f" (log {log})" if log else ""))
        return role

    def _wait(self, roles: list[Role], router: Role | None = None, counts: dict[str, int] | None = None) -> None:
        """Until every role has answered /health and, given a router, the router has found each kind
        of role healthy (``counts``: its /ready counts). All are watched together, so a role that is
        healthy cannot die unnoticed behind one still loading. A role that exits before it was ever
        healthy stops the start; one that was (its own /health answered, or it exited because its
        engine core died, which only a started role can) is restarted, as after start-up."""
        deadline = time.monotonic() + self.startup_timeout_s
        loading = list(roles)
        supervisor = Supervisor(self.roles, self.restart, self._say)
        while time.monotonic() < deadline:
            if self.stop_signal:
                raise Cancelled("start-up")
            # another ``up`` took the public port after our check: then the health of its server,
            # at the same address, is no sign of ours
            self._check_public_port()
            for r in loading:
                code = r.proc.poll()
                if code is not None and code != ENGINE_CORE_DIED_EXIT and r.restart_at is None:
                    if code == PORT_IN_USE_EXIT:
                        raise PortTaken(f"{r.name}'s port {r.url.rsplit(':', 1)[1]} was taken before it could listen")
                    where = f"its log: {r.log}" if r.log else "its output is above"
                    raise StartupError(f"{r.name} exited with {exit_reason(code)} during start-up ({where})")
            supervisor.check()
            loading = [r for r in loading if r.restart_at is not None or not is_healthy(r.url, 1.0, r.kind)]
            if not loading and (router is None or self._router_found(router, counts or {})):
                return
            time.sleep(STARTUP_POLL_S)
        waiting = ", ".join(r.name for r in loading) or "the router's view of every role"
        raise StartupError(f"not healthy after {self.startup_timeout_s:.0f}s: {waiting}")

    def _check_public_port(self) -> None:
        if not self.any_port and any(r.url == self.url and r.proc.poll() == PORT_IN_USE_EXIT for r in self.roles):
            raise PortInUseError(f"port {self.port} on {self.host} is in use; choose another with --port")

    @staticmethod
    def _router_found(router: Role, counts: dict[str, int]) -> bool:
        try:
            with urllib.request.urlopen(router.url + "/ready", timeout=1) as r:
                seen = json.loads(r.read())
        except (OSError, ValueError):
            return False
        return all(seen.get(kind, 0) >= n for kind, n in counts.items())

    def start(self) -> None:
        """Start every role and wait until all are healthy. A port we picked that another process
        took before its role could listen (the kernel offers a free port to anyone who asks) starts
        the roles again on other ports, ``PORT_TRIES`` times in all."""
        for attempt in range(1, PORT_TRIES + 1):
            try:
                self._start_once()
                return
            except PortTaken as e:
                if attempt == PORT_TRIES:
                    raise StartupError(f"{e}, {PORT_TRIES} times") from None
                self._say(f"{e}: starting again on other ports")
                self.stopping = False  # ``_start_once`` stopped what it had started

    def _start_once(self) -> None:
        t0 = time.time()
        if self.any_port:
            self.port = self._free_port(self.host)
        elif not port_available(self.host, self.port):
            raise PortInUseError(f"port {self.port} on {self.host} is in use; choose another with --port")
        if self.log_dir:
            self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.model_args:  # a model no role can serve fails here, once, before any role starts
            ModelConfig.from_pretrained(self.model_args[1])
            check_model_dir(self.model_args[1], tokenizer=True)
        if self.sizing is not None:
            self._check_fit(self.sizing)
        if self.lm_engine == "vllm":
            self.vllm = find_vllm()  # VllmNotFound: nothing is started
        topo = self.topology
        try:
            if topo.aggregated:
                args = ["serve", *self.model_args, *self.extra_pd_args, *self.extra_args]
                self._wait([self._launch("serve", args, self.port, None, public=True)])
            else:
                self._start_disaggregated(topo)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.time() - t0

    def _check_fit(self, sizing: Settings) -> None:
        """The topology against this machine's memory and cores (``TooLargeError`` with the
        numbers), each role counted by the account it checks itself against at start-up."""
        from epdserve.assets import default_model_dir
        from epdserve.sizing import check_fit, describe

        topo = self.topology
        model = Path(self.model_args[1]) if self.model_args else default_model_dir()
        # behind encoders that encode everything the workers load no vision tower (as started below)
        vision = topo.aggregated or not topo.encoders or self.dispatch != "always"
        workers = {"pd": topo.pds, "prefill": topo.prefills, "decode": topo.decodes}
        vllm = self.lm_engine == "vllm"  # vLLM sizes itself, by its own flags and environment
        fit = check_fit(model, sizing, topo.encoders, {} if vllm else workers, vision, router=not topo.aggregated)
        line = describe(fit)
        self._say(f"{line}; not counted: {topo.pds} vLLM instance(s), {VLLM_SIZES_ITSELF}" if vllm else line)

    def _lending(self, plan: CorePlan, cores: list[int]) -> list[str]:
        """The flags that put encoders and engine cores on a new core board (none: each role keeps
        to its pinned cores). Each then runs on every core, by its own count of threads, and
        borrows the cores of the roles that are idle."""
        if not (self.lend_cores and plan.engines and self.lm_engine == "epdserve"):
            return []
        self.board = make_board()
        self._say(f"roles lend idle cores through {self.board}")
        return ["--core-board", str(self.board)]

    def _start_disaggregated(self, topo: Topology) -> None:
        cores = sorted(os.sched_getaffinity(0))
        plan = plan_cores(topo, cores) if self.pin else CorePlan({}, {})
        lending = self._lending(plan, cores)
        fs_args: list[str] = []
        if self.ec_connector == "fs":
            # private (0700) and unpredictable: nobody else can plant or read embeddings there
            self.fs_dir = Path(tempfile.mkdtemp(prefix="epd-ec-fs-"))
            fs_args = ["--ec-fs-dir", str(self.fs_dir)]
        store_args: list[str] = []
        if self.mooncake_master and topo.encoders:
            log = self.log_dir / "mooncake_master.log" if self.log_dir else None
            try:
                self.master = start_master(log)
            except RuntimeError as e:
                raise StartupError(f"could not start the Mooncake master: {e}") from None
            self._say(f"mooncake master pid {self.master.proc.pid} at {self.master.url}")
            store_args = ["--store-url", self.master.url]
        encoders = []
        for i in range(topo.encoders):
            args = ["encoder", *self.model_args, "--ec-connector", self.ec_connector, *fs_args, *store_args]
            if self.ec_connector == "tcp":
                args += ["--ec-tcp-port", str(self._free_port())]
            pinned = plan.roles.get(f"encoder{i}")
            if pinned and lending:
                args += [*lending, "--threads", str(len(pinned))]
                pinned = cores
            args += [*self.extra_encoder_args, *self.extra_args]
            encoders.append(self._launch(f"encoder{i}", args, self._free_port(), pinned))
        # behind encoders that encode everything the language-model workers only see
        # metadata-only media: no vision weights; with raw media to them (no encoders, adaptive
        # dispatch, the metadata-only baseline) they encode it themselves
        dispatch = self.dispatch if topo.encoders else "never"
        vision = ["--no-vision-tower"] if dispatch == "always" else ["--vision-tower"]
        router_args = ["--dispatch", dispatch]
        workers: dict[str, list[Role]] = {"pds": [], "prefills": [], "decodes": []}
        for name in topo.workers:
            if self.lm_engine == "vllm":
                workers["pds"].append(self._launch_vllm(name, store_args, plan))
                continue
            args = ["serve", *self.model_args, *self.extra_pd_args, *vision, *fs_args, *store_args, "--internal-only"]
            kind = "pds"
            if name.startswith(("prefill", "decode")):
                kind = "prefills" if name.startswith("prefill") else "decodes"
                args += ["--role", kind[:-1], "--kv-connector", self.kv_connector]
                if kind == "prefills" and self.kv_connector == "tcp":
                    args += ["--kv-tcp-port", str(self._free_port())]
            if name in plan.engines and lending:
                args += [*lending, "--threads", str(len(plan.engines[name])), "--engine-cpus", cpu_spec(cores)]
            elif name in plan.engines:
                args += ["--engine-cpus", cpu_spec(plan.engines[name])]
            role = self._launch(name, [*args, *self.extra_args], self._free_port(), plan.roles.get(name))
            workers[kind].append(role)
        # the router starts beside them (their addresses are known) and is healthy once it has
        # found a worker healthy; every role must be, before the deployment is
        args = ["router", *self.model_args, *router_args, "--pd-engine", self.lm_engine]
        if encoders:
            args += ["--encoders", *(r.url for r in encoders)]
        for kind, roles in workers.items():
            if roles:
                args += [f"--{kind}", *(r.url for r in roles)]
        args += [*self.extra_router_args, *self.extra_args]
        router = self._launch("router", args, self.port, None, public=True)
        counts = {"encoders": len(encoders), **{kind: len(roles) for kind, roles in workers.items()}}
        self._wait([*encoders, *(r for rs in workers.values() for r in rs), router], router, counts)

    def _launch_vllm(self, name: str, store_args: list[str], plan: CorePlan) -> Role:
        """``vllm serve`` with epdserve's connector, under the name the encoders sign handles with
        (their served name), behind the wrapper that prefixes its lines and takes it down. Pinned,
        vLLM's engine runs on the cores an engine core would get, its CPU build's model worker
        bound to them (``VLLM_CPU_OMP_THREADS_BIND``): its engine core and worker poll busily, and
        on the encoders' cores they would take the time the encoders need. Its API server moves to
        the cores of a worker's front end once vLLM is up (``placement``), as our own workers'."""
        from epdserve.assets import default_model_dir

        model = Path(self.model) if self.model else default_model_dir()
        extra = {**self.vllm_ec_extra, **({"store_url": store_args[1]} if store_args else {})}
        port = self._free_port()
        served = self.served_model_name or model.name
        cmd = serve_command(self.vllm, str(model), served, INTERNAL_HOST, port, extra, self.vllm_args)
        engine, front = plan.engines.get(name), plan.roles.get(name)
        env = vllm_cpu_binding(engine, self.vllm_args)
        placed = (front, f"http://{http_host(INTERNAL_HOST)}:{port}") if engine and front else None
        args = wrapper_args(name, cmd, self.log_json, placed)
        return self._launch(name, args, port, engine or front, module=WRAPPER, env=env)

    def supervise(self) -> None:
        """Restart roles that die, until ``request_stop``."""
        supervisor = Supervisor(self.roles, self.restart, self._say)
        while not self.stop_signal:
            self._check_public_port()  # lost to a racing ``up`` whose server answered in our place
            supervisor.check()
            time.sleep(self.restart.poll_s)

    def kill(self) -> None:
        """SIGKILL every role's process group now (the answer to a second stop signal)."""
        for r in self.roles:
            r.kill_group(signal.SIGKILL)

    def stop(self) -> None:
        self.stopping = True
        # the router first, on its own: as it closes it gives the encoders back the leases of its
        # last requests, which needs them up (for at most half the grace); then the workers behind
        # it, together (SIGTERM lets each close its EC producer)
        roles = list(reversed(self.roles))
        front = [r for r in roles if r.name == "router"]
        start = time.monotonic()
        for group, grace in ((front, STOP_TIMEOUT_S / 2), ([r for r in roles if r not in front], STOP_TIMEOUT_S)):
            for r in group:
                if r.proc.poll() is None:
                    r.kill_group(signal.SIGTERM)
            for r in group:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    r.proc.wait(timeout=max(0.0, start + grace - time.monotonic()))
        for r in roles:
            r.kill_group(signal.SIGKILL)  # a role past its grace, and anything a role left in its group
            r.proc.wait()
        # the roles' own slabs (an encoder's) and their engine cores' (a prefill worker's KV slab,
        # named by its instance: the core's pid is not the role's)
        instances = {f"{r.name.rstrip('0123456789')}-{r.url.rsplit(':', 1)[1]}" for r in roles}
        remove_slabs_of({pid for r in roles for pid in r.pids}, instances=instances)
        if self.fs_dir is not None:
            shutil.rmtree(self.fs_dir, ignore_errors=True)
            self.fs_dir = None
        if self.board is not None:
            self.board.unlink(missing_ok=True)
            self.board = None
        if self.master is not None:  # after its members: they leave it cleanly
            self.master.stop()
            self.master = None
        self.roles = []


def remove_slabs_of(
    pids: Collection[int], shm_dir: Path = Path("/dev/shm"), instances: Collection[str] = ()
) -> list[Path]:
    """Unlink the slabs these (now dead) processes left: a slab named with one of their pids, or
    with one of their instance names, whose exclusive flock nobody holds (a live producer always
    holds its own)."""
    if not shm_dir.is_dir() or not any(shm_dir.glob("epd-ec-*")):
        return []
    from epdserve.transfer.shm_slab import remove_stale_slabs  # imports numpy: only when there is a slab

    return remove_stale_slabs(shm_dir, pids, instances)


def run_up(deployment: Deployment) -> int:
    """Start, print the URL, keep the roles running until SIGINT/SIGTERM/SIGHUP, stop everything.
    A signal stops at any time, start-up included; a second one while stopping kills at once."""

    def on_signal(signum: int, frame: object) -> None:
        if deployment.stopping:
            deployment.kill()
        else:
            deployment.request_stop(signum)

    previous = {s: signal.signal(s, on_signal) for s in STOP_SIGNALS}
    warning = open_api_warning(deployment.host, deployment.api_key)
    if warning is not None:
        print(f"epdserve up: {warning}", file=sys.stderr, flush=True)
    try:
        try:
            deployment.start()
        except Cancelled:
            return 0
        except (PortInUseError, TooLargeError, VllmNotFound) as e:
            deployment.line(str(e), "ERROR")
            return 2
        except StartupError as e:
            deployment.line(f"{e}; stopped everything", "ERROR")
            return 1
        deployment.line(
            f"{describe_deployment(deployment)} ready in {deployment.startup_s:.1f}s at {deployment.url}/v1  (Ctrl-C to stop)",
            out=sys.stdout,
            event="ready",
            url=deployment.url + "/v1",
        )
        try:
            deployment.supervise()
        except PortInUseError as e:
            deployment.line(str(e), "ERROR")
            return 2
        return 0
    finally:
        deployment.stop()
        for s, handler in previous.items():
            signal.signal(s, handler)


def describe_deployment(d: Deployment) -> str:
    """``describe`` of its topology, naming vLLM when it runs the language-model instances."""
    text = describe(d.topology)
    return text.replace("prefill/decode worker(s)", "vLLM instance(s)") if d.lm_engine == "vllm" else text
