"""Decoding under a budget: accepted formats only, work bounded from the header and between
frames, decodes that stop when their time is spent or their request is gone, and decoder
failures on client bytes that are always a typed media error."""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
from PIL import Image

from epdserve.api.errors import from_media_error
from epdserve.media.audio import decode_audio
from epdserve.media.budget import DecodeBudget, DecodeCancelled, describe, guarded, run_decode, sniff
from epdserve.media.decode import decode_image, decode_video, video_interval
from epdserve.media.errors import InvalidMedia, MediaError, MediaTimeout, MediaTooLarge
from epdserve.media.limits import MediaLimits
from epdserve.media.pending import PendingFull
from epdserve.router.upstream import about_media, passthrough_error
from tests.corpus.media.generate import huge_canvas_gif, mp4

CORPUS = Path(__file__).parent / "corpus" / "media"
LIMITS = MediaLimits()


def still(fmt: str, size: tuple[int, int] = (16, 12)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 40)).save(buf, format=fmt)
    return buf.getvalue()


# --------------------------------------------------------------------------- formats


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_the_formats_clients_send_are_told_and_decoded(fmt: str) -> None:
    data = still(fmt)
    assert sniff(data) == fmt.lower()
    assert decode_image(data, LIMITS).size == (16, 12)


@pytest.mark.parametrize(("fmt", "name"), [("DDS", "DDS"), ("SGI", "SGI"), ("TIFF", "TIFF"), ("PPM", "PPM")])
def test_other_formats_are_refused_by_name_before_any_decoder_parses_them(fmt: str, name: str) -> None:
    data = still(fmt)
    for decode in (decode_image, decode_video):
        with pytest.raises(InvalidMedia, match=f"format {name} is not accepted"):
            decode(data, LIMITS)
    with pytest.raises(InvalidMedia, match="format UNKNOWN is not accepted"):
        decode_image(b"\x00garbage" * 10, LIMITS)


def test_the_accepted_formats_are_configurable() -> None:
    only_png = MediaLimits(image_formats=("PNG",), video_formats=("mp4",))
    assert decode_image(still("PNG"), only_png).size == (16, 12)
    with pytest.raises(InvalidMedia, match="format JPEG is not accepted; accepted: PNG"):
        decode_image(still("JPEG"), only_png)
    with pytest.raises(InvalidMedia, match="format GIF is not accepted"):
        decode_video(still("GIF"), only_png)
    with pytest.raises(ValueError, match="unknown dds"):
        MediaLimits(image_formats=("png", "dds"))
    wav = io.BytesIO()
    sf.write(wav, np.zeros(1600, dtype=np.float32), 16000, format="WAV")
    with pytest.raises(InvalidMedia, match="audio format 'wav' is not accepted; accepted: flac"):
        decode_audio(wav.getvalue(), "wav", MediaLimits(audio_formats=("flac",)))
    assert describe(still("DDS")) == "dds"


# --------------------------------------------------------------------------- work


def test_a_many_frame_huge_canvas_gif_is_refused_from_its_header() -> None:
    data = huge_canvas_gif(3600)
    t0 = time.perf_counter()
    with pytest.raises(MediaTooLarge, match="3600 frames of 4096x4096"):
        decode_video(data, LIMITS)
    with pytest.raises(MediaTooLarge):
        video_interval(data, LIMITS)
    assert time.perf_counter() - t0 < 10  # decoding it took minutes; the header alone, a fraction of a second
    # as an image only its first frame is decoded: one canvas
    assert decode_image(data, LIMITS).size == (4096, 4096)


def test_decoded_pixels_are_charged_frame_by_frame() -> None:
    # 8 frames of 64x64: within a budget of 8 canvases, over a budget of 5
    data = huge_canvas_gif(8, side=64)
    assert len(decode_video(data, MediaLimits(max_decode_pixels=8 * 64 * 64)).frames) == 4
    with pytest.raises(MediaTooLarge, match="8 frames of 64x64"):
        decode_video(data, MediaLimits(max_decode_pixels=5 * 64 * 64))
    budget = DecodeBudget(MediaLimits(max_decode_pixels=100))
    budget.charge(60, "video")
    with pytest.raises(MediaTooLarge, match="more than 100 pixels"):
        budget.charge(60, "video")


def test_what_a_decode_keeps_is_told_once_before_any_pixel_is_decoded() -> None:
    told: list[tuple[int, int, int, int]] = []

    def budget() -> DecodeBudget:
        b = DecodeBudget(LIMITS, reserve=lambda frames, w, h: told.append((frames, w, h, b.pixels)))
        return b

    decode_image(still("PNG", (40, 30)), LIMITS, budget())
    decode_video(huge_canvas_gif(8, side=64), LIMITS, budget())  # 4 of its 8 frames sampled
    decode_video(mp4(8), LIMITS, budget())
    video_interval(mp4(8), LIMITS, budget())  # keeps no frame: nothing to tell
    # an image's pixels are charged from its header before the report; a video's frames after it
    assert told == [(1, 40, 30, 40 * 30), (4, 64, 64, 0), (4, 64, 48, 0)]


def test_an_item_its_reservation_refuses_is_not_decoded() -> None:
    decoded = []

    def refuse(frames: int, w: int, h: int) -> None:
        raise PendingFull("held")

    for decode, data in ((decode_image, still("PNG")), (decode_video, huge_canvas_gif(8, side=64))):
        budget = DecodeBudget(LIMITS, reserve=refuse)
        with pytest.raises(PendingFull):  # not turned into the bytes' fault
            decoded.append(decode(data, LIMITS, budget))  # type: ignore[operator]
        assert budget.pixels <= 64 * 64  # at most the header's charge: no frame decoded
    assert not decoded


def test_a_decode_stops_when_its_time_is_spent() -> None:
    ticks = iter(range(1000))
    budget = DecodeBudget(MediaLimits(decode_timeout_s=3), clock=lambda: float(next(ticks)))
    # the clock reads 0 when the budget starts, then one second more at each frame's check: frames
    # 1 to 3 fit, the fourth is past the deadline
    data = huge_canvas_gif(8, side=64)
    with pytest.raises(MediaTooLarge, match="takes longer than 3 s; it was stopped"):
        decode_video(data, LIMITS, budget)
    assert budget.pixels == 4 * 64 * 64  # stopped at its fourth frame, not after the eighth


def test_a_decode_stops_when_its_request_is_abandoned() -> None:
    cancelled = threading.Event()
    cancelled.set()
    with pytest.raises(DecodeCancelled):
        decode_video(huge_canvas_gif(8, side=64), LIMITS, DecodeBudget(LIMITS, cancelled))


def test_cancelling_the_caller_stops_the_decode_thread() -> None:
    """A request abandoned mid-decode: the thread stops at its next frame, long before the item's
    frames would all be decoded."""
    data = huge_canvas_gif(120, side=2048)  # 120 canvases of 4 Mpx: seconds of work
    started, outcome = threading.Event(), []

    def work(cancelled: threading.Event) -> None:
        started.set()
        try:
            decode_video(data, LIMITS, DecodeBudget(LIMITS, cancelled))
            outcome.append("finished")
        except MediaError as e:
            outcome.append(e)

    async def main(pool: ThreadPoolExecutor) -> None:
        task = asyncio.ensure_future(run_decode(pool, work))
        while not started.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with ThreadPoolExecutor(1) as pool:
        t0 = time.perf_counter()
        asyncio.run(main(pool))
    assert len(outcome) == 1 and isinstance(outcome[0], DecodeCancelled), outcome
    assert time.perf_counter() - t0 < 30  # the whole decode would be far longer under any load


def test_a_container_longer_than_allowed_is_refused() -> None:
    from tests.corpus.media.generate import mp4

    data = mp4(frames=16)  # two seconds at 8 frames per second
    assert len(decode_video(data, LIMITS).frames) == 4
    with pytest.raises(MediaTooLarge, match="longer than 1 s"):
        decode_video(data, MediaLimits(max_video_seconds=1))
    with pytest.raises(MediaTooLarge, match="16 frames of 64x48"):
        decode_video(data, MediaLimits(max_decode_pixels=15 * 64 * 48))


# --------------------------------------------------------------------------- typed errors


def test_anything_a_decoder_raises_is_a_media_error() -> None:
    for raised in (IndexError("index out of range"), NotImplementedError(), KeyError("x"), RuntimeError("odd")):
        with pytest.raises(InvalidMedia, match="could not be decoded"), guarded("image"):
            raise raised
    with pytest.raises(MediaTooLarge), guarded("image"):
        raise MemoryError
    with pytest.raises(MediaTimeout), guarded("image"):  # media errors pass as they are
        raise MediaTimeout("slow")


@pytest.mark.parametrize("name", ["gif_truncated_index_error.gif", "gif_truncated_struct_error.gif"])
def test_truncated_gifs_that_broke_the_decoder_are_a_400(name: str) -> None:
    with pytest.raises(InvalidMedia, match="could not be decoded"):
        decode_video((CORPUS / name).read_bytes(), LIMITS)


def test_media_errors_carry_a_code_the_router_recognises() -> None:
    for error, status, code in (
        (InvalidMedia("bad"), 400, "invalid_media"),
        (MediaTooLarge("big"), 413, "media_too_large"),
        (MediaTimeout("slow"), 504, "media_timeout"),
    ):
        api = from_media_error(error)
        assert (api.status, api.code) == (status, code)
        assert about_media(api.to_json())
        back = passthrough_error(api.status, api.to_json())
        assert (back.status, back.code, back.message) == (status, code, error.message)
    assert not about_media(b'{"error": {"code": "encode_failed"}}') and not about_media(b"oops")


# --------------------------------------------------------------------------- the corpus, in process

# name → what each decode entry point does with it: None accepted, else the error it raises
EXPECTED: dict[str, dict[str, type[MediaError] | None]] = {
    "gif_3600_frames_4096_canvas.gif": {"image": None, "video": MediaTooLarge},
    "gif_400_frames_4096_canvas.gif": {"image": None, "video": MediaTooLarge},
    "gif_truncated_index_error.gif": {"image": None, "video": InvalidMedia},
    "gif_truncated_struct_error.gif": {"image": None, "video": InvalidMedia},
    "png_claims_100000x100000.png": {"image": MediaTooLarge, "video": MediaTooLarge},
    "png_4096x4096_bomb.png": {"image": None, "video": None},
    "dds_32x32.dds": {"image": InvalidMedia, "video": InvalidMedia, "audio": InvalidMedia},
    "sgi_32x32.sgi": {"image": InvalidMedia, "video": InvalidMedia},
    "tiff_32x32.tiff": {"image": InvalidMedia, "video": InvalidMedia},
    "mp4_truncated.mp4": {"image": InvalidMedia, "video": InvalidMedia},
    "wav_claims_hours.wav": {"image": InvalidMedia, "video": InvalidMedia, "audio": None},
}


def test_the_corpus_is_small_and_complete() -> None:
    files = {p.name for p in CORPUS.iterdir() if p.suffix != ".py" and p.is_file()}
    assert files == set(EXPECTED)
    assert sum((CORPUS / f).stat().st_size for f in files) < 200_000


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_corpus_file_is_accepted_or_refused_as_expected_within_its_budget(name: str) -> None:
    data = (CORPUS / name).read_bytes()
    decoders = {
        "image": lambda: decode_image(data, LIMITS),
        "video": lambda: decode_video(data, LIMITS),
        "audio": lambda: decode_audio(data, "wav", LIMITS),
    }
    for modality, expected in EXPECTED[name].items():
        t0 = time.perf_counter()
        if expected is None:
            decoders[modality]()
        else:
            with pytest.raises(expected):
                decoders[modality]()
        assert time.perf_counter() - t0 < LIMITS.decode_timeout_s + 5, (name, modality)


def test_the_routers_size_hint_reads_only_accepted_headers() -> None:
    from epdserve.router.dispatch import _data_url_image_size

    def url(data: bytes) -> str:
        return "data:image/png;base64," + base64.b64encode(data).decode()

    assert _data_url_image_size(url(still("PNG", (40, 30)))) == (40, 30)
    assert _data_url_image_size(url(still("GIF", (40, 30)))) == (40, 30)
    for name in ("dds_32x32.dds", "sgi_32x32.sgi", "tiff_32x32.tiff"):  # never parsed
        assert _data_url_image_size(url((CORPUS / name).read_bytes())) is None, name
    assert _data_url_image_size(url((CORPUS / "gif_truncated_struct_error.gif").read_bytes())) == (32, 24)
