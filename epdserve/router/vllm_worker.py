"""A vLLM language-model worker behind the router: what it is sent, how its load is read, and how
it is told from an epdserve worker.

A vLLM worker running epdserve's EC connector (``epdserve.integrations.vllm``) takes each media
item as the client sent it plus the item's epdserve uuid, and the items' handles in the request's
``ec_transfer_params``: vLLM sizes the prompt from the media with its own processor and takes the
embeddings by handle instead of running its vision tower. Torch- and vLLM-free.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from epdserve.api.load import LoadReport
from epdserve.integrations.vllm.handles import ec_transfer_params
from epdserve.router.refs import MediaRef
from epdserve.transfer.cached import CACHED_HANDLE

# fields a client must not set on a vLLM worker: vLLM trusts a part's uuid for its caches, and the
# transfer parameters are the router's to give
_ROUTER_ONLY = ("ec_transfer_params", "kv_transfer_params")
RUNNING, WAITING, KV_USAGE = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"
MAX_METRICS_BYTES = 4 << 20  # one vLLM ``/metrics`` page (its histograms make it long)
MAX_COUNT = 1 << 30  # requests a worker may claim (a bound: the numbers come from a peer)


def vllm_body(body: dict[str, Any], refs: list[MediaRef]) -> dict[str, Any]:
    """A copy of the client's ``body`` for a vLLM worker: every media part as the client sent it,
    the encoded ones naming their epdserve uuid, their handles in ``ec_transfer_params``; a part
    left raw (or holding only a cached handle, which a vLLM worker cannot read) carries no uuid,
    so vLLM names it by its own content hash and encodes it."""
    out = {k: v for k, v in body.items() if k not in _ROUTER_ONLY}
    out["messages"] = copy.deepcopy(body["messages"])
    for part in _parts(out):
        part.pop("uuid", None)
    handles = []
    for r in refs:
        part = out["messages"][r.message]["content"][r.part]
        usable = r.result is not None and not r.raw and r.result.ec_handle.get("connector") != CACHED_HANDLE
        if usable:
            assert r.result is not None
            part["uuid"] = r.result.uuid
            handles.append(r.result.ec_handle)
    if handles:
        out["ec_transfer_params"] = ec_transfer_params(handles)
    return out


def as_sent(body: dict[str, Any]) -> bool:
    """Whether ``vllm_body(body, [])`` is ``body`` itself: no field that is the router's to set,
    no content part naming a uuid (a client's bytes may then go to vLLM as they came)."""
    return not any(k in body for k in _ROUTER_ONLY) and not any("uuid" in part for part in _parts(body))


def _parts(body: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every content part (a dict) of the body's messages."""
    for m in body.get("messages") or []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            yield from (part for part in content if isinstance(part, dict))


@dataclass(frozen=True)
class VllmLoad:
    """A vLLM worker's load, from its ``/metrics`` (requests summed over its engines, the KV
    cache usage their mean)."""

    running: float
    waiting: float
    kv_usage: float | None  # fraction of its KV cache in use (None: not exported)

    @property
    def outstanding(self) -> float:
        return self.running + self.waiting

    def report(self) -> LoadReport:
        """The load report an epdserve worker would give (``api.load``): its load ratio is the KV
        cache in use while nothing waits; requests waiting mean vLLM's batch is full, so then at
        least 1, plus the queue over the batch (vLLM does not export its ``max_num_seqs``). It
        holds a vision tower: media left raw is encoded there. Its costs are unmeasured (0)."""
        kv = self.kv_usage or 0.0
        ratio = kv if not self.waiting else max(1.0, kv) + self.waiting / max(1.0, self.running)
        return LoadReport(load_ratio=min(ratio, 1e5), vision=True, running=int(self.running), waiting=int(self.waiting))


def parse_vllm_load(text: str) -> VllmLoad:
    """The load in a vLLM ``/metrics`` page; ValueError when it has no request gauges (not vLLM)."""
    sums: dict[str, float] = {}
    engines: dict[str, int] = {}  # samples of each gauge: one per engine (data parallel)
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in (RUNNING, WAITING, KV_USAGE):
                    value = float(sample.value)
                    if not (math.isfinite(value) and 0 <= value <= MAX_COUNT):
                        raise ValueError(f"{sample.name} out of range: {value}")
                    sums[sample.name] = sums.get(sample.name, 0.0) + value
                    engines[sample.name] = engines.get(sample.name, 0) + 1
    except ValueError as e:
        raise ValueError(f"unreadable /metrics: {e}") from None
    if RUNNING not in sums or WAITING not in sums:
        raise ValueError("no vLLM request gauges in /metrics")
    kv = sums[KV_USAGE] / engines[KV_USAGE] if KV_USAGE in sums else None  # the engines' mean
    return VllmLoad(sums[RUNNING], sums[WAITING], None if kv is None else min(kv, 1.0))


def is_vllm_models(answer: object) -> bool:
    """Whether a worker's ``GET /v1/models`` answer is vLLM's: its model cards are owned by
    "vllm" (epdserve's by "epdserve"; both answer ``/version`` alike, so that cannot tell)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("data"), list) or not answer["data"]:
        return False
    return all(isinstance(card, dict) and card.get("owned_by") == "vllm" for card in answer["data"])
