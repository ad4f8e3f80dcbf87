"""The engine core's driving loop, shared by the in-process client and the core process.

Messages arrive on any thread (``post``); the loop's thread drains them between steps, steps
while there is work, sleeps when there is none (or only requests waiting for their embeddings,
until a fetch wakes it), and hands each batch of outputs to ``deliver``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from epdserve.engine.core import EngineCore
from epdserve.engine.messages import AbortRequests, AddRequest, EngineOutput, ReleaseHandles, ToCore


class StepLoop:
    def __init__(
        self,
        core: EngineCore,
        deliver: Callable[[list[EngineOutput]], None],
        other: Callable[[ToCore], bool] | None = None,
    ) -> None:
        """``other`` handles messages that are not requests (stats, shutdown); False stops the loop."""
        self.core = core
        self.deliver = deliver
        self.other = other
        self._cv = threading.Condition()
        self._inbox: list[tuple[float, ToCore]] = []  # (when it came, the message)
        self._stopped = False
        core._on_wake = self.wake

    def post(self, msg: ToCore) -> None:
        with self._cv:
            self._inbox.append((time.perf_counter(), msg))
            self._cv.notify()

    def wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify()

    def run(self) -> None:
        core = self.core
        while True:
            with self._cv:
                while not self._inbox and not core.has_work and not self._stopped:
                    self._cv.wait()
                if self._stopped:
                    return
                inbox, self._inbox = self._inbox, []
            outputs: list[EngineOutput] = []
            for received, msg in inbox:
                if isinstance(msg, AddRequest):
                    outputs += core.add(msg, received)
                elif isinstance(msg, AbortRequests):
                    for rid in msg.request_ids:
                        core.abort(rid)
                elif isinstance(msg, ReleaseHandles):
                    core.release_handles(msg.handles, msg.kv_handles)
                elif self.other is not None and not self.other(msg):
                    return
            if core.has_work:
                outputs += core.step()
                if core.last_step_idle:  # only requests waiting for their embeddings: sleep until woken
                    with self._cv:
                        self._cv.wait(0.05)
            if outputs:
                self.deliver(outputs)
