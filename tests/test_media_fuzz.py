"""Structure-aware fuzzing of the media decoders, in process, through the entry points every role
decodes with (``decode_image``, ``decode_video``, ``AudioProcessor.process``).

Valid seeds are made here (PNG, APNG, JPEG, GIF, WebP, BMP, MP4, WebM, WAV, FLAC); each case
mutates one of them where its format is fragile: the length, size, canvas and count fields of its
chunks, blocks, boxes and segments; whole chunks dropped, repeated (more frames) or swapped;
truncations, bit flips and splices of two seeds. Every case must be accepted or refused with a
``MediaError``, within its decode budget. Cases are numbered and seeded by their number, so a
failure names the one case to replay.
"""

from __future__ import annotations

import io
import random
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass

import av
import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from epdserve.media.audio import AudioProcessor, AudioProcessorConfig
from epdserve.media.decode import decode_image, decode_video
from epdserve.media.errors import MediaError
from epdserve.media.limits import MediaLimits

CASES = 6000
# small enough that a mutated header claiming the largest canvas stays cheap to decode
LIMITS = MediaLimits(max_image_pixels=1 << 20, max_decode_pixels=1 << 24, decode_timeout_s=2.0, max_audio_seconds=5.0)
SLACK_S = 5.0  # a decode may overshoot its budget by one frame; generous for a loaded machine


@dataclass(frozen=True)
class Field:
    """A number in a seed's structure: where, how wide, which byte order."""

    offset: int
    size: int  # bytes: 1, 2, 3 or 4
    big_endian: bool


@dataclass(frozen=True)
class Seed:
    name: str
    data: bytes
    kind: str  # "image" (also tried as a video), "video", or an audio format
    fields: tuple[Field, ...]  # length, size and count fields
    spans: tuple[tuple[int, int], ...]  # whole chunks/blocks/boxes/segments


# --------------------------------------------------------------------------- seeds


def _frames(n: int, size: tuple[int, int]) -> list[Image.Image]:
    out = []
    for i in range(n):
        img = Image.new("RGB", size, (i * 40 % 256, 120, 255 - i * 30 % 256))
        img.paste((255, 255, 255), (i * 2, i, i * 2 + 4, i + 4))
        out.append(img)
    return out


def _pillow(fmt: str, frames: int = 1, **kw: object) -> bytes:
    imgs = _frames(frames, (24, 16))
    buf = io.BytesIO()
    extra = {"save_all": True, "append_images": imgs[1:], "duration": 80, "loop": 0} if frames > 1 else {}
    imgs[0].save(buf, format=fmt, **extra, **kw)
    return buf.getvalue()


def _container(fmt: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=fmt) as out:
        stream = out.add_stream(codec, rate=8)
        stream.width, stream.height, stream.pix_fmt = 32, 24, "yuv420p"
        for img in _frames(8, (32, 24)):
            for packet in stream.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def _audio(fmt: str) -> bytes:
    buf = io.BytesIO()
    t = np.arange(4000, dtype=np.float32) / 16000
    sf.write(buf, np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], 1), 16000, format=fmt)
    return buf.getvalue()


def _png_structure(d: bytes) -> tuple[list[Field], list[tuple[int, int]]]:
    fields, spans, at = [], [], 8
    while at + 8 <= len(d):
        n, kind = struct.unpack(">I4s", d[at : at + 8])
        fields.append(Field(at, 4, True))
        if kind in (b"IHDR", b"fcTL"):  # width, height (fcTL: after its sequence number)
            first = at + 8 + (4 if kind == b"fcTL" else 0)
            fields += [Field(first, 4, True), Field(first + 4, 4, True), Field(first + 8, 1, True)]
        if kind == b"acTL":  # frame count
            fields.append(Field(at + 8, 4, True))
        spans.append((at, at + 12 + n))
        at += 12 + n
    return fields, spans[1:-1]  # IHDR and IEND stay in place


def _gif_structure(d: bytes) -> tuple[list[Field], list[tuple[int, int]]]:
    fields = [Field(6, 2, False), Field(8, 2, False), Field(10, 1, False)]
    at = 13 + (3 << ((d[10] & 7) + 1) if d[10] & 0x80 else 0)
    spans = []
    while at < len(d) and d[at] != 0x3B:
        start = at
        if d[at] == 0x21:  # extension: label, then sub-blocks
            at += 2
        else:  # image descriptor: position, size, flags, local table, LZW code size
            fields += [Field(at + 1 + 2 * k, 2, False) for k in range(4)] + [Field(at + 9, 1, False)]
            flags = d[at + 9]
            at += 10 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
            fields.append(Field(at, 1, False))
            at += 1
        while at < len(d) and d[at]:
            fields.append(Field(at, 1, False))
            at += d[at] + 1
        at += 1
        spans.append((start, at))
    return fields, spans


def _riff_structure(d: bytes) -> tuple[list[Field], list[tuple[int, int]]]:
    fields, spans, at = [Field(4, 4, False)], [], 12
    while at + 8 <= len(d):
        kind, n = d[at : at + 4], struct.unpack("<I", d[at + 4 : at + 8])[0]
        fields.append(Field(at + 4, 4, False))
        body = at + 8
        if kind == b"VP8X":  # canvas width-1, height-1 (24 bits each)
            fields += [Field(body + 4, 3, False), Field(body + 7, 3, False)]
        elif kind == b"ANMF":  # x, y, width-1, height-1, duration
            fields += [Field(body + 3 * k, 3, False) for k in range(5)]
        elif kind == b"fmt ":  # format, channels, rate, byte rate, block align, bits
            fields += [Field(body, 2, False), Field(body + 2, 2, False), Field(body + 4, 4, False)]
            fields += [Field(body + 8, 4, False), Field(body + 12, 2, False), Field(body + 14, 2, False)]
        spans.append((at, body + n + (n & 1)))
        at = body + n + (n & 1)
    return fields, spans


def _jpeg_structure(d: bytes) -> tuple[list[Field], list[tuple[int, int]]]:
    fields, spans, at = [], [], 2
    while at + 4 <= len(d) and d[at] == 0xFF:
        marker, n = d[at + 1], struct.unpack(">H", d[at + 2 : at + 4])[0]
        fields.append(Field(at + 2, 2, True))
        if marker in (0xC0, 0xC1, 0xC2):  # frame header: precision, height, width, components
            fields += [Field(at + 4, 1, True), Field(at + 5, 2, True), Field(at + 7, 2, True), Field(at + 9, 1, True)]
        spans.append((at, at + 2 + n))
        if marker == 0xDA:  # scan data follows: the structure ends here
            break
        at += 2 + n
    return fields, spans


_CONTAINERS = {b"moov", b"trak", b"mdia", b"minf", b"stbl", b"dinf", b"edts", b"udta"}


def _mp4_structure(d: bytes, start: int = 0, end: int | None = None) -> tuple[list[Field], list[tuple[int, int]]]:
    fields, spans, at, end = [], [], start, len(d) if end is None else end
    while at + 8 <= end:
        n, kind = struct.unpack(">I4s", d[at : at + 8])
        if n < 8 or at + n > end:
            break
        fields.append(Field(at, 4, True))
        spans.append((at, at + n))
        if kind in _CONTAINERS:
            inner_fields, inner_spans = _mp4_structure(d, at + 8, at + n)
            fields += inner_fields
            spans += inner_spans
        elif kind != b"mdat":  # leaf boxes: counts, sizes, durations are 32-bit fields
            fields += [Field(o, 4, True) for o in range(at + 8, min(at + n, at + 8 + 96) - 3, 4)]
        at += n
    return fields, spans


def _ebml_spans(d: bytes) -> tuple[list[Field], list[tuple[int, int]]]:
    # WebM's sizes are variable-length; mutate its bytes by position instead of by field
    step = max(1, len(d) // 64)
    return [Field(o, 1, True) for o in range(0, len(d), step)], [
        (o, min(o + step, len(d))) for o in range(0, len(d), step)
    ]


def make_seeds() -> list[Seed]:
    raw: list[tuple[str, bytes, str, Callable[[bytes], tuple[list[Field], list[tuple[int, int]]]]]] = [
        ("png", _pillow("PNG"), "image", _png_structure),
        ("apng", _pillow("PNG", frames=5), "image", _png_structure),
        ("jpeg", _pillow("JPEG", quality=80), "image", _jpeg_structure),
        ("jpeg-progressive", _pillow("JPEG", progressive=True), "image", _jpeg_structure),
        ("gif", _pillow("GIF", frames=6), "image", _gif_structure),
        (
            "bmp",
            _pillow("BMP"),
            "image",
            lambda d: ([Field(2, 4, False), *(Field(o, 4, False) for o in range(14, 38, 4))], []),
        ),
        ("mp4", _container("mp4", "mpeg4"), "video", _mp4_structure),
        ("wav", _audio("WAV"), "wav", _riff_structure),
        ("flac", _audio("FLAC"), "flac", lambda d: ([Field(o, 1, True) for o in range(4, 42)], [])),
    ]
    if "WEBP" in Image.SAVE_ALL:
        raw.append(("webp", _pillow("WEBP", frames=4, lossless=True), "image", _riff_structure))
    if "libvpx" in av.codecs_available:
        raw.append(("webm", _container("webm", "libvpx"), "video", _ebml_spans))
    seeds = []
    for name, data, kind, structure in raw:
        fields, spans = structure(data)
        seeds.append(Seed(name, data, kind, tuple(f for f in fields if f.offset + f.size <= len(data)), tuple(spans)))
    return seeds


# --------------------------------------------------------------------------- mutations


def _interesting(size: int, rng: random.Random) -> int:
    top = (1 << (8 * size)) - 1
    return (
        rng.choice(
            [
                0,
                1,
                2,
                0x7F,
                0xFF,
                0x100,
                0x1000,
                4095,
                4096,
                16383,
                65535,
                1 << 20,
                top,
                top >> 1,
                top - 1,
                rng.randrange(top + 1),
            ]
        )
        & top
    )


def _set(buf: bytearray, f: Field, value: int, rng: random.Random) -> None:
    if rng.random() < 0.3:  # near the value there: off by a little
        old = int.from_bytes(buf[f.offset : f.offset + f.size], "big" if f.big_endian else "little")
        value = (old + rng.choice([-2, -1, 1, 2, 8, 1000])) % (1 << (8 * f.size))
    buf[f.offset : f.offset + f.size] = value.to_bytes(f.size, "big" if f.big_endian else "little")


def mutate(seed: Seed, seeds: list[Seed], rng: random.Random) -> tuple[bytes, str]:
    """One case from ``seed``, and what was done to it."""
    buf, done = bytearray(seed.data), []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        op = rng.random()
        if op < 0.45 and seed.fields:
            f = rng.choice(seed.fields)
            if f.offset + f.size <= len(buf):
                _set(buf, f, _interesting(f.size, rng), rng)
                done.append(f"field@{f.offset}")
        elif op < 0.65 and seed.spans:
            a, b = rng.choice(seed.spans)
            if b <= len(buf):
                how = rng.choice(["repeat", "drop", "swap"])
                if how == "repeat":  # many more frames (or chunks) of the same kind
                    buf[b:b] = bytes(buf[a:b]) * rng.choice([2, 10, 100, 400])
                elif how == "drop":
                    del buf[a:b]
                else:
                    c, e = rng.choice(seed.spans)
                    if e <= len(buf) and (c, e) != (a, b) and (e <= a or c >= b):
                        first, second = sorted([(a, b), (c, e)])
                        buf[:] = (
                            buf[: first[0]]
                            + buf[second[0] : second[1]]
                            + buf[first[1] : second[0]]
                            + buf[first[0] : first[1]]
                            + buf[second[1] :]
                        )
                done.append(f"{how}@{a}")
        elif op < 0.8:
            cut = rng.randrange(1, max(2, len(buf)))
            del buf[cut:]
            done.append(f"truncate@{cut}")
        elif op < 0.92:
            for _ in range(rng.randint(1, 8)):
                if buf:
                    i = rng.randrange(len(buf))
                    buf[i] ^= 1 << rng.randrange(8)
            done.append("flips")
        else:
            other = rng.choice(seeds).data
            cut = rng.randrange(len(buf) + 1)
            buf[cut:] = other[rng.randrange(len(other) + 1) :]
            done.append(f"splice@{cut}")
    return bytes(buf), "+".join(done) or "none"


# --------------------------------------------------------------------------- the test


@pytest.mark.filterwarnings("ignore:Invalid APNG")
def test_mutated_media_is_accepted_or_a_typed_error_within_its_budget() -> None:
    seeds = make_seeds()
    audio = AudioProcessor(AudioProcessorConfig())
    entries: dict[str, list[tuple[str, Callable[[bytes], object]]]] = {
        "image": [("image", lambda d: decode_image(d, LIMITS)), ("video", lambda d: decode_video(d, LIMITS))],
        "video": [("video", lambda d: decode_video(d, LIMITS))],
        "wav": [("audio", lambda d: audio.process(d, "wav", LIMITS))],
        "flac": [("audio", lambda d: audio.process(d, "flac", LIMITS))],
    }
    outcomes: dict[str, int] = {}
    slowest = 0.0
    t0 = time.process_time()
    for case in range(CASES):
        rng = random.Random(case)
        seed = seeds[case % len(seeds)]
        data, how = mutate(seed, seeds, rng)
        for entry, decode in entries[seed.kind]:
            started = time.perf_counter()
            try:
                decode(data)
                outcome = "accepted"
            except MediaError as e:
                outcome = type(e).__name__
            except Exception as e:  # the defect this test exists to find
                pytest.fail(f"case {case} ({seed.name}, {how}) as {entry}: {type(e).__name__}: {e}")
            took = time.perf_counter() - started
            slowest = max(slowest, took)
            assert took < LIMITS.decode_timeout_s + SLACK_S, (
                f"case {case} ({seed.name}, {how}) as {entry}: {took:.1f} s"
            )
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"{CASES} cases, {time.process_time() - t0:.1f} s CPU, slowest {slowest:.2f} s: {outcomes}")
    # the mutations reach both sides: many cases decode, many are refused
    assert outcomes.get("accepted", 0) > CASES // 20 and outcomes.get("InvalidMedia", 0) > CASES // 20, outcomes
