"""Fetching a request's embeddings by EC handle, inside the engine core.

A metadata-only request enters the scheduler at once with ``ready = False``; its handles are
fetched here, on a private event loop thread (the connectors are asyncio), while the running batch
keeps stepping. Each finished fetch is queued as a ``Fetched`` and the core applies it between
steps: all items present → the request becomes ready; any failure → the request fails alone, 400
(``invalid_handle``) for a handle that does not verify, 503 (``embeddings_unavailable``: the router
encodes afresh) for embeddings that are gone. Every lease is released whether the read worked or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from epdserve.engine.messages import ErrorKind
from epdserve.transfer.base import ECConsumer, Handle, InvalidHandle, TransferError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Fetched:
    request_id: str
    index: int  # media item index within the request
    embeddings: torch.Tensor | None  # None: failed
    error: str | None = None
    kind: ErrorKind | None = None


class EmbeddingFetcher:
    """Runs ``consumer.get`` + ``release`` for handles off the engine thread; results go to
    ``on_done`` (called on the fetcher's thread: it must only queue and wake the engine)."""

    def __init__(
        self,
        make_consumer: Callable[[], ECConsumer],
        model_id: str,
        on_done: Callable[[Fetched], None],
        what: str = "embeddings",  # what the handles hold, for the log ("KV" on a decode instance)
        unavailable: str = "Embeddings are unavailable.",  # the request's error: names no path, host or port
        levels: int = 1,  # feature levels the model takes per row (DeepStack); a payload must hold exactly these
    ) -> None:
        self.model_id = model_id
        self.levels = levels
        self.what = what
        self.unavailable = unavailable
        self.on_done = on_done
        self.bytes = 0
        self.seconds = 0.0
        self.failures = 0
        self.invalid = 0  # of the failures: handles that did not verify (the others: data gone or bad)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="epd-ec-fetch", daemon=True)
        self._thread.start()
        self._consumer = make_consumer()

    def fetch(self, request_id: str, index: int, handle: Handle, rows: int, width: int, model_id: str = "") -> None:
        """Fetch in the background; ``model_id``: the identity this handle must carry ("" = the
        fetcher's, e.g. a KV handle's, which names its prompt)."""
        coro = self._fetch(request_id, index, handle, rows, width, model_id or self.model_id)
        asyncio.run_coroutine_threadsafe(coro, self._loop)

    def release(self, handle: Handle) -> None:
        """Give back a lease that will not be read (its request left before the fetch began)."""
        asyncio.run_coroutine_threadsafe(self._release(handle), self._loop)

    async def _fetch(self, request_id: str, index: int, handle: Handle, rows: int, width: int, model_id: str) -> None:
        t0 = time.perf_counter()
        try:
            emb = await self._consumer.get(handle, rows, width, model_id, self.levels)
        except InvalidHandle as e:
            self.failures += 1
            self.invalid += 1
            log.warning("refused a handle (%s) of %s: %s", self.what, request_id, e)
            self.on_done(Fetched(request_id, index, None, f"The ec_handle is not valid: {e}", "invalid_handle"))
            return
        except (TransferError, KeyError, TypeError, ValueError, OSError) as e:
            self.failures += 1
            log.warning("%s of %s unavailable: %s", self.what, request_id, e)
            self.on_done(Fetched(request_id, index, None, self.unavailable, "embeddings_unavailable"))
            return
        finally:
            await self._release(handle)
        self.seconds += time.perf_counter() - t0
        self.bytes += emb.numel() * emb.element_size()
        self.on_done(Fetched(request_id, index, emb))

    async def _release(self, handle: Handle) -> None:
        # a failed release is harmless: the producer reclaims the lease after its TTL
        with contextlib.suppress(TransferError, KeyError, TypeError, ValueError, OSError):
            await self._consumer.release(handle)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._consumer.close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
