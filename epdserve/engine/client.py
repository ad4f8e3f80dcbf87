"""How a front end talks to an engine core: one interface, in-process or in its own process.

``EngineCoreClient.generate(add)`` is an async stream of ``EngineOutput`` for one request; closing
the stream early aborts the request in the core. ``InprocClient`` steps the core in a thread of
this process (tests, tools); ``MPClient`` runs it in a child process (``core_proc``) so scheduling
and the model never share a GIL with HTTP, JSON and SSE. If the core process dies, every open
stream ends with an error output, ``healthy`` turns False and ``on_death`` is called once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Protocol

import msgspec

from epdserve.engine.config import cpu_list
from epdserve.engine.messages import (
    FRAME_HEADER,
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreReady,
    CoreStart,
    EngineOutput,
    EngineStats,
    FromCore,
    Outputs,
    ReleaseHandles,
    Shutdown,
    StatsRequest,
    frame,
    frame_length,
)
from epdserve.launcher import python_module

if TYPE_CHECKING:
    from epdserve.engine.core import EngineCore

log = logging.getLogger(__name__)


class CoreStartError(RuntimeError):
    """The engine core could not start (its message says why)."""


class EngineCoreClient(Protocol):
    async def start(self) -> None:
        """Start the core and wait until it is ready to take requests."""
        ...

    def generate(self, add: AddRequest) -> AsyncIterator[EngineOutput]:
        """The request's outputs until one is finished; closing early aborts it."""
        ...

    async def stats(self, digest: bool = False) -> EngineStats:
        """Counters of the core (``digest``: with its prefix cache's block hashes)."""
        ...

    def release(self, handles: list[dict], kv_handles: list[dict] | None = None) -> None:
        """Give back EC leases (and KV leases) that no request here will read."""
        ...

    @property
    def healthy(self) -> bool: ...

    @property
    def vision(self) -> bool:
        """The core holds a vision tower."""
        ...

    async def close(self) -> None: ...


def _died(request_id: str, why: str) -> EngineOutput:
    return EngineOutput(request_id, [], finish_reason="error", error=why, error_kind="internal")


class _Streams:
    """Per-request output queues of the front end, filled from outputs as they arrive."""

    def __init__(self) -> None:
        self.queues: dict[str, asyncio.Queue[EngineOutput]] = {}

    def open(self, request_id: str) -> asyncio.Queue[EngineOutput]:
        if request_id in self.queues:
            raise ValueError(f"duplicate request id {request_id}")
        q: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.queues[request_id] = q
        return q

    def deliver(self, outputs: list[EngineOutput]) -> None:
        for out in outputs:
            q = self.queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def fail_all(self, why: str) -> None:
        for rid, q in list(self.queues.items()):
            q.put_nowait(_died(rid, why))

    async def stream(
        self, request_id: str, q: asyncio.Queue[EngineOutput], abort: Callable[[str], None]
    ) -> AsyncIterator[EngineOutput]:
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            self.queues.pop(request_id, None)
            if not finished:  # the consumer left: free the request's blocks
                abort(request_id)


# ---------------------------------------------------------------------------- in-process


class InprocClient:
    """Steps an ``EngineCore`` in a thread of this process."""

    def __init__(self, core: EngineCore) -> None:
        from epdserve.engine.loop import StepLoop

        self.core = core
        self.ready = core.ready()
        self._streams = _Streams()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._steps = StepLoop(core, self._deliver)
        self._thread = threading.Thread(target=self._run, name="epd-engine", daemon=True)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive()

    @property
    def vision(self) -> bool:
        return self.core.vision

    async def stats(self, digest: bool = False) -> EngineStats:
        return self.core.stats(digest)

    def release(self, handles: list[dict], kv_handles: list[dict] | None = None) -> None:
        self._steps.post(ReleaseHandles(handles, kv_handles or []))

    def generate(self, add: AddRequest) -> AsyncIterator[EngineOutput]:
        q = self._streams.open(add.request_id)
        self._steps.post(add)
        return self._streams.stream(add.request_id, q, lambda rid: self._steps.post(AbortRequests([rid])))

    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.core.threads)
        self._steps.run()

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._streams.deliver, outputs)

    async def close(self) -> None:
        self._steps.stop()
        if self._thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join, 10)
        self.core.close()


# ---------------------------------------------------------------------------- multiprocess


class MPClient:
    """Runs the engine core in a child process (``python -m epdserve.engine.core_proc``) and talks
    to it over a private socket pair: no port, no path, nothing another process can reach."""

    def __init__(
        self, start: CoreStart, ready_timeout_s: float = 600.0, on_death: Callable[[str], None] | None = None
    ) -> None:
        self._start_msg = start
        self._ready_timeout_s = ready_timeout_s
        self.on_death = on_death
        self._streams = _Streams()
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(FromCore)
        self._stats: list[asyncio.Future[EngineStats]] = []
        self._proc: subprocess.Popen | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self._task: asyncio.Task | None = None
        self._healthy = False
        self._vision = False
        self.ready: CoreReady | None = None  # the core's ready message, once it came
        self._closing = False
        self._sock: socket.socket | None = None
        self.pid = 0

    @property
    def healthy(self) -> bool:
        return self._healthy

    @property
    def vision(self) -> bool:
        return self._vision

    def launch(self) -> None:
        """Start the core process now (it loads the model while this process does its own setup);
        ``start`` then waits for it. Call from the thread that lives as long as the core should."""
        if self._proc is not None:
            return
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        cmd = python_module("epdserve.engine.core_proc", str(theirs.fileno()), str(os.getpid()))
        self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.pid = self._proc.pid
        cores = cpu_list(self._start_msg.engine.cpus)
        if cores:  # now, before the child imports torch: its start-up must not compete with ours
            with contextlib.suppress(OSError):  # the core pins itself again, and reports what fails
                os.sched_setaffinity(self.pid, cores)
        # the start message can go at once: the core reads it as soon as it has imported
        self._sock.sendall(frame(self._enc, self._start_msg))

    async def start(self) -> None:
        self.launch()
        self._reader, self._writer = await asyncio.open_unix_connection(sock=self._sock, limit=1 << 20)
        try:
            msg = await asyncio.wait_for(self._recv(), self._ready_timeout_s)
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError) as e:
            await self._kill()
            raise CoreStartError(f"the engine core did not become ready: {type(e).__name__} {e}") from None
        if isinstance(msg, CoreFailed):
            await self._kill()
            raise CoreStartError(f"the engine core failed to start: {msg.message}")
        if not isinstance(msg, CoreReady):
            await self._kill()
            raise CoreStartError(f"the engine core answered {type(msg).__name__} instead of ready")
        self._vision = msg.vision
        self.ready = msg  # what the core runs, for the role's start-up line
        self._healthy = True
        self._task = asyncio.create_task(self._read_loop(), name="epd-core-reader")

    def _send(self, msg: msgspec.Struct) -> None:
        if self._writer is None or self._writer.is_closing():
            raise ConnectionError("the engine core channel is closed")
        self._writer.write(frame(self._enc, msg))

    async def _recv(self) -> FromCore:
        assert self._reader is not None
        n = frame_length(await self._reader.readexactly(FRAME_HEADER))
        return self._dec.decode(await self._reader.readexactly(n))

    async def _read_loop(self) -> None:
        why = "the engine core process exited"
        try:
            while True:
                msg = await self._recv()
                if isinstance(msg, Outputs):
                    self._streams.deliver(msg.outputs)
                elif isinstance(msg, EngineStats) and self._stats:
                    fut = self._stats.pop(0)
                    if not fut.done():
                        fut.set_result(msg)
        except (ConnectionError, asyncio.IncompleteReadError, msgspec.DecodeError, ValueError) as e:
            if not isinstance(e, asyncio.IncompleteReadError):
                why = f"the engine core channel failed: {e}"
        self._dead(why)

    def _dead(self, why: str) -> None:
        if not self._healthy:
            return
        self._healthy = False
        code = self._proc.poll() if self._proc is not None else None
        if code is not None:
            why = f"{why} (exit code {code})"
        if not self._closing:
            log.error("%s; failing %d open request(s)", why, len(self._streams.queues))
        self._streams.fail_all("The engine failed while serving this request.")
        for fut in self._stats:
            if not fut.done():
                fut.set_exception(ConnectionError(why))
        self._stats.clear()
        if self.on_death is not None and not self._closing:
            self.on_death(why)

    def generate(self, add: AddRequest) -> AsyncIterator[EngineOutput]:
        q = self._streams.open(add.request_id)
        if not self._healthy:
            q.put_nowait(_died(add.request_id, "The engine is not running."))
        else:
            self._send(add)
        return self._streams.stream(add.request_id, q, self._abort)

    def release(self, handles: list[dict], kv_handles: list[dict] | None = None) -> None:
        if self._healthy and (handles or kv_handles):
            with contextlib.suppress(ConnectionError):
                self._send(ReleaseHandles(handles, kv_handles or []))

    def _abort(self, request_id: str) -> None:
        if self._healthy:
            with contextlib.suppress(ConnectionError):
                self._send(AbortRequests([request_id]))

    async def stats(self, digest: bool = False) -> EngineStats:
        if not self._healthy:
            raise ConnectionError("the engine core is not running")
        fut: asyncio.Future[EngineStats] = asyncio.get_running_loop().create_future()
        self._stats.append(fut)
        self._send(StatsRequest(digest))
        return await asyncio.wait_for(fut, 10.0)

    async def close(self) -> None:
        self._closing = True
        if self._healthy:
            with contextlib.suppress(ConnectionError):
                self._send(Shutdown())
        await self._kill()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._healthy = False

    async def _kill(self, grace_s: float = 5.0) -> None:
        if self._writer is not None:
            self._writer.close()
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        deadline = time.monotonic() + grace_s
        while proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if proc.poll() is None:
            proc.kill()
            await asyncio.get_running_loop().run_in_executor(None, proc.wait)
