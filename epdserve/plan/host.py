"""``epdserve plan --memory``: how many instances of each role fit on a host, by memory and by
cores, from the same account a role checks at start-up (``epdserve.memory``).

Every role counts one core at least (``up --pin-cores`` pins each to cores of its own), so the
instances that fit are the fewer of ``host memory // role memory`` and ``host cores``. The fused
CPU kernels are taken to attend where they support the dtype and head size (no decode mirror)
unless ``--kernels torch``, as a role decides at start-up.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from epdserve.common.units import format_bytes, parse_bytes
from epdserve.engine.config import EngineConfig
from epdserve.memory import MemoryBudgetError, RoleMemory, host_cores, host_memory
from epdserve.sizing import Roles, Wanted, accounts
from epdserve.topology import Topology


@dataclass(frozen=True)
class RoleFit:
    """One role's account on the host and how many of it fit."""

    name: str  # what the role is, as `epdserve up` starts it
    memory: RoleMemory
    by_memory: int  # instances the host's memory holds
    by_cores: int  # instances the host's cores hold

    @property
    def instances(self) -> int:
        return min(self.by_memory, self.by_cores)


# what plan --memory shows, as (role, whether it loads the vision tower; None: an encoder or router)
ROLES: dict[str, Wanted] = {
    "pd (vision tower)": ("pd", True),
    "pd (no vision tower)": ("pd", False),
    "prefill": ("prefill", True),
    "decode": ("decode", False),
    "encoder": ("encoder", None),
    "router": ("router", None),
}


def roles(model_dir: Path, engine: EngineConfig) -> dict[str, RoleMemory]:
    """The account of every role of a deployment of ``model_dir`` under ``engine`` (encoders: in
    its dtype and with its bounds of pending media and bodies, as ``up`` hands them on, otherwise
    their defaults; connectors: ``up``'s, shm, the slab sized by this machine's /dev/shm): the one
    ``up`` sums and each role checks at start-up."""
    from epdserve.encoder.config import EncoderConfig
    from epdserve.router.frontend_decode import FrontendDecodeConfig
    from epdserve.transfer.config import ECConfig

    encoder = EncoderConfig(
        model=model_dir,
        dtype=engine.dtype,
        max_pending_media_bytes=engine.max_pending_media_bytes,
        max_inflight_body_bytes=engine.max_inflight_body_bytes,
    )
    deployment = Roles(engine, encoder, FrontendDecodeConfig(), ECConfig())
    found = accounts(model_dir, deployment, list(ROLES.values()), 0)
    return dict(zip(ROLES, found, strict=True))


def fit(accounts: dict[str, RoleMemory], memory: int, cores: int) -> list[RoleFit]:
    return [RoleFit(name, m, memory // m.total if m.total else 0, cores) for name, m in accounts.items()]


def topology_memory(topology: Topology, accounts: dict[str, RoleMemory]) -> int:
    """Bytes of a whole topology: its encoders, PD workers (with the vision tower when aggregated),
    prefill and decode workers, and the router in front of a split one."""
    pd = accounts["pd (vision tower)"]
    return (
        topology.encoders * accounts["encoder"].total
        + topology.pds * pd.total
        + topology.prefills * accounts["prefill"].total
        + topology.decodes * accounts["decode"].total
        + (0 if topology.aggregated else accounts["router"].total)
    )


def format_fit(fits: list[RoleFit], memory: int, cores: int) -> str:
    lines = [f"host: {format_bytes(memory)}, {cores} cores"]
    width = max(len(f.name) for f in fits)
    for f in fits:
        lines.append(
            f"  {f.name:<{width}}  {format_bytes(f.memory.total):>11} each  ->  {f.instances} instances "
            f"(memory {f.by_memory}, cores {f.by_cores})"
        )
        lines.append(f"  {'':<{width}}  {f.memory.line()}")
    return "\n".join(lines)


def add_cli_flags(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("host memory (with --model)")
    g.add_argument("--memory", action="store_true", help="print each role's memory and how many fit on the host")
    g.add_argument(
        "--host-memory", type=parse_bytes, default=None, help="bytes of the host, e.g. 64GiB (default: this machine's)"
    )
    g.add_argument("--host-cores", type=int, default=None, help="cores of the host (default: this machine's)")


def host_of(args: argparse.Namespace) -> tuple[int, int]:
    """(memory, cores) of the host the flags describe, this machine where not given."""
    return args.host_memory or host_memory(), args.host_cores or host_cores()


def run_memory(args: argparse.Namespace, engine: EngineConfig) -> int:
    """``epdserve plan --memory``: the table; exit status 1 when some role fits not even once."""
    if not args.model:
        raise ValueError("--memory needs --model (the checkpoint directory)")
    memory, cores = host_of(args)
    try:
        fits = fit(roles(Path(args.model), engine), memory, cores)
    except MemoryBudgetError as e:
        print(f"error: {e}")
        return 1
    print(format_fit(fits, memory, cores))
    return 0 if all(f.instances for f in fits) else 1
