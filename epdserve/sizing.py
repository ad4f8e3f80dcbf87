"""Whether a topology fits this machine, checked before ``up`` starts anything.

Each role is counted by the account it checks itself against at start-up (``epdserve.memory``:
weights, activations, the vision tower's peak, the embedding slab, the encoder cache, the KV
cache, what its connector holds; the router's bodies and media, ``router.memory``), under the
settings ``up`` hands it, plus what each role process holds before any of that (``PROCESS_BYTES``:
the interpreter with torch and its libraries, which a role's own check finds already spent; the
router, without torch, ``ROUTER_PROCESS_BYTES``); the sum is held against the memory the kernel
calls available. The model processes (encoders and language-model engines) are held against the
cores.

Counting a role's weights builds its model on torch's meta device, and ``up`` (the supervisor)
stays free of torch: the accounts are made in a child process (``python -m epdserve.sizing``,
settings in, accounts out as JSON), the same code the roles and ``epdserve plan --memory`` run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from epdserve.launcher import python_module
from epdserve.memory import MemoryBudgetError, RoleMemory, available_memory

if TYPE_CHECKING:
    from epdserve.encoder.config import EncoderConfig
    from epdserve.engine.config import EngineConfig
    from epdserve.router.frontend_decode import FrontendDecodeConfig
    from epdserve.transfer.config import ECConfig

# a role process with torch and its libraries loaded, before any weights or caches
PROCESS_BYTES = 512 << 20
ROUTER_PROCESS_BYTES = 128 << 20  # the router's: the interpreter, aiohttp, numpy and Pillow
# model processes per core beyond which each gets too little CPU to load in time and to serve
MAX_PROCESSES_PER_CORE = 4
ACCOUNT_TIMEOUT_S = 300  # the child imports torch and builds the model on the meta device


class TooLargeError(ValueError):
    """The topology does not fit this machine (override with ``--force``)."""


@dataclass(frozen=True)
class Settings:
    """What sizes the roles ``up`` starts: the flags it hands them (field name -> value); a role's
    own config supplies the rest, as it does when the role starts."""

    engine: dict[str, object] = field(default_factory=dict)  # EngineConfig fields of the language-model roles
    encoder: dict[str, object] = field(default_factory=dict)  # EncoderConfig fields of the encoders
    router: dict[str, object] = field(default_factory=dict)  # FrontendDecodeConfig fields of the router
    ec_connector: str = "shm"  # the encoders' EC connector
    kv_connector: str = "shm"  # the prefill instances' KV connector


@dataclass(frozen=True)
class RoleSize:
    count: int
    memory: RoleMemory  # one instance's account

    @property
    def each(self) -> int:
        """One instance: its account and its process."""
        return self.memory.total + (ROUTER_PROCESS_BYTES if self.memory.role == "router" else PROCESS_BYTES)

    @property
    def bytes(self) -> int:
        return self.count * self.each


@dataclass(frozen=True)
class Fit:
    roles: tuple[RoleSize, ...]
    available_bytes: int  # MemAvailable
    cores: int  # cores this process may run on
    processes: int  # model processes (encoders, language-model engines)

    @property
    def need_bytes(self) -> int:
        return sum(r.bytes for r in self.roles)

    def problems(self) -> list[str]:
        out = []
        if self.need_bytes > self.available_bytes:
            parts = ", ".join(f"{r.count} {r.memory.role} x {gib(r.each)}" for r in self.roles)
            out.append(f"needs about {gib(self.need_bytes)} of memory ({parts}), {gib(self.available_bytes)} available")
        if self.processes > MAX_PROCESSES_PER_CORE * self.cores:
            out.append(
                f"runs {self.processes} model processes on {self.cores} core(s) "
                f"(at most {MAX_PROCESSES_PER_CORE} per core)"
            )
        return out


def gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


# a role to account: ("encoder", None), ("router", None), or a language-model role ("pd",
# "prefill", "decode") and whether it loads the vision tower
Wanted = tuple[str, bool | None]


@dataclass(frozen=True)
class Roles:
    """The configs of the roles ``up`` starts, as ``accounts`` reads them."""

    engine: EngineConfig
    encoder: EncoderConfig
    frontend: FrontendDecodeConfig  # the router's own media decoding
    kv: ECConfig  # a prefill instance's KV connector


def accounts(model_dir: Path, roles: Roles, wanted: list[Wanted], free: int) -> list[RoleMemory]:
    """The start-up account of each role of ``wanted``; ``free``: the memory a ``--memory-fraction``
    takes its share of. Imports torch: ``up`` calls ``accounts_apart``."""
    from epdserve.engine.memory import fused_attention
    from epdserve.memory import account_encoder, account_engine
    from epdserve.router.memory import account_router
    from epdserve.transfer.factory import producer_bytes

    engine, encoder = roles.engine, roles.encoder
    fused = fused_attention(model_dir, engine)
    out = []
    for role, vision in wanted:
        if role == "router":
            out.append(account_router(model_dir, engine.max_inflight_body_bytes, roles.frontend))
        elif vision is None:
            out.append(
                account_encoder(
                    model_dir,
                    encoder.dtype,
                    encoder.encode_token_budget,
                    encoder.encoder_cache_bytes,
                    encoder.max_pending_media_bytes,
                    encoder.max_inflight_body_bytes,
                    producer_bytes(encoder.ec),
                )
            )
        else:
            connector = producer_bytes(roles.kv) if role == "prefill" else 0
            out.append(account_engine(model_dir, engine, role, vision, fused, free, connector))
    return out


def accounts_here(model_dir: Path, settings: Settings, wanted: list[Wanted], free: int) -> list[RoleMemory]:
    """``accounts`` under ``settings``, in this process (MemoryBudgetError: also for settings a
    role's config refuses, or a connector's slab that would not fit)."""
    from epdserve.encoder.config import EncoderConfig
    from epdserve.engine.config import EngineConfig
    from epdserve.router.frontend_decode import FrontendDecodeConfig
    from epdserve.transfer.base import TransferError
    from epdserve.transfer.config import ECConfig

    try:
        ec = ECConfig(connector=settings.ec_connector)  # type: ignore[arg-type]
        roles = Roles(
            engine=EngineConfig(**settings.engine),  # type: ignore[arg-type]
            encoder=EncoderConfig(model=model_dir, ec=ec, **settings.encoder),  # type: ignore[arg-type]
            frontend=FrontendDecodeConfig(**settings.router),  # type: ignore[arg-type]
            kv=ECConfig(connector=settings.kv_connector),  # type: ignore[arg-type]
        )
    except ValueError as e:
        raise MemoryBudgetError(str(e)) from None
    try:
        return accounts(model_dir, roles, wanted, free)
    except TransferError as e:  # a slab /dev/shm cannot hold
        raise MemoryBudgetError(str(e)) from None


def accounts_apart(model_dir: Path, settings: Settings, wanted: list[Wanted], free: int) -> list[RoleMemory]:
    """``accounts`` made in a child process; MemoryBudgetError with the child's message when a role
    would refuse to start (its settings, or its memory); ValueError when the child fails."""
    request: dict[str, object] = {"model": str(model_dir), "settings": dataclasses.asdict(settings)}
    request |= {"wanted": wanted, "free": free}
    done = subprocess.run(
        python_module("epdserve.sizing"),
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=ACCOUNT_TIMEOUT_S,
    )
    if done.returncode != 0:
        raise ValueError(f"could not account the roles' memory: {done.stderr.strip()[-2000:]}")
    answer = json.loads(done.stdout)
    if "error" in answer:
        raise MemoryBudgetError(answer["error"])
    return [RoleMemory(**m) for m in answer["accounts"]]


Accountant = Callable[[Path, Settings, list[Wanted], int], list[RoleMemory]]


def check_fit(
    model_dir: Path,
    settings: Settings,
    encoders: int,
    workers: dict[str, int],
    vision: bool,
    account: Accountant = accounts_apart,
    router: bool = False,
) -> Fit:
    """The topology against this machine; ``TooLargeError`` with the numbers when it does not fit.
    ``workers``: instances of each language-model role ("pd", "prefill", "decode"); ``vision``:
    whether they load the vision tower (they encode media themselves); ``router``: whether a router
    fronts them; ``account``: where the accounts are made (``accounts_here`` where torch is welcome)."""
    free = available_memory()
    kinds = [(role, n) for role, n in workers.items() if n]
    wanted: list[Wanted] = [*([("encoder", None)] if encoders else []), *((role, vision) for role, _ in kinds)]
    wanted += [("router", None)] if router else []
    try:
        found = account(model_dir, settings, wanted, free)
    except MemoryBudgetError as e:
        raise TooLargeError(f"a role of this topology would refuse to start: {e}; or pass --force") from None
    counts = [encoders] * bool(encoders) + [n for _, n in kinds] + [1] * router
    roles = tuple(RoleSize(n, m) for n, m in zip(counts, found, strict=True))
    processes = encoders + sum(workers.values())
    fit = Fit(roles, free, len(os.sched_getaffinity(0)), processes)
    problems = fit.problems()
    if problems:
        raise TooLargeError(
            "this topology " + "; it ".join(problems) + ": choose a smaller one (or smaller caches), or pass --force"
        )
    return fit


def describe(fit: Fit) -> str:
    """The line ``up`` says when the topology fits."""
    each = "; ".join(r.memory.line() for r in fit.roles)
    return (
        f"fits: about {gib(fit.need_bytes)} of {gib(fit.available_bytes)} available memory "
        f"(with {gib(PROCESS_BYTES)} per model process for the interpreter and torch), "
        f"{fit.processes} model process(es) on {fit.cores} core(s) ({each})"
    )


def main() -> int:
    """The child of ``accounts_apart``: the request on stdin, the accounts on stdout."""
    request = json.loads(sys.stdin.read())
    settings = Settings(**request["settings"])
    wanted = [(role, vision) for role, vision in request["wanted"]]
    try:
        found = accounts_here(Path(request["model"]), settings, wanted, request["free"])
    except MemoryBudgetError as e:
        print(json.dumps({"error": str(e)}))
        return 0
    print(json.dumps({"accounts": [dataclasses.asdict(m) for m in found]}))
    return 0


__all__ = [
    "Fit",
    "RoleSize",
    "Settings",
    "TooLargeError",
    "accounts",
    "accounts_apart",
    "accounts_here",
    "check_fit",
    "describe",
]

if __name__ == "__main__":
    raise SystemExit(main())
