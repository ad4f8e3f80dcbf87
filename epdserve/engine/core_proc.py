"""The engine core process: ``python -m epdserve.engine.core_proc <fd> <parent pid>``.

Started by ``MPClient`` with one end of a private socket pair. It reads ``CoreStart``, loads the
model, answers ``CoreReady`` (or ``CoreFailed``), then loops: a reader thread moves incoming
messages to an inbox, the main thread drains it, steps the engine and sends each step's outputs.
It exits when told to, when the channel closes, or when its parent dies (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import sys
import threading

from epdserve.allocator import FreeMemoryReturner, keep_freed_memory
from epdserve.common import logs
from epdserve.engine.config import cpu_list
from epdserve.engine.core import EngineCore
from epdserve.engine.loop import StepLoop
from epdserve.engine.memory import MemoryBudgetError
from epdserve.engine.messages import (
    Channel,
    ChannelClosed,
    CoreFailed,
    CoreStart,
    Outputs,
    Shutdown,
    StatsRequest,
    ToCore,
)

log = logging.getLogger("epdserve.engine.core")
PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """SIGKILL this process when the front end dies (its stream never ends otherwise)."""
    # not Linux: the closed channel still ends the process
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


class CoreLoop:
    """The core's ``StepLoop`` fed by a reader thread from the channel; outputs go back on it."""

    def __init__(self, channel: Channel, core: EngineCore) -> None:
        self.channel = channel
        self.core = core
        self.steps = StepLoop(core, lambda outputs: channel.send(Outputs(outputs)), self._other)

    def _other(self, msg: ToCore) -> bool:
        if isinstance(msg, StatsRequest):
            self.channel.send(self.core.stats(msg.digest))
            return True
        return not isinstance(msg, Shutdown)

    def _read(self) -> None:
        try:
            while True:
                msg = self.channel.recv()
                self.steps.post(msg)
                if isinstance(msg, Shutdown):
                    return
        except (ChannelClosed, OSError, ValueError) as e:
            log.info("engine core channel closed: %s", e)
        self.steps.stop()

    def run(self) -> None:
        threading.Thread(target=self._read, name="epd-core-reader", daemon=True).start()
        self.steps.run()


def _pin(cpus: str) -> None:
    """Run every thread of this process (and those it starts) on ``cpus``."""
    cores = cpu_list(cpus)
    if not cores:
        return
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that just ended
            os.sched_setaffinity(int(task), cores)


def main(argv: list[str]) -> int:
    fd, parent = int(argv[0]), int(argv[1])
    keep_freed_memory()
    _die_with(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when the core stops
    fmt = os.environ.get(logs.LOG_FORMAT_ENV, "text")
    logs.setup("json" if fmt == "json" else "text", prefix="[core] ")
    channel = Channel(socket.socket(fileno=fd), ToCore)
    try:
        start = channel.recv()
    except ChannelClosed:
        return 1
    if not isinstance(start, CoreStart):
        channel.send(CoreFailed(f"expected a start message, got {type(start).__name__}"))
        return 1
    try:
        _pin(start.engine.cpus)
        # what loading and each step's buffers leave free in the heap goes back to the kernel
        FreeMemoryReturner().start()
        import torch

        if start.engine.threads:
            torch.set_num_threads(start.engine.threads)
        core = EngineCore.from_pretrained(
            start.model, start.engine, start.vision, start.ec, start.model_id, role=start.role, kv=start.kv
        )
    except MemoryBudgetError as e:  # its message names every figure: no traceback to read
        log.error("%s", e)
        channel.send(CoreFailed(f"{type(e).__name__}: {e}"))
        return 1
    except Exception as e:  # a bad checkpoint or device must reach the server as a clear message
        log.exception("engine core failed to start")
        channel.send(CoreFailed(f"{type(e).__name__}: {e}"))
        return 1
    torch.set_num_threads(core.threads)
    channel.send(core.ready())
    try:
        CoreLoop(channel, core).run()
    except (ChannelClosed, OSError) as e:
        log.info("engine core stops: %s", e)
    finally:
        core.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
