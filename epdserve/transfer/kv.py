"""KV connectors: a request's KV cache handed from a prefill instance to a decode instance.

Parallel to the EC connectors and on the same transport (``shm`` on one host, ``tcp`` across
hosts): the payload is the KV of a prompt's tokens as one 2-D tensor, one row per token
(``[tokens, layers x 2 x kv_heads x head_dim]``: each layer's key, then its value), under the same
signed, versioned, validated header. The header's model identity names the KV layout as well
(layer count, KV heads, head dim), its shape the token count, its dtype the cache's, and the
checksum covers every byte, so a decode instance refuses KV of another model, layout, length or
precision before reading the payload. Rows are per token, not per block: prefill and decode
instances may use different block sizes.

A KV handle is bound to the prompt it was computed for: the identity also carries
``prompt_digest`` of the prompt's token ids and of each media item's content hash and place (the
same placeholders with another image are another prompt). A decode instance expects the digest of
the prompt it was given, so KV of one prompt never continues another, even of the same length.

KV handles are signed with their own subkey of the cluster secret: a KV handle is never accepted
where an embedding handle is expected, nor the reverse.
"""

from __future__ import annotations

import dataclasses
import hashlib
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from epdserve.transfer.base import Handle
from epdserve.transfer.config import KV_HANDLE_PURPOSE, Connector, ECConfig
from epdserve.transfer.header import PROMPT_MARK

if TYPE_CHECKING:
    import torch

    from epdserve.transfer.base import ECProducer


@dataclass(frozen=True)
class KVLayout:
    """The shape of one token's KV in a model's cache."""

    num_layers: int
    kv_heads: int
    head_dim: int
    dtype: str

    @property
    def width(self) -> int:
        """Values per token row: every layer's key and value."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim

    def identity(self, model_id: str, prompt: str = "") -> str:
        """The model identity a KV header carries: the model, its KV layout and (``prompt``:
        its ``prompt_digest``) the prompt the KV was computed for."""
        base = f"{model_id}#kv:layers={self.num_layers},kv_heads={self.kv_heads},head_dim={self.head_dim}"
        return f"{base}{PROMPT_MARK}{prompt}" if prompt else base


def prompt_digest(token_ids: Sequence[int], media: Iterable[tuple[str, int, int]]) -> str:
    """What a KV handle is bound to: the prompt's token ids and each media item's (content hash,
    first placeholder, placeholders)."""
    h = hashlib.blake2b(array("q", token_ids).tobytes(), digest_size=16)
    for uuid, offset, length in media:
        h.update(f"|{uuid}@{offset}+{length}".encode())
    return h.hexdigest()


def kv_config(ec: ECConfig, connector: Connector, instance: str, dtype: str) -> ECConfig:
    """The KV connector's config: the EC transport settings, its own signing key, one dtype."""
    return dataclasses.replace(
        ec, connector=connector, instance=instance, handle_purpose=KV_HANDLE_PURPOSE, dtypes=(dtype,)
    )


class KVProducer:
    """Prefill side: puts a request's KV rows and hands out signed handles on them."""

    def __init__(self, cfg: ECConfig, layout: KVLayout, model_id: str) -> None:
        from epdserve.transfer.factory import make_producer

        if cfg.handle_purpose != KV_HANDLE_PURPOSE:
            raise ValueError("a KV producer needs a KV connector config (kv_config)")
        self.layout = layout
        self.identity = layout.identity(model_id)
        self._producer: ECProducer = make_producer(cfg)

    def put(self, request_id: str, kv: torch.Tensor, prompt: str) -> Handle:
        """A handle on ``kv``, the KV of the prompt whose ``prompt_digest`` is ``prompt``."""
        if kv.dim() != 2 or kv.shape[1] != self.layout.width:
            raise ValueError(f"KV rows must be [tokens, {self.layout.width}], got {list(kv.shape)}")
        return self._producer.put(request_id, kv, f"{self.identity}{PROMPT_MARK}{prompt}")

    def release(self, handle: Handle) -> bool:
        return self._producer.release(handle)

    @property
    def live_handles(self) -> int:
        return self._producer.live_handles

    def close(self) -> None:
        self._producer.close()
