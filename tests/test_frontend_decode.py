"""Frontend media decoding (``--frontend-decode``): the router fetches and decodes media and hands
the encoders pixels through its shm slab.

Unit: the pixel handle (round trip, every forgery and every out-of-limit header refused), frames
the router resizes preprocess exactly as the originals, the router stays torch-free. Integration
(real processes on loopback): greedy answers identical with the flag on and off, the encoder did
not fetch or decode, items keep the uuid the encoder gives them, forged pixel handles get a 4xx
while the deployment keeps serving, no lease or slab outlives its use.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pytest
from PIL import Image

from epdserve.api.errors import BadRequest
from epdserve.api.metrics import Metrics
from epdserve.api.timing import parse_server_timing
from epdserve.bench.workload import gif_data_url
from epdserve.encoder.protocol import ENCODER_PROTOCOL_VERSION, decode_request
from epdserve.media.decode import decode_video
from epdserve.media.hashing import media_uuid
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.router.frontend_decode import FrontendDecodeConfig, FrontendDecoder
from epdserve.security.credentials import ClusterCredential
from epdserve.shapes import ShapesWorld, render_images
from epdserve.transfer import signing
from epdserve.transfer.base import InvalidHandle, TransferError
from epdserve.transfer.config import HANDLE_PURPOSE, PIXEL_HANDLE_PURPOSE, ECConfig
from epdserve.transfer.pixels import PixelItem, PixelProducer, PixelReader, processor_digest
from epdserve.up import Deployment, Topology
from tests.server_utils import http, internal_headers, signed_headers
from tests.test_topologies import MODEL, ask, data_url, request_set

SECRET = "frontend-decode-test-secret-0123456789abcdef"
UUID = "ab" * 32


def pixel_pair(tmp_path: Path, limits: MediaLimits | None = None) -> tuple[PixelProducer, PixelReader, ECConfig]:
    (tmp_path / "shm").mkdir(exist_ok=True)
    cfg = ECConfig(shm_bytes=1 << 20, shm_dir=str(tmp_path / "shm"), secret=SECRET, instance="router-test")
    reader = PixelReader(cfg, MODEL, "settings", limits or MediaLimits(video_frames=4))
    return PixelProducer(cfg), reader, cfg


def frames(t: int = 1, h: int = 28, w: int = 56) -> np.ndarray:
    return np.random.default_rng(t * h * w).integers(0, 256, (t, h, w, 3), dtype=np.uint8)


def pixel_key() -> bytes:
    return ClusterCredential.from_text(SECRET).derive(PIXEL_HANDLE_PURPOSE)


# ---------------------------------------------------------------------------------------- unit


def test_a_pixel_handle_round_trips(tmp_path: Path) -> None:
    producer, reader, _ = pixel_pair(tmp_path)
    sent = frames(3)
    handle = producer.put(UUID, MODEL, "video", "settings", sent, interval_s=0.25)
    assert handle["shape"] == [3, 28, 56, 3] and handle["dtype"] == "uint8"
    assert reader.uuid(handle, "video") == UUID
    assert reader.item(handle, "video") == PixelItem(UUID, 0.25)  # the clip's timing, for the encoder's answer
    got = reader.read(handle, "video")
    assert got.dtype == np.uint8 and np.array_equal(got, sent)
    assert producer.live_handles == 1 and producer.release(handle)
    assert producer.live_handles == 0 and producer.held_bytes == 0
    with pytest.raises(InvalidHandle):  # released: the region is gone
        reader.read(handle, "video")
    producer.close()
    assert not list((tmp_path / "shm").iterdir())  # the slab goes with its producer


def test_forged_and_out_of_limit_pixel_handles_are_refused(tmp_path: Path) -> None:
    producer, reader, cfg = pixel_pair(tmp_path, MediaLimits(video_frames=4, max_image_pixels=28 * 56))
    good = producer.put(UUID, MODEL, "image", "settings", frames())
    key = pixel_key()
    ec_key = ClusterCredential.from_text(SECRET).derive(HANDLE_PURPOSE)
    other = ClusterCredential.from_text("another-cluster-secret-0123456789abcdef").derive(PIXEL_HANDLE_PURPOSE)
    fields = {k: v for k, v in good.items() if k != "mac"}
    bad: list[tuple[Any, str]] = [
        ({**good, "shape": [1, 56, 28, 3]}, "signature"),  # tampered, not re-signed
        ({**good, "mac": "0" * 64}, "signature"),
        (signing.sign(fields, ec_key), "signature"),  # an embedding handle's key: another purpose
        (signing.sign(fields, other), "signature"),  # another cluster
        ("not a handle", "JSON object"),
        # signed with the pixel key (what a buggy router could send): the checks behind the MAC
        (signing.sign({**fields, "dtype": "float32"}, key), "uint8"),
        (signing.sign({**fields, "key": "../../etc"}, key), "uuid"),
        (signing.sign({**fields, "model_id": "other"}, key), "another model"),
        (signing.sign({**fields, "processor": "other"}, key), "another model"),
        (signing.sign({**fields, "modality": "video"}, key), "holds a video"),
        (signing.sign({**fields, "shape": [2, 28, 56, 3], "nbytes": 2 * 28 * 56 * 3}, key), "frames"),
        (signing.sign({**fields, "shape": [1, 56, 56, 3], "nbytes": 56 * 56 * 3}, key), "pixel limit"),
        (signing.sign({**fields, "shape": [1, 28, 56]}, key), "shape"),
        (signing.sign({**fields, "nbytes": 10}, key), "bytes"),
        (signing.sign({**fields, "interval_s": -1.0}, key), "malformed"),
        (signing.sign({**fields, "interval_s": 1e9}, key), "malformed"),
    ]
    for handle, why in bad:
        with pytest.raises(InvalidHandle, match=why):
            reader.uuid(handle, "image")
        with pytest.raises(InvalidHandle, match=why):
            reader.read(handle, "image")
    with pytest.raises(TransferError, match="not an EC slab"):  # signed, but pointing elsewhere
        reader.read(signing.sign({**fields, "path": "/etc/passwd"}, key), "image")
    with pytest.raises(TransferError, match="not the ones the handle describes"):
        reader.read(signing.sign({**fields, "checksum": "0" * 16}, key), "image")
    assert np.array_equal(reader.read(good, "image"), frames())  # the positive control
    video = producer.put(UUID, MODEL, "video", "settings", frames(5))
    with pytest.raises(InvalidHandle, match="5 frames"):
        reader.read(video, "video")
    producer.close()
    asyncio.run(reader.close())
    assert cfg.handle_purpose == HANDLE_PURPOSE  # the caller's config is not changed


def test_resized_frames_preprocess_exactly_as_the_originals(model_dir: Path) -> None:
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    rng = np.random.default_rng(0)
    unsized = []
    for w, h in [(64, 48), (333, 97), (30, 30), (1000, 20), (97, 401)]:
        img = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        small = proc.resized_image(img)
        if not proc.is_resized(small.height, small.width, "image"):
            unsized.append((w, h))  # the encoder would resize it again: the router sends its URL
            continue
        sent = Image.fromarray(np.asarray(small))  # what crosses the slab
        a, b = proc.image(img), proc.image(sent)
        assert a.grid_thw == b.grid_thw and np.array_equal(a.pixel_values, b.pixel_values)
    assert unsized == [(1000, 20)]  # 50:1 rounds to 784x28, below min_pixels: resized again
    video = [Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)) for _ in range(3)]
    sent_frames = [Image.fromarray(np.asarray(f)) for f in proc.resized_video(video)]
    a, b = proc.video(video), proc.video(sent_frames)
    assert a.grid_thw == b.grid_thw and np.array_equal(a.pixel_values, b.pixel_values)


def test_a_decoded_video_hands_its_timing_to_the_encoder(model_dir: Path) -> None:
    """The router decodes: the sampled frames' interval goes into the pixel handle, as the encoder
    would have read it from the same bytes."""
    limits = MediaLimits()
    cluster = ClusterCredential.from_text(SECRET)
    config = FrontendDecodeConfig(enabled=True, shm_bytes=1 << 20)
    decoder = FrontendDecoder(config, model_dir, limits, cluster, "router-test", 30.0, Metrics())
    kwargs = ProcessorConfig.from_pretrained(model_dir).hash_kwargs(limits.video_frames)
    ec = ECConfig(shm_bytes=1 << 20, secret=SECRET, instance="router-test")
    reader = PixelReader(ec, MODEL, processor_digest(MODEL, kwargs), limits)
    try:
        url = gif_data_url(ShapesWorld(5).video().frames())  # 100 ms frames
        data = base64.b64decode(url.split(",", 1)[1])
        handle = decoder._decode(MODEL, "video", url, None, time.perf_counter())
        assert handle is not None
        assert reader.item(handle, "video").interval_s == decode_video(data, limits).interval_s == pytest.approx(0.1)
        decoder.producer.release(handle)
    finally:
        asyncio.run(decoder.close())
        asyncio.run(reader.close())


def test_an_encoder_counts_a_pixel_handles_item_before_making_its_patches(model_dir: Path, tmp_path: Path) -> None:
    """Frames the router decoded are counted against the encoder's bound of pending media before
    they are made into patches, at what that holds at most."""
    from epdserve.api.auth import AuthConfig
    from epdserve.encoder.protocol import EncodeItem
    from epdserve.encoder.server import EncoderConfig, EncoderService

    (tmp_path / "shm").mkdir()
    ec = ECConfig(shm_bytes=1 << 20, shm_dir=str(tmp_path / "shm"), secret=SECRET, instance="encoder-test")
    auth = AuthConfig(cluster=ClusterCredential.from_text(SECRET))
    service = EncoderService(EncoderConfig(model=model_dir, threads=1, ec=ec, auth=auth))
    producer = PixelProducer(dataclasses.replace(ec, instance="router-test"))
    processor = service.processor
    kwargs = processor.config.hash_kwargs(MediaLimits().video_frames)
    sent = frames(1, 56, 84)
    handle = producer.put(UUID, MODEL, "image", processor_digest(MODEL, kwargs), sent)
    held: list[int] = []
    real = processor.image

    def image(img: Image.Image):  # type: ignore[no-untyped-def]
        assert held == [processor.footprint("image", 1, 84, 56)]  # counted before the patches are made
        return real(img)

    processor.image = image  # type: ignore[method-assign]
    try:
        out = service._preprocess(EncodeItem(modality="image", pixels=handle), None, held.append)
        assert out.pixel_values is not None and out.pixel_values.nbytes < held[0]
    finally:
        processor.image = real  # type: ignore[method-assign]
        producer.close()
        asyncio.run(service.close())


def test_an_encode_item_carries_a_url_or_pixels() -> None:
    def body(item: dict) -> bytes:
        return msgspec.json.encode({"version": ENCODER_PROTOCOL_VERSION, "model": MODEL, "items": [item]})

    assert decode_request(body({"modality": "image", "url": "data:,x"}), 4).items[0].pixels is None
    assert decode_request(body({"modality": "image", "pixels": {"a": 1}}), 4).items[0].url is None
    for item in ({"modality": "image"}, {"modality": "image", "url": "data:,x", "pixels": {}}):
        with pytest.raises(BadRequest, match="exactly one"):
            decode_request(body(item), 4)


def test_the_router_stays_torch_free_with_frontend_decode() -> None:
    code = (
        "import sys; import epdserve.router.server, epdserve.router.frontend_decode, epdserve.transfer.pixels; "
        "print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_up_passes_the_flags_to_the_router_alone() -> None:
    from epdserve.cli import build_parser, router_config, up_deployment
    from epdserve.router.frontend_decode import FrontendDecodeConfig

    argv = ["up", "--frontend-decode", "--frontend-decode-workers", "3"]
    d = up_deployment(build_parser("up").parse_args(argv))
    flags = ["--frontend-decode", "--frontend-decode-workers", "3"]
    assert " ".join(flags) in " ".join(d.extra_router_args)
    assert not set(flags[:2]) & {*d.extra_encoder_args, *d.extra_pd_args, *d.extra_args}
    config = router_config(build_parser("router").parse_args(["router", *d.extra_router_args]))
    assert config.frontend == FrontendDecodeConfig(enabled=True, workers=3)
    plain = up_deployment(build_parser("up").parse_args(["up"]))
    assert not router_config(build_parser("router").parse_args(["router", *plain.extra_router_args])).frontend.enabled


# -------------------------------------------------------------------------------- integration


def start(frontend: bool) -> Deployment:
    d = Deployment(
        Topology.parse("1e+1pd"),
        None,
        port=0,
        extra_pd_args=["--max-model-len", "1024"],
        extra_router_args=["--frontend-decode"] if frontend else [],
    )
    d.start()
    return d


@pytest.fixture(scope="module")
def on() -> Iterator[Deployment]:
    d = start(frontend=True)
    try:
        yield d
    finally:
        d.stop()


def role(d: Deployment, name: str) -> str:
    return next(r.url for r in d.roles if r.name.startswith(name))


def metric(url: str, name: str, labels: str = "") -> float:
    status, body = http("GET", url + "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith(f"epd_{name}{labels} "):
            return float(line.split()[-1])
    raise AssertionError(f"epd_{name}{labels} not exported by {url}")


def image_url(seed: int, size: tuple[int, int] = (96, 64)) -> str:
    img = render_images(ShapesWorld(seed).sample("describe"))[0].resize(size)
    return data_url(img)


def chat(url: str, parts: list[dict], timing: bool = False) -> tuple[int, dict, dict[str, str]]:
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": parts}]}
    import urllib.error
    import urllib.request

    data = msgspec.json.encode(body)
    target = url + "/v1/chat/completions"
    req = urllib.request.Request(
        target,
        data=data,
        headers={
            "Content-Type": "application/json",
            **({"X-EPD-Timing": "1", **signed_headers("POST", target, data)} if timing else {}),
        },
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, msgspec.json.decode(r.read()), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, msgspec.json.decode(e.read()), dict(e.headers)


def test_greedy_answers_are_the_same_with_the_flag_on_and_off(on: Deployment) -> None:
    reqs = request_set()  # text, images of several sizes, a video, a repeated image; stream and not
    pixels = ("router_frontend_decode_items_total", '{outcome="pixels"}')
    before = metric(role(on, "encoder"), "encoder_pixel_items_total"), metric(on.url, *pixels)
    with_flag = [ask(on.url, r) for r in reqs]
    items = sum(isinstance(p, dict) and p.get("type") != "text" for r in reqs[1:] for p in r["messages"][0]["content"])
    assert items == 9
    # every media item went as pixels (repeated ones too: the encoder's cache answers them)
    assert metric(on.url, *pixels) - before[1] == items
    assert metric(role(on, "encoder"), "encoder_pixel_items_total") - before[0] == items
    off = start(frontend=False)
    try:
        without = [ask(off.url, r) for r in reqs]
        assert metric(role(off, "encoder"), "encoder_pixel_items_total") == 0
    finally:
        off.stop()
    assert with_flag == without
    assert all(a for a in with_flag)


def test_the_encoder_does_not_fetch_or_decode_and_items_keep_their_uuid(on: Deployment) -> None:
    enc = role(on, "encoder")
    url = image_url(7, (120, 90))
    status, _, headers = chat(on.url, [{"type": "image_url", "image_url": {"url": url}}], timing=True)
    assert status == 200
    timing = parse_server_timing(headers["Server-Timing"])
    assert timing["router_decode"] > 0 and timing["encoder_fetch"] == 0, timing
    assert 'media;desc="1 computed"' in headers["Server-Timing"]
    assert metric(on.url, "router_stage_seconds_count", '{stage="router_decode"}') >= 1
    assert metric(on.url, "router_frontend_decode_seconds_count") >= 1
    # the same image by URL straight to the encoder: its own hash finds what the router's put in its cache
    payload = {"version": ENCODER_PROTOCOL_VERSION, "model": MODEL, "items": [{"modality": "image", "url": url}]}
    status, raw = http("POST", enc + "/v1/encode", msgspec.json.encode(payload), headers=internal_headers())
    assert status == 200
    item = msgspec.json.decode(raw)["items"][0]
    assert item["status"] == "cache_hit"
    kwargs = ProcessorConfig.from_pretrained(on_model_dir()).hash_kwargs(MediaLimits().video_frames)
    data = base64.b64decode(url.split(",", 1)[1])
    assert item["uuid"] == media_uuid(MODEL, "image", data, kwargs)
    http("POST", enc + "/v1/release", msgspec.json.encode({"version": ENCODER_PROTOCOL_VERSION,
         "handles": [item["ec_handle"]]}), headers=internal_headers())  # fmt: skip


def on_model_dir() -> Path:
    from epdserve.assets import default_model_dir

    return default_model_dir()


def test_forged_pixel_handles_get_a_4xx_and_the_deployment_keeps_serving(on: Deployment, tmp_path: Path) -> None:
    enc = role(on, "encoder")
    cluster = ClusterCredential.load()
    assert cluster is not None  # conftest: the deployment's roles share the test session's secret
    kwargs = ProcessorConfig.from_pretrained(on_model_dir()).hash_kwargs(MediaLimits().video_frames)
    # a producer holding the cluster secret (as the router does), on the encoders' /dev/shm
    producer = PixelProducer(ECConfig(shm_bytes=1 << 20, secret=cluster.secret.decode(), instance="test-pixels"))
    try:
        img = np.asarray(Image.open(io.BytesIO(base64.b64decode(image_url(11).split(",", 1)[1]))).convert("RGB"))
        uuid = media_uuid(MODEL, "image", b"test-only", kwargs)
        good = producer.put(uuid, MODEL, "image", processor_digest(MODEL, kwargs), img[None])
        key = cluster.derive(PIXEL_HANDLE_PURPOSE)
        fields = {k: v for k, v in good.items() if k != "mac"}
        forged = [
            {**good, "shape": [1, 8, 8, 3]},  # tampered
            signing.sign(fields, cluster.derive(HANDLE_PURPOSE)),  # another purpose's key
            signing.sign({**fields, "shape": [1, 5000, 5000, 3], "nbytes": 5000 * 5000 * 3}, key),  # past limits
            signing.sign({**fields, "offset": 64 * 1000}, key),  # somewhere else in the slab
        ]

        def encode(pixels: dict) -> tuple[int, dict]:
            item = {"modality": "image", "pixels": pixels}
            payload = {"version": ENCODER_PROTOCOL_VERSION, "model": MODEL, "items": [item]}
            status, raw = http("POST", enc + "/v1/encode", msgspec.json.encode(payload), headers=internal_headers())
            return status, msgspec.json.decode(raw)

        for handle in forged:
            status, body = encode(handle)
            assert 400 <= status < 500, body
            assert body["error"]["param"] == "items[0].pixels", body
        status, body = encode(good)  # the positive control: the same path accepts a good handle
        assert status == 200 and body["items"][0]["uuid"] == uuid, body
        assert body["items"][0]["timings"]["fetch_ms"] == 0
        # a video's timing rides in its handle: the encoder answers with its seconds per temporal patch
        vid = media_uuid(MODEL, "video", b"test-only", kwargs)
        clip = producer.put(vid, MODEL, "video", processor_digest(MODEL, kwargs), np.stack([img, img]), 0.25)
        payload = {
            "version": ENCODER_PROTOCOL_VERSION,
            "model": MODEL,
            "items": [{"modality": "video", "pixels": clip}],
        }
        status, raw = http("POST", enc + "/v1/encode", msgspec.json.encode(payload), headers=internal_headers())
        item = msgspec.json.decode(raw)["items"][0]
        assert status == 200 and item["second_per_grid"] == 0.5, item
        status, _, _ = chat(on.url, [{"type": "image_url", "image_url": {"url": image_url(12)}}])
        assert status == 200
        assert http("GET", enc + "/health")[0] == 200
    finally:
        producer.close()


def test_no_lease_or_slab_outlives_its_use(on: Deployment) -> None:
    status, _, _ = chat(on.url, [{"type": "image_url", "image_url": {"url": image_url(13)}}])
    assert status == 200
    assert metric(on.url, "router_frontend_decode_slab_bytes") == 0  # every lease given back
    status, body, _ = chat(on.url, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert status == 400, body  # media the encoder would refuse is refused at the router, same status
    assert metric(on.url, "router_frontend_decode_slab_bytes") == 0
    port = on.url.rsplit(":", 1)[1]
    slabs = list(Path("/dev/shm").glob(f"epd-ec-router-{port}-*"))
    assert len(slabs) == 1  # the router's pixel slab, while it runs
    router = next(r for r in on.roles if r.name == "router")
    router.proc.send_signal(signal.SIGTERM)  # the router alone: its own close removes the slab
    router.proc.wait(timeout=30)
    assert not slabs[0].exists()
    pids = [pid for r in on.roles for pid in r.pids]
    on.stop()
    assert not [p for pid in pids for p in Path("/dev/shm").glob(f"epd-ec-*-{pid}-*")]  # nor anyone else's
