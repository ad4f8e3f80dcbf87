"""Writes the synthetic files of this corpus (run from this folder: ``python generate.py``).

The truncated GIFs are cut from a small animated GIF at points where the image library raised
something other than its documented errors; they are kept as found, not regenerated."""

from __future__ import annotations

import io
import struct
import wave
import zlib
from pathlib import Path

import av
from PIL import Image

HERE = Path(__file__).parent


def huge_canvas_gif(frames: int, side: int = 4096) -> bytes:
    """``frames`` one-pixel frames on a ``side`` x ``side`` canvas: tiny, and a full canvas each to decode."""
    out = bytearray(b"GIF89a" + struct.pack("<HH", side, side) + bytes([0x80, 0, 0]) + bytes([0, 0, 0, 255, 255, 255]))
    for i in range(frames):
        out += b"\x21\xf9\x04\x04\x01\x00\x00\x00"  # graphic control: keep the canvas, 10 ms
        out += b"\x2c" + struct.pack("<HHHH", i % side, 0, 1, 1) + b"\x00"
        out += b"\x02\x02\x44\x01\x00"  # one pixel of LZW data
    return bytes(out + b"\x3b")


def png(width: int, height: int, bit_depth: int, color_type: int, rows: bytes) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, bit_depth, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def pillow(fmt: str, size: tuple[int, int] = (32, 32)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (10, 200, 30)).save(buf, format=fmt)
    return buf.getvalue()


def mp4(frames: int = 8) -> bytes:
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            img = Image.new("RGB", (64, 48), (i * 30 % 256, 90, 160))
            for packet in stream.encode(av.VideoFrame.from_image(img)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def wav_claiming_hours() -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(3200))
    data = bytearray(buf.getvalue())
    data[40:44] = struct.pack("<I", 0x7FFFFFF0)  # the data chunk's length: hours of samples
    return bytes(data)


def main() -> None:
    files = {
        "gif_3600_frames_4096_canvas.gif": huge_canvas_gif(3600),
        "gif_400_frames_4096_canvas.gif": huge_canvas_gif(400),
        "png_claims_100000x100000.png": png(100000, 100000, 1, 0, bytes(64)),
        # a decompression bomb inside the pixel limit: 2 MB of pixels from about 2 KB
        "png_4096x4096_bomb.png": png(4096, 4096, 1, 0, (b"\x00" + bytes(512)) * 4096),
        "dds_32x32.dds": pillow("DDS"),
        "sgi_32x32.sgi": pillow("SGI"),
        "tiff_32x32.tiff": pillow("TIFF"),
        "mp4_truncated.mp4": (whole := mp4())[: len(whole) // 2],
        "wav_claims_hours.wav": wav_claiming_hours(),
    }
    for name, data in files.items():
        (HERE / name).write_bytes(data)


if __name__ == "__main__":
    main()
