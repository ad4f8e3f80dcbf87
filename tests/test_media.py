"""Media edge: data URLs, guarded http fetching (loopback server only), decoding limits, content hashes.

No test sends traffic anywhere but 127.0.0.1: private-address cases must be refused before a
connection is attempted, which the trace counters check.
"""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import aiohttp
import av
import pytest
from aiohttp import web
from PIL import Image

from epdserve.media.decode import decode_image, decode_video, video_interval
from epdserve.media.errors import InvalidMedia, MediaTimeout, MediaTooLarge
from epdserve.media.fetch import GuardedResolver, address_is_public, load_media_bytes, media_session
from epdserve.media.hashing import media_uuid
from epdserve.media.limits import MAX_SECOND_PER_GRID, MediaLimits
from epdserve.media.processor import ProcessorConfig

T = TypeVar("T")
LIMITS = MediaLimits()
LOCAL = MediaLimits(allow_private_addresses=True, fetch_timeout_s=2.0)


def run(coro: Awaitable[T]) -> T:
    async def main() -> T:
        return await coro

    return asyncio.run(main())


def png(size: tuple[int, int] = (8, 6), color: int | tuple[int, ...] = (10, 200, 30), mode: str = "RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, color).save(buf, format="PNG")
    return buf.getvalue()


def with_png_size(data: bytes, width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` (valid CRC) while the file stays tiny."""
    assert data[12:16] == b"IHDR"
    ihdr = struct.pack(">II", width, height) + data[24:29]
    crc = struct.pack(">I", zlib.crc32(b"IHDR" + ihdr) & 0xFFFFFFFF)
    return data[:16] + ihdr + crc + data[33:]


COLORS = [(30 * i, 255 - 30 * i, (70 * i) % 256) for i in range(8)]


def gif(colors: list[tuple[int, int, int]], duration: int | list[int] = 50, fmt: str = "GIF") -> bytes:
    """An animated GIF (or ``fmt``) of the colors, each frame ``duration`` ms (0: no timing)."""
    frames = [Image.new("RGB", (16, 12), c) for c in colors]
    buf = io.BytesIO()
    timing = {"duration": duration} if duration else {}
    frames[0].save(buf, format=fmt, save_all=True, append_images=frames[1:], loop=0, **timing)
    return buf.getvalue()


def encoded_video(colors: list[tuple[int, int, int]], container: str, codec: str) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=8)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for c in colors:
            for packet in stream.encode(av.VideoFrame.from_image(Image.new("RGB", (64, 48), c))):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def close_to(img: Image.Image, color: tuple[int, int, int], tol: int) -> bool:
    got = img.getpixel((img.width // 2, img.height // 2))
    assert isinstance(got, tuple)
    return all(abs(a - b) <= tol for a, b in zip(got, color, strict=True))


# --------------------------------------------------------------------------- data URLs


def test_data_urls() -> None:
    raw = png()
    b64 = base64.b64encode(raw).decode()
    assert run(load_media_bytes(f"data:image/png;base64,{b64}", LIMITS)) == raw
    assert run(load_media_bytes(f"data:;base64,{b64}", LIMITS)) == raw
    assert run(load_media_bytes(f"DATA:image/png;base64,{b64.rstrip('=')}", LIMITS)) == raw  # padding optional
    wrapped = "\n".join(b64[i : i + 76] for i in range(0, len(b64), 76))
    assert run(load_media_bytes(f"data:image/png;base64,{wrapped}", LIMITS)) == raw
    assert run(load_media_bytes("data:text/plain,hello%20world", LIMITS)) == b"hello world"


@pytest.mark.parametrize(
    "url", ["data:image/png;base64,!!!notbase64!!!", "data:image/png;base64,AAAAA", "data:image/png;base64", "data:,"]
)
def test_bad_data_urls(url: str) -> None:
    with pytest.raises(InvalidMedia):
        run(load_media_bytes(url, LIMITS))


def test_data_url_too_large() -> None:
    small = MediaLimits(max_bytes=100)
    url = "data:image/png;base64," + base64.b64encode(bytes(1000)).decode()
    with pytest.raises(MediaTooLarge) as info:
        run(load_media_bytes(url, small))
    assert isinstance(info.value, MediaTooLarge)
    assert run(load_media_bytes("data:;base64," + base64.b64encode(bytes(100)).decode(), small)) == bytes(100)


# --------------------------------------------------------------------------- URL policy (no traffic)


def counting_session() -> tuple[aiohttp.ClientSession, list[str]]:
    """A plain session that records every request and connection attempt."""
    seen: list[str] = []
    trace = aiohttp.TraceConfig()

    async def on_request(session: Any, ctx: Any, params: Any) -> None:
        seen.append(f"request {params.url}")

    async def on_connect(session: Any, ctx: Any, params: Any) -> None:
        seen.append("connect")

    trace.on_request_start.append(on_request)
    trace.on_connection_create_start.append(on_connect)
    return aiohttp.ClientSession(trace_configs=[trace]), seen


PRIVATE_URLS = [
    "http://127.0.0.1/x",
    "http://169.254.169.254/latest/meta-data/",
    "http://10.0.0.1/",
    "http://192.168.1.1:8080/a.png",
    "http://172.16.0.1/",
    "http://100.64.0.1/",  # carrier-grade NAT
    "http://0.0.0.0/",
    "http://224.0.0.1/",  # multicast
    "http://240.0.0.1/",  # reserved
    "http://[::1]/",
    "http://[::ffff:127.0.0.1]/",
    "http://[fe80::1]/",
    "http://[fd00::1]/",
    "https://localhost:1/x",  # a name resolving to loopback (/etc/hosts, no traffic)
]


@pytest.mark.parametrize("url", PRIVATE_URLS)
def test_private_addresses_refused_before_connecting(url: str) -> None:
    async def attempt() -> list[str]:
        session, seen = counting_session()
        async with session:
            with pytest.raises(InvalidMedia) as info:
                await load_media_bytes(url, LIMITS, session)
        assert "refused" in info.value.message
        with pytest.raises(InvalidMedia):
            await load_media_bytes(url, LIMITS)  # our own guarded session
        return seen

    assert run(attempt()) == []


def test_address_classification() -> None:
    assert address_is_public("8.8.8.8") and address_is_public("2001:4860:4860::8888")
    for a in ["127.0.0.1", "10.1.2.3", "169.254.169.254", "::1", "::ffff:10.0.0.1", "64:ff9b::a00:1", "nonsense"]:
        assert not address_is_public(a), a


def test_guarded_resolver_checks_resolved_addresses() -> None:
    async def resolve(limits: MediaLimits) -> list[Any]:
        return await GuardedResolver(limits).resolve("localhost", 80)

    with pytest.raises(InvalidMedia):
        run(resolve(LIMITS))
    assert run(resolve(LOCAL))


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/a.png", "gopher://x/", "/relative/path.png"])
def test_other_schemes_refused(url: str) -> None:
    with pytest.raises(InvalidMedia) as info:
        run(load_media_bytes(url, LOCAL))
    assert "scheme" in info.value.message


def test_domain_allowlist_refuses_before_resolving() -> None:
    limits = MediaLimits(allowed_media_domains=("media.example.org",))
    assert limits.domain_allowed("MEDIA.example.org.")

    async def attempt() -> list[str]:
        session, seen = counting_session()
        async with session:
            with pytest.raises(InvalidMedia) as info:
                await load_media_bytes("https://example.com/a.png", limits, session)
        assert "allowed media domains" in info.value.message
        return seen

    assert run(attempt()) == []


# --------------------------------------------------------------------------- fetching from a loopback server


@asynccontextmanager
async def media_server() -> AsyncIterator[str]:
    image = png((5, 4))

    async def serve_png(request: web.Request) -> web.Response:
        return web.Response(body=image, content_type="image/png")

    async def big(request: web.Request) -> web.Response:
        return web.Response(body=bytes(5000), content_type="image/png")

    async def big_chunked(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()  # no Content-Length: the reader must stop on its own
        await resp.prepare(request)
        for _ in range(100):
            await resp.write(bytes(512))
        await resp.write_eof()
        return resp

    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(3)
        return web.Response(body=image)

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPFound(str(request.query.get("to", "/png")))

    async def missing(request: web.Request) -> web.Response:
        raise web.HTTPNotFound()

    app = web.Application()
    for path, handler in [
        ("/png", serve_png),
        ("/big", big),
        ("/big-chunked", big_chunked),
        ("/slow", slow),
        ("/redirect", redirect),
        ("/missing", missing),
    ]:
        app.router.add_get(path, handler)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def with_server(test: Callable[[str], Awaitable[None]]) -> None:
    async def main() -> None:
        async with media_server() as base:
            await test(base)

    asyncio.run(main())


def test_fetch_png_from_loopback_when_allowed() -> None:
    async def test(base: str) -> None:
        data = await load_media_bytes(f"{base}/png", LOCAL)
        assert decode_image(data, LOCAL).size == (5, 4)
        session, seen = counting_session()  # the counters used by the refusal tests do see traffic
        async with session:
            assert await load_media_bytes(f"{base}/png", LOCAL, session) == data
        assert seen == [f"request {base}/png", "connect"]
        async with media_session(LOCAL) as session:
            assert await load_media_bytes(f"{base}/redirect", LOCAL, session) == data
        only_loopback_ip = MediaLimits(allow_private_addresses=True, allowed_media_domains=("127.0.0.1",))
        assert await load_media_bytes(f"{base}/png", only_loopback_ip) == data
        # redirects are re-checked: localhost is not an allowed domain
        port = base.rsplit(":", 1)[1]
        with pytest.raises(InvalidMedia) as info:
            await load_media_bytes(f"{base}/redirect?to=http://localhost:{port}/png", only_loopback_ip)
        assert "allowed media domains" in info.value.message
        # and the default policy refuses the loopback server outright
        with pytest.raises(InvalidMedia):
            await load_media_bytes(f"{base}/png", LIMITS)

    with_server(test)


def test_fetch_errors() -> None:
    small = MediaLimits(allow_private_addresses=True, max_bytes=1000, fetch_timeout_s=0.3, max_redirects=0)

    async def test(base: str) -> None:
        for path in ("/big", "/big-chunked"):
            with pytest.raises(MediaTooLarge):
                await load_media_bytes(base + path, small)
        start = time.monotonic()
        with pytest.raises(MediaTimeout):
            await load_media_bytes(base + "/slow", small)
        assert time.monotonic() - start < 2
        with pytest.raises(InvalidMedia) as bad:
            await load_media_bytes(base + "/missing", small)
        assert "HTTP 404" in bad.value.message
        with pytest.raises(InvalidMedia) as bad:
            await load_media_bytes(base + "/redirect", small)
        assert "redirects" in bad.value.message

    with_server(test)


def test_unreachable_host_is_bad_request() -> None:
    async def main() -> None:
        async with media_server() as base:
            pass  # the server is gone once the context exits; its port refuses connections
        with pytest.raises(InvalidMedia) as info:
            await load_media_bytes(f"{base}/png", LOCAL)
        assert "Could not fetch" in info.value.message

    asyncio.run(main())


# --------------------------------------------------------------------------- images


def test_decode_image_to_rgb() -> None:
    img = decode_image(png((8, 6), (10, 200, 30)), LIMITS)
    assert img.mode == "RGB" and img.size == (8, 6) and img.getpixel((0, 0)) == (10, 200, 30)
    grey = decode_image(png((3, 3), 77, mode="L"), LIMITS)
    assert grey.mode == "RGB" and grey.getpixel((1, 1)) == (77, 77, 77)
    clear = decode_image(png((4, 4), (0, 0, 0, 0), mode="RGBA"), LIMITS)
    assert clear.getpixel((0, 0)) == (255, 255, 255)  # transparency on white, like transformers


@pytest.mark.parametrize("data", [b"", b"not an image at all", png()[:40], b"\x89PNG\r\n\x1a\n" + bytes(50)])
def test_not_an_image(data: bytes) -> None:
    with pytest.raises(InvalidMedia):
        decode_image(data, LIMITS)


@pytest.mark.parametrize("size", [(5000, 5000), (20000, 20000)])
def test_decompression_bomb_refused_from_header(size: tuple[int, int]) -> None:
    bomb = with_png_size(png((1, 1)), *size)
    assert len(bomb) < 100
    with pytest.raises(MediaTooLarge) as info:
        decode_image(bomb, LIMITS)
    assert isinstance(info.value, MediaTooLarge)
    with pytest.raises(MediaTooLarge):
        decode_video(bomb, LIMITS)


def test_pixel_and_byte_limits() -> None:
    with pytest.raises(MediaTooLarge):
        decode_image(png((20, 20)), MediaLimits(max_image_pixels=399))
    assert decode_image(png((20, 20)), MediaLimits(max_image_pixels=400)).size == (20, 20)
    with pytest.raises(MediaTooLarge):
        decode_image(png((20, 20)), MediaLimits(max_bytes=10))


# --------------------------------------------------------------------------- videos


def test_gif_frames_sampled_evenly() -> None:
    frames = decode_video(gif(COLORS), LIMITS).frames
    assert len(frames) == 4 and all(f.mode == "RGB" and f.size == (16, 12) for f in frames)
    for f, i in zip(frames, [0, 2, 5, 7], strict=True):
        assert close_to(f, COLORS[i], 8), i
    assert len(decode_video(gif(COLORS[:3]), LIMITS).frames) == 3
    with pytest.raises(MediaTooLarge):
        decode_video(gif(COLORS), MediaLimits(max_video_frames=7))


def test_still_image_is_one_frame_video() -> None:
    frames = decode_video(png((8, 6)), LIMITS).frames
    assert len(frames) == 1 and frames[0].size == (8, 6)


@pytest.mark.parametrize(("container", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx")])
def test_encoded_video_frames_sampled_evenly(container: str, codec: str) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} encoder not available")
    data = encoded_video(COLORS, container, codec)
    frames = decode_video(data, LIMITS).frames
    assert len(frames) == 4 and all(f.mode == "RGB" and f.size == (64, 48) for f in frames)
    for f, i in zip(frames, [0, 2, 5, 7], strict=True):
        assert close_to(f, COLORS[i], 20), i
    assert len(decode_video(data, MediaLimits(video_frames=8)).frames) == 8
    with pytest.raises(MediaTooLarge):
        decode_video(data, MediaLimits(max_video_frames=5))
    with pytest.raises(MediaTooLarge):
        decode_video(data, MediaLimits(max_image_pixels=64 * 48 - 1))
    with pytest.raises(InvalidMedia):
        decode_image(data, LIMITS)


# frames 0, 2, 5, 7 of 8 are sampled: the interval is the span to frame 7 over 3 steps
@pytest.mark.parametrize(
    ("duration", "interval"),
    [(100, 0.7 / 3), (500, 3.5 / 3), ([100, 500] * 4, 1.9 / 3)],
)
@pytest.mark.parametrize("fmt", ["GIF", "WEBP"])
def test_animated_video_reports_the_sampled_frames_interval(
    duration: int | list[int], interval: float, fmt: str
) -> None:
    if fmt not in Image.SAVE_ALL:
        pytest.skip(f"Pillow cannot write animated {fmt}")
    data = gif(COLORS, duration, fmt)
    video = decode_video(data, LIMITS)
    assert len(video.frames) == 4 and video.interval_s == pytest.approx(interval)
    assert video_interval(data, LIMITS) == video.interval_s  # the timing of a cached item: the same
    # all 3 frames sampled: one frame apart; a single frame: its own duration
    assert decode_video(gif(COLORS[:3], 250), LIMITS).interval_s == pytest.approx(0.25)
    assert decode_video(gif(COLORS[:1], 250), LIMITS).interval_s == pytest.approx(0.25)


def test_video_without_timing_falls_back_to_the_processor_fps() -> None:
    for data in (gif(COLORS, duration=0), png((8, 6))):
        assert decode_video(data, LIMITS).interval_s is None
        assert video_interval(data, LIMITS) is None
    config = ProcessorConfig(temporal_patch_size=2, video_fps=2.0)
    assert config.video_second_per_grid(None) == config.second_per_grid == 1.0
    assert config.video_second_per_grid(0.25) == 0.5
    assert config.video_second_per_grid(1e9) == MAX_SECOND_PER_GRID  # from client bytes: bounded


@pytest.mark.parametrize(("container", "codec"), [("mp4", "mpeg4"), ("webm", "libvpx")])
def test_encoded_video_reports_the_sampled_frames_interval(container: str, codec: str) -> None:
    if codec not in av.codecs_available:
        pytest.skip(f"{codec} encoder not available")
    data = encoded_video(COLORS, container, codec)  # 8 frames per second
    video = decode_video(data, LIMITS)
    assert video.interval_s == pytest.approx(7 / 8 / 3, rel=1e-3)
    assert video_interval(data, LIMITS) == video.interval_s
    assert decode_video(data, MediaLimits(video_frames=8)).interval_s == pytest.approx(1 / 8, rel=1e-3)


@pytest.mark.parametrize("data", [b"", b"garbage" * 100, b"\x00\x00\x00\x20ftypisom" + bytes(200)])
def test_not_a_video(data: bytes) -> None:
    with pytest.raises(InvalidMedia):
        decode_video(data, LIMITS)


# --------------------------------------------------------------------------- hashing


def test_media_uuid_stable_and_sensitive() -> None:
    kwargs = {"max_pixels": 12544, "min_pixels": 3136, "image_mean": (0.5, 0.5, 0.5)}
    base = media_uuid("qwen2-vl", "image", b"pixels", kwargs)
    # pinned: caches on other processes and hosts must agree on it across releases
    assert base == "75f975b81bab4b68211b75db2d65b9bce541497db1ad0a502a681f5819ce9438"
    assert media_uuid("qwen2-vl", "image", b"pixels", dict(reversed(list(kwargs.items())))) == base
    changed = [
        media_uuid("qwen2-vl-2", "image", b"pixels", kwargs),
        media_uuid("qwen2-vl", "video", b"pixels", kwargs),
        media_uuid("qwen2-vl", "image", b"pixelz", kwargs),
        media_uuid("qwen2-vl", "image", b"pixels", {**kwargs, "max_pixels": 12545}),
        media_uuid("qwen2-vl", "image", b"pixels", {}),
    ]
    assert len({base, *changed}) == len(changed) + 1
    # fields are length-prefixed: moving bytes across a boundary changes the hash
    assert media_uuid("ab", "c", b"", {}) != media_uuid("a", "bc", b"", {})
    with pytest.raises(ValueError):
        media_uuid("m", "image", b"x", {"bad": float("nan")})
