"""Keep a deployment's roles running: a role process that dies is started again with the same
command line (so on the same port, where the router's health probe finds it again), after an
exponential back-off, without waiting for its health so the other roles stay supervised.

Back-off of one role (``RestartPolicy`` defaults)::

    died -> 0.5 s -> restart 1 -> died -> 1 s -> restart 2 -> ... -> 8 s -> 10 s -> 10 s ...
    up for 30 s before it died: counted as stable, the next restart waits 0.5 s again
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from epdserve.launcher import start_role


@dataclass(frozen=True)
class RestartPolicy:
    """How a dead role is restarted."""

    first_delay_s: float = 0.5  # wait before restarting a role that died after being stable
    max_delay_s: float = 10.0  # the wait doubles with each consecutive restart, up to this
    stable_after_s: float = 30.0  # a role that ran this long before dying starts the back-off afresh
    poll_s: float = 0.2  # how often the supervisor looks at the roles

    def __post_init__(self) -> None:
        if not 0 < self.first_delay_s <= self.max_delay_s:
            raise ValueError("need 0 < first_delay_s <= max_delay_s")
        if self.stable_after_s <= 0 or self.poll_s <= 0:
            raise ValueError("stable_after_s and poll_s must be positive")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the ``attempt``-th consecutive restart (1-based)."""
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (attempt - 1))


@dataclass
class Role:
    """One role: how to start its process, the process now, and its restart state."""

    name: str
    url: str
    args: list[str]  # ``epdserve`` arguments, port included: a restart reuses them unchanged
    cpus: list[int] | None = None
    log: str | None = None  # the role's log file (None: its stderr is ours)
    env: dict[str, str | None] = field(default_factory=dict)  # added to ours; None removes a variable
    module: str = "epdserve.cli"  # what ``args`` are for (``python -m module args``)
    proc: subprocess.Popen = field(init=False, repr=False)
    started_at: float = 0.0  # time.monotonic() of the latest start
    attempt: int = 0  # consecutive restarts since the role last counted as stable
    restart_at: float | None = None  # when a dead role is due to start again (None: not dead)
    pids: list[int] = field(default_factory=list)  # every pid the role has had (for slab cleanup)

    @property
    def kind(self) -> str:
        """The role its ``/health`` names: its name without the index (``encoder0``: ``encoder``);
        the aggregated server is a ``pd``."""
        kind = self.name.rstrip("0123456789")
        return "pd" if kind == "serve" else kind

    def launch(self) -> None:
        self.proc = start_role(self.args, self.cpus, self.log, self.env, self.module)
        self.started_at = time.monotonic()
        self.pids.append(self.proc.pid)

    def kill_group(self, sig: int = signal.SIGKILL) -> None:
        """Signal the role's process group (the role and anything it started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-returncode).name}"
    return f"code {returncode}"


class Supervisor:
    """Restarts dead roles; ``check`` is one non-blocking pass, called every ``policy.poll_s``."""

    def __init__(self, roles: list[Role], policy: RestartPolicy, say: Callable[[str], None]) -> None:
        self.roles = roles
        self.policy = policy
        self.say = say

    def check(self, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for role in self.roles:
            if role.restart_at is None:
                self._notice_death(role, now)
            elif now >= role.restart_at:
                self._restart(role, now)

    def _notice_death(self, role: Role, now: float) -> None:
        code = role.proc.poll()
        if code is None:
            return
        role.kill_group()  # helpers it left behind could hold its port or memory
        if now - role.started_at >= self.policy.stable_after_s:
            role.attempt = 0
        role.attempt += 1
        delay = self.policy.delay(role.attempt)
        role.restart_at = now + delay
        self.say(f"{role.name} (pid {role.proc.pid}) exited with {exit_reason(code)}; restarting in {delay:.1f}s")

    def _restart(self, role: Role, now: float) -> None:
        role.restart_at = None
        try:
            role.launch()
        except OSError as e:  # e.g. out of processes: try again after the next back-off step
            role.attempt += 1
            role.restart_at = now + self.policy.delay(role.attempt)
            self.say(f"could not restart {role.name}: {e}")
            return
        self.say(f"restarted {role.name} (attempt {role.attempt}): pid {role.proc.pid} at {role.url}")
