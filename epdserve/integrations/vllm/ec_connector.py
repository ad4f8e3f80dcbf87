"""A vLLM EC connector that takes media embeddings from epdserve's encoders by signed handle.

Load it on a vLLM language-model instance with::

    vllm serve MODEL --ec-transfer-config '{"ec_connector": "EpdserveECConnector",
        "ec_connector_module_path": "epdserve.integrations.vllm.ec_connector", "ec_role": "ec_consumer",
        "ec_connector_extra_config": {...VllmECConfig fields...}}'

One request's life (vLLM runs a scheduler-side and a worker-side instance of this class)::

    scheduler: ensure_cache_available(req)  first sight: match handles to items by key, verify and
               fetch each on the fetcher's thread (epdserve's own consumers) ── False while any is
               in flight
               has_cache_item(id)           True once the item's embeddings are here
               update_state_after_alloc     vLLM allotted the item's encoder-cache slot: ship it
               build_connector_meta         the step's items (tensors) travel to the worker
    worker:    start_load_caches            put them into vLLM's encoder cache; its vision tower
                                            is not run for them
    scheduler: request_finished             drop what the request held

A handle that does not verify, has expired, names other content or whose payload fails epdserve's
validation (model identity, rows = vLLM's placeholder count, width = the LM hidden size, dtype,
checksum) leaves ``has_cache_item`` False, so vLLM encodes that item itself; with
``local_encode: false`` the request is failed instead (``take_unavailable_requests``). Every lease
is released after its read, whether the read worked or not, and leases of items a cached prefix
covers are released unread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import vllm
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole
from vllm.logger import init_logger
from vllm.v1.request import Request

from epdserve.engine.embeddings import EmbeddingFetcher, Fetched
from epdserve.integrations.vllm import compat
from epdserve.integrations.vllm.config import VllmECConfig
from epdserve.integrations.vllm.handles import handles_by_key
from epdserve.transfer.base import InvalidHandle

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput

# under "vllm." so that vLLM's logging configuration shows the connector's lines
logger = init_logger("vllm.ec_transfer.epdserve")

# at import, i.e. while vLLM builds its scheduler: an incompatible vLLM stops at start-up
if not compat.check(vllm.__version__, ECConnectorBase, Request):
    logger.warning(
        "epdserve's EC connector is tested with vLLM %s.x; vLLM %s has the same interface",
        "/".join(compat.TESTED_VLLM),
        vllm.__version__,
    )


@dataclass
class EpdserveECMetadata(ECConnectorMetadata):
    """Scheduler → worker for one step: the embeddings to put into the encoder cache, by identifier."""

    items: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class _Pending:
    """What the scheduler side knows of one request."""

    fetching: dict[int, str] = field(default_factory=dict)  # item index -> identifier, read in flight
    held: set[str] = field(default_factory=set)  # identifiers whose embeddings this request holds here
    failed: str | None = None  # why the request cannot be served (local encoding forbidden)


class EpdserveECConnector(ECConnectorBase):
    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        if self.is_producer:
            raise ValueError("epdserve's EC connector is a consumer (ec_role ec_consumer): epdserve's encoders produce")
        transfer = vllm_config.ec_transfer_config
        assert transfer is not None  # the base class raised otherwise
        self.cfg = VllmECConfig.from_extra(transfer.ec_connector_extra_config)
        model = vllm_config.model_config
        self._dtype = model.dtype
        if role is ECConnectorRole.WORKER:
            return  # the worker side only loads what the scheduler side ships
        served = model.served_model_name
        self._model_id = self.cfg.model_id or (served[0] if isinstance(served, list) else served) or model.model
        self._width = int(model.hf_text_config.hidden_size)
        vision = getattr(model.hf_config, "vision_config", None)
        self._levels = 1 + len(getattr(vision, "deepstack_visual_indexes", None) or ())
        ec = self.cfg.ec_config()  # reads the secret now: a missing one stops the start
        self._lock = threading.Lock()
        self._done: list[Fetched] = []
        self._fetcher = EmbeddingFetcher(lambda: _consumer(ec), self._model_id, self._on_done, levels=self._levels)
        self._requests: dict[str, _Pending] = {}
        self._ready: dict[str, torch.Tensor] = {}  # identifier -> embeddings (model dtype), while held
        self._holders: dict[str, set[str]] = {}  # identifier -> requests holding it
        self._to_load: dict[str, torch.Tensor] = {}
        self._unavailable: set[str] = set()
        logger.info(
            "epdserve EC connector: model %r, width %d, %d level(s), local encoding %s",
            self._model_id,
            self._width,
            self._levels,
            "allowed" if self.cfg.local_encode else "forbidden",
        )

    # ---- worker side -------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        from vllm.platforms import current_platform

        meta = self._get_connector_metadata()
        assert isinstance(meta, EpdserveECMetadata)
        device = current_platform.device_type
        if current_platform.is_cuda_alike():
            device = f"{device}:{current_platform.current_device()}"
        for identifier, emb in meta.items.items():
            if identifier not in encoder_cache:
                encoder_cache[identifier] = emb.to(device=device, dtype=self._dtype)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """A consumer saves nothing."""

    # ---- scheduler side ----------------------------------------------------------------------
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        self._drain()
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = self._start(request, num_computed_tokens)
        if state.failed is None and not self.cfg.local_encode:
            self._check_all_supplied(request, state, num_computed_tokens)
        if state.failed is not None:
            self._unavailable.add(request.request_id)
            return False
        return not state.fetching

    def has_cache_item(self, identifier: str) -> bool:
        self._drain()
        return identifier in self._ready

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        emb = self._ready.get(identifier)
        if emb is not None:
            self._to_load[identifier] = emb

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        meta = EpdserveECMetadata(self._to_load)
        self._to_load = {}
        return meta

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        state = self._requests.pop(request.request_id, None)
        if state is not None:
            for identifier in state.held:
                self._unhold(identifier, request.request_id)
        return False, None

    def shutdown(self) -> None:
        fetcher = getattr(self, "_fetcher", None)
        if fetcher is not None:
            fetcher.close()

    # ---- helpers -----------------------------------------------------------------------------
    def _start(self, request: Request, num_computed_tokens: int) -> _Pending:
        """Match the request's handles to its items and start reading those it needs."""
        state = _Pending()
        try:
            by_key, surplus = handles_by_key(request.ec_transfer_params, len(request.mm_features))
        except InvalidHandle as e:
            logger.warning("request %s: ec_transfer_params refused: %s", request.request_id, e)
            by_key, surplus = {}, []
        for extra in surplus:
            self._fetcher.release(extra)
        for index, feature in enumerate(request.mm_features):
            if feature.identifier not in by_key:
                continue
            handle = by_key.pop(feature.identifier)
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens or feature.identifier in self._ready:
                self._fetcher.release(handle)  # its KV is cached, or its embeddings are here already
                if feature.identifier in self._ready:
                    self._hold(feature.identifier, request.request_id, state)
                continue
            state.fetching[index] = feature.identifier
            rows = request.get_num_encoder_embeds(index)
            self._fetcher.fetch(request.request_id, index, handle, rows, self._width)
        for handle in by_key.values():  # names content the request does not have
            logger.warning("request %s: an EC handle names no media item of the request", request.request_id)
            self._fetcher.release(handle)
        return state

    def _check_all_supplied(self, request: Request, state: _Pending, num_computed_tokens: int) -> None:
        """With local encoding forbidden: fail the request when an item it still needs is neither
        here nor being read."""
        for feature in request.mm_features:
            pos = feature.mm_position
            needed = pos.offset + pos.length > num_computed_tokens
            if needed and feature.identifier not in self._ready and feature.identifier not in state.fetching.values():
                state.failed = f"no usable epdserve handle for {feature.modality} {feature.identifier}"
                logger.error("request %s failed: %s, and local encoding is forbidden", request.request_id, state.failed)
                return

    def _on_done(self, fetched: Fetched) -> None:  # on the fetcher's thread
        with self._lock:
            self._done.append(fetched)

    def _drain(self) -> None:
        with self._lock:
            done, self._done = self._done, []
        for f in done:
            state = self._requests.get(f.request_id)
            if state is None:
                continue  # the request finished while its read was in flight
            identifier = state.fetching.pop(f.index, None)
            if identifier is None:
                continue
            if f.embeddings is None:
                logger.warning(
                    "request %s: embeddings of item %d not taken from epdserve (%s): %s",
                    f.request_id,
                    f.index,
                    f.kind,
                    f.error,
                )
                continue
            self._ready.setdefault(identifier, f.embeddings.to(self._dtype))
            self._hold(identifier, f.request_id, state)

    def _hold(self, identifier: str, request_id: str, state: _Pending) -> None:
        state.held.add(identifier)
        self._holders.setdefault(identifier, set()).add(request_id)

    def _unhold(self, identifier: str, request_id: str) -> None:
        holders = self._holders.get(identifier)
        if holders is None:
            return
        holders.discard(request_id)
        if not holders:
            del self._holders[identifier]
            self._ready.pop(identifier, None)


def _consumer(ec: Any) -> Any:
    """epdserve's consumer of every handle kind: shm, tcp, mooncake, fs, and the shared store's."""
    from epdserve.store.consumer import StoreConsumer
    from epdserve.transfer.cached import CACHED_HANDLE
    from epdserve.transfer.config import STORE_HANDLE
    from epdserve.transfer.factory import make_consumer

    store = {STORE_HANDLE: lambda: StoreConsumer(ec), CACHED_HANDLE: lambda: StoreConsumer(ec)}
    return make_consumer(ec, store)
