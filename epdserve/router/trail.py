"""One request's stage timing as the router sees it (``api.timing``): its own encode time, what
the encoders reported for each item, how each item was obtained, and the ``Server-Timing`` values
of the workers that served it, merged into the header a client that asked for it gets."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TypeVar

from aiohttp import web

from epdserve.api.logs import REQUEST_ID_HEADER
from epdserve.api.timing import SERVER_TIMING, TIMING_HEADER, server_timing
from epdserve.router.refs import MediaRef

ENCODER_STAGES = {  # the encoders' ItemTimings field of each stage
    "encoder_fetch": "fetch_ms",
    "encoder_preprocess": "preprocess_ms",
    "encoder_queue": "queue_ms",
    "encoder_compute": "encode_ms",
    "encoder_put": "put_ms",
}
ROUTER_STAGES = ("router_encode", "router_decode", *ENCODER_STAGES)  # router_decode: part of router_encode
R = TypeVar("R", bound=web.StreamResponse)


@dataclass
class Trail:
    wanted: bool  # the client asked for Server-Timing
    request_id: str = ""  # passed to the workers (their access lines carry it)
    stages: dict[str, float] = field(default_factory=dict)
    media: Counter[str] = field(default_factory=Counter)
    workers: list[str] = field(default_factory=list)  # the workers' Server-Timing values
    ran_on: list[str] = field(default_factory=list)  # the workers that answered (for the access line)
    kind: str = ""  # the request's kind (api.protocol.RequestKind), once validated
    t0: float = field(default_factory=time.perf_counter)  # when the router received it
    # the caller is the operator (api.exposure): it may see how each item was obtained and the
    # encoders' stages, which tell whether someone else sent the same media recently
    details: bool = False

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    def add_media(self, refs: list[MediaRef]) -> None:
        """The items' origins, and the encoders' stages (the slowest item of each) of those encoded."""
        for r in refs:
            if r.raw:
                self.media["raw"] += 1
            if r.decode_s:  # frontend decode: the slowest item's fetch and decode in the router
                self.stages["router_decode"] = max(self.stages.get("router_decode", 0.0), r.decode_s)
            if r.result is None:
                continue
            if r.skipped:
                self.media["skipped"] += 1
            elif r.from_directory:
                self.media["directory"] += 1
            else:
                self.media[r.result.status] += 1
                for stage, name in ENCODER_STAGES.items():
                    ms = getattr(r.result.timings, name)
                    self.stages[stage] = max(self.stages.get(stage, 0.0), ms / 1e3)

    def ask(self) -> dict[str, str]:
        """Headers for a worker's call: the request's id, and the ask for its stages (when the
        client asked for them)."""
        headers = {REQUEST_ID_HEADER: self.request_id} if self.request_id else {}
        return {**headers, TIMING_HEADER: "1"} if self.wanted else headers

    def stamp(self, resp: R) -> R:
        """``resp`` with the ``Server-Timing`` header, if the client asked (before it is prepared)."""
        if self.wanted:
            resp.headers[SERVER_TIMING] = self.header()
        return resp

    def header(self) -> str:
        if not self.details:  # the request's own language-model stages only
            return ", ".join(v for v in self.workers if v)
        desc = {"media": ", ".join(f"{n} {how}" for how, n in sorted(self.media.items()))} if self.media else {}
        return ", ".join(v for v in (server_timing(self.stages, desc), *self.workers) if v)
