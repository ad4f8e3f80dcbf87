"""What decoding one client media item may cost, and which formats may be decoded at all.

A small file can stand for a great deal of decoding: a GIF of thousands of one-pixel frames on the
largest canvas costs a full canvas per frame. So every item is bounded by work, not by its size
alone, at two points:

* before decoding, from the header: its format must be one of the accepted ones (told from its
  leading bytes, so no other decoder ever parses it), and its frames x canvas pixels must fit
  ``MediaLimits.max_decode_pixels``;
* while decoding, between frames: the pixels actually produced are charged, and the decode stops
  once the item's wall-clock budget (``decode_timeout_s``) is spent or the request was abandoned.

The checks run in the decoding thread itself, between frames: one frame is at most one canvas of
``max_image_pixels``, so a decode overshoots its budget by at most one frame's work, without the
cost of a process per item.

Decoders are third-party C and Python code that raise whatever they raise on malformed bytes;
``guarded`` turns anything they raise into a ``MediaError``, so a client's bytes fail that request
with a 4xx and never look like a broken server.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import TypeVar

from PIL import Image

from epdserve.media.errors import InvalidMedia, MediaError, MediaTooLarge
from epdserve.media.limits import MediaLimits
from epdserve.media.pending import PendingFull, ReservationClosed

T = TypeVar("T")


class DecodeCancelled(MediaError):
    """The request that wanted this item is gone: its decode stopped."""


# format → Pillow's name of it (images, animated images)
PILLOW_NAMES = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "gif": "GIF", "bmp": "BMP"}
# format → the FFmpeg demuxer that alone may open it (video containers)
DEMUXERS = {"mp4": "mp4", "webm": "webm"}


def sniff(data: bytes) -> str | None:
    """The format of ``data`` from its leading bytes, among those ``MediaLimits`` knows; None for
    any other."""
    head = data[:64]
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if head.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if head.startswith((b"GIF87a", b"GIF89a")):
        return "gif"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "webp"
    if head.startswith(b"RIFF") and head[8:12] == b"WAVE":
        return "wav"
    if head.startswith(b"BM"):
        return "bmp"
    if head[4:8] == b"ftyp":
        return "mp4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):  # EBML: Matroska, of which WebM names itself in its DocType
        return "webm" if b"webm" in head else None
    if head.startswith(b"fLaC"):
        return "flac"
    if head.startswith(b"ID3") or (len(head) > 1 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0):
        return "mp3"
    return None


def describe(data: bytes) -> str:
    """A name for the format of ``data`` in an error message: ours, else Pillow's guess from its
    leading bytes (Pillow's plugins each recognise a prefix; nothing is parsed), else "unknown"."""
    known = sniff(data)
    if known is not None:
        return known
    Image.init()
    head = data[:16]
    for name, (_, accept) in Image.OPEN.items():
        try:
            if accept is not None and accept(head):
                return name.lower()
        except Exception:  # a plugin's prefix check on odd bytes: not worth more than "unknown"
            continue
    return "unknown"


def check_format(data: bytes, accepted: tuple[str, ...], what: str) -> str:
    """The format of ``data`` when it is one of ``accepted``; else InvalidMedia naming it."""
    fmt = sniff(data)
    if fmt is None or fmt not in accepted:
        name = describe(data)
        raise InvalidMedia(
            f"The {what} format {name.upper()} is not accepted; accepted: {', '.join(accepted).upper()}."
        )
    return fmt


class DecodeBudget:
    """The work left to decode one item: pixels to produce and wall-clock time, and whether its
    request still wants it. Created when its decode starts (time spent waiting for a thread is
    not charged); shared by everything that decodes the item."""

    def __init__(
        self,
        limits: MediaLimits,
        cancelled: threading.Event | None = None,
        clock: Callable[[], float] = time.monotonic,
        reserve: Callable[[int, int, int], None] | None = None,
    ) -> None:
        """``reserve(frames, width, height)``: told once, before any pixel is decoded, how many
        frames of what canvas the decode keeps; it may refuse the item by raising."""
        self.limits = limits
        self.cancelled = cancelled
        self.clock = clock
        self.deadline = clock() + limits.decode_timeout_s
        self.pixels = 0
        self._reserve = reserve

    def keep(self, frames: int, width: int, height: int) -> None:
        """The decode will keep ``frames`` frames of ``width`` x ``height`` (from the header, before
        decoding them): reserved once, for the item's first report."""
        reserve, self._reserve = self._reserve, None
        if reserve is not None:
            reserve(frames, width, height)

    def plan(self, frames: int, width: int, height: int, what: str) -> None:
        """Refuse, before decoding, an item whose header already claims more work than allowed."""
        work = frames * width * height
        if work > self.limits.max_decode_pixels:
            raise MediaTooLarge(
                f"The {what} needs {frames} frames of {width}x{height} decoded = {work} pixels; "
                f"at most {self.limits.max_decode_pixels} are decoded per item."
            )

    def charge(self, pixels: int, what: str) -> None:
        """Count a frame about to be decoded (``pixels`` of it) and check what is left."""
        self.pixels += pixels
        if self.pixels > self.limits.max_decode_pixels:
            raise MediaTooLarge(
                f"Decoding the {what} needs more than {self.limits.max_decode_pixels} pixels; "
                f"that many are decoded per item at most."
            )
        self.check(what)

    def check(self, what: str) -> None:
        """Stop here when the request is gone or the wall-clock budget is spent."""
        if self.cancelled is not None and self.cancelled.is_set():
            raise DecodeCancelled(f"The request for this {what} was abandoned.")
        if self.clock() > self.deadline:
            raise MediaTooLarge(
                f"Decoding the {what} takes longer than {self.limits.decode_timeout_s:g} s; it was stopped."
            )


@contextmanager
def guarded(what: str) -> Iterator[None]:
    """Run a decoder on client bytes: whatever it raises becomes a ``MediaError`` (its own pass
    through). Memory it could not get is the item being too large; anything else, bytes it cannot
    decode."""
    try:
        yield
    except (MediaError, PendingFull, ReservationClosed):  # the item's own refusal, or its reservation's
        raise
    except (MemoryError, Image.DecompressionBombError):
        raise MediaTooLarge(f"The {what} is too large to decode.") from None
    except Exception as e:  # any decoder failure on client bytes is the bytes' fault
        detail = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        raise InvalidMedia(f"The {what} could not be decoded: {detail}") from None


async def run_decode(executor: Executor, fn: Callable[[threading.Event], T]) -> T:
    """``fn(cancelled)`` on ``executor``; if the caller is cancelled meanwhile (its request was
    abandoned), ``cancelled`` is set, and a decode under a budget holding it stops at its next check."""
    cancelled = threading.Event()
    running = asyncio.get_running_loop().run_in_executor(executor, fn, cancelled)
    try:
        return await running
    except asyncio.CancelledError:
        cancelled.set()
        raise
