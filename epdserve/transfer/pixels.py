"""Decoded media in shared memory, from the router to an encoder: the pixel handle.

A router that decodes media itself (``router.frontend_decode``) puts each item's RGB frames, at
the size the vision tower sees them, into a shm slab of its own (``transfer.shm``, byte level, no
torch) and sends the encoder a *pixel handle* instead of the URL::

    {"connector": "shm", "version": 2, "key": "<media uuid>", "model_id": "...", "dtype": "uint8",
     "shape": [frames, height, width, 3], "nbytes": N, "checksum": "<xxh3-64>",
     "modality": "video", "processor": "<digest of the preprocessing settings>", "interval_s": 0.5,
     "slab": ..., "offset": ..., "generation": ..., "slot": ..., "path": ...,
     "issued_at": ..., "expires_at": ..., "lease": ..., "mac": ...}

Trust: the handle is signed with its own subkey of the cluster secret (``PIXEL_HANDLE_PURPOSE``):
a pixel handle is never accepted as an embedding handle, nor the reverse. Its ``key`` is the item's
content hash, computed by the router from the raw bytes exactly as an encoder computes it
(``media.hashing``, same settings), so caches, the shared store and the router's directory see one
identity whichever role decoded. An encoder whose preprocessing settings differ from the ones the
router hashed under (``processor``) refuses the handle rather than cache embeddings under a hash
it would not have computed. Even after the MAC verifies, everything the header says is checked
against the encoder's own limits (dtype, frames, pixels per frame, byte count) before a byte is
read, and the copy's checksum after.

Lifetime: the router holds the only lease of each handle it issues and gives it back when the
encode call that carried it ends, however it ends (answered, failed over to another encoder, or
abandoned by its client); the encoder only reads. The lease's TTL reclaims the rest, and the slab
goes with the router's process (unlinked at close, removed as stale by the next producer start or
``epdserve up``).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Annotated, Any, Final, NamedTuple

import msgspec
import numpy as np
import numpy.typing as npt

from epdserve.media.hashing import canonical_json
from epdserve.media.limits import MAX_SECOND_PER_GRID, MediaLimits
from epdserve.transfer import header as wire
from epdserve.transfer import signing
from epdserve.transfer.base import PROTOCOL_VERSION, Handle, InvalidHandle, TransferError
from epdserve.transfer.config import PIXEL_HANDLE_PURPOSE, ECConfig
from epdserve.transfer.shm import ShmConsumer, ShmProducer

PIXEL_DTYPE: Final = "uint8"
CHANNELS: Final = 3  # RGB
_UUID_RE = re.compile(r"[0-9a-f]{64}")
Frames = npt.NDArray[np.uint8]  # [frames, height, width, 3]


class PixelFields(msgspec.Struct):
    """The signed fields a pixel handle has beyond a shm handle's."""

    modality: str  # "image" or "video": part of the uuid, checked against the encode item's
    processor: str  # ``processor_digest`` of the settings the uuid was computed under
    # a video's seconds between sampled frames, from its bytes (``media.decode.Video``; None: no clock)
    interval_s: Annotated[float, msgspec.Meta(gt=0, le=MAX_SECOND_PER_GRID)] | None = None


class PixelItem(NamedTuple):
    """What a verified pixel handle says of its item, before a byte is read."""

    uuid: str  # the media uuid the router computed from the raw bytes
    interval_s: float | None  # a video's seconds between sampled frames (None: the file had no clock)


def processor_digest(model_id: str, processor_kwargs: Mapping[str, Any]) -> str:
    """Names the model and preprocessing settings an item's uuid and pixels were made under."""
    return hashlib.sha256(canonical_json({"model": model_id, "processor": dict(processor_kwargs)})).hexdigest()[:32]


def pixel_config(base: ECConfig) -> ECConfig:
    """``base`` signing and verifying pixel handles (its own subkey of the cluster secret)."""
    return ECConfig(
        connector="shm",
        shm_bytes=base.shm_bytes,
        shm_dir=base.shm_dir,
        secret=base.secret,
        ttl_s=base.ttl_s,
        instance=base.instance,
        handle_purpose=PIXEL_HANDLE_PURPOSE,
    )


class PixelProducer:
    """The router's slab of decoded frames. Thread-safe (the decode threads put)."""

    def __init__(self, cfg: ECConfig) -> None:
        self._shm = ShmProducer(pixel_config(cfg))

    def put(
        self,
        uuid: str,
        model_id: str,
        modality: str,
        processor: str,
        frames: Frames,
        interval_s: float | None = None,
    ) -> Handle:
        """A handle on a copy of ``frames`` (uint8 [T, H, W, 3]) and, for a video, the seconds
        between them; ``ProducerFull`` when the slab cannot hold it until leases are given back."""
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != CHANNELS:
            raise TransferError(f"frames must be uint8 [T, H, W, 3], got {frames.dtype} {list(frames.shape)}")
        flat = np.ascontiguousarray(frames).reshape(-1)
        draft = wire.WireHeader(
            version=PROTOCOL_VERSION,
            key=uuid,
            model_id=model_id,
            dtype=PIXEL_DTYPE,
            shape=tuple(int(n) for n in frames.shape),
            levels=1,
            nbytes=int(flat.nbytes),
            checksum="0" * 16,  # fixed length: the header's size is known before the copy hashes it
        )
        fields = PixelFields(modality=modality, processor=processor, interval_s=interval_s)
        return self._shm.put_bytes(draft, flat, msgspec.structs.asdict(fields))

    def release(self, handle: Handle) -> bool:
        """Give back a lease this producer issued; True when it was live."""
        return self._shm.release(handle)

    @property
    def live_handles(self) -> int:
        return self._shm.live_handles

    @property
    def held_bytes(self) -> int:
        return self._shm.held_bytes

    @property
    def capacity_bytes(self) -> int:
        return self._shm.capacity_bytes

    @property
    def path(self) -> str:
        return str(self._shm.path)

    def close(self) -> None:
        self._shm.close()


class PixelReader:
    """The encoder's side: verifies, validates and copies pixel handles' frames."""

    def __init__(self, cfg: ECConfig, model_id: str, processor: str, limits: MediaLimits) -> None:
        pixels = pixel_config(cfg)
        self._key = pixels.handle_key if pixels.has_secret else None
        self._shm = ShmConsumer(pixels)
        self._model_id = model_id
        self._processor = processor
        self._limits = limits

    def uuid(self, handle: object, modality: str) -> str:
        """The item's uuid, once the handle verified and validated (no byte read)."""
        return self.item(handle, modality).uuid

    def item(self, handle: object, modality: str) -> PixelItem:
        """The item's uuid and timing, once the handle verified and validated (no byte read)."""
        verified = self._verify(handle)
        header = wire.from_handle(verified)
        fields = self._check(verified, header, modality)
        return PixelItem(header.key, fields.interval_s)

    def read(self, handle: object, modality: str) -> Frames:
        """A private copy of the handle's frames, uint8 [T, H, W, 3] (blocking: off the event loop)."""
        verified = self._verify(handle)
        flat = self._shm.read_bytes(verified, lambda h, head: self._check(h, head, modality))
        return flat.reshape(wire.from_handle(verified).shape)

    def _verify(self, handle: object) -> Handle:
        verified = signing.verify_with(handle, self._key)  # before anything of it is believed
        if verified.get("connector") != "shm":
            raise InvalidHandle("the pixel handle is not a shm handle")
        return verified

    def _check(self, handle: Handle, header: wire.WireHeader, modality: str) -> PixelFields:
        """Everything the signed header says, against this encoder's own settings and limits."""
        try:
            fields = msgspec.convert(handle, PixelFields)
        except msgspec.ValidationError as e:
            raise InvalidHandle(f"malformed pixel handle: {e}") from None
        if header.version != PROTOCOL_VERSION or header.dtype != PIXEL_DTYPE:
            raise InvalidHandle(f"the pixel handle is version {header.version} of {header.dtype}, not uint8 pixels")
        if not _UUID_RE.fullmatch(header.key):
            raise InvalidHandle("the pixel handle's key is not a media uuid")
        if header.model_id != self._model_id or fields.processor != self._processor:
            raise InvalidHandle(
                "the pixels were prepared for another model or other preprocessing settings than this encoder's "
                "(the router and the encoders must serve the same model directory)"
            )
        if fields.modality != modality:
            raise InvalidHandle(f"the pixel handle holds a {fields.modality}, the item is a {modality}")
        shape = header.shape
        if len(shape) != 4 or shape[3] != CHANNELS or min(shape) < 1:
            raise InvalidHandle(f"the pixel handle's shape {list(shape)} is not [frames, height, width, 3]")
        frames, height, width = shape[:3]
        most = 1 if modality == "image" else self._limits.video_frames
        if frames > most:
            raise InvalidHandle(f"the pixel handle holds {frames} frames; a {modality} has at most {most}")
        if height * width > self._limits.max_image_pixels:
            raise InvalidHandle(f"the pixel handle's {width}x{height} frames exceed the encoder's pixel limit")
        if header.nbytes != frames * height * width * CHANNELS:
            raise InvalidHandle(f"the pixel handle says {header.nbytes} bytes for shape {list(shape)}")
        return fields

    async def close(self) -> None:
        await self._shm.close()
