"""The encoder-only instance as a real process on loopback; embeddings read back through the real
shm EC connector and compared with the vision tower run in this process."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from epdserve.api.media import MediaResolver
from epdserve.encoder.protocol import ENCODER_PROTOCOL_VERSION
from epdserve.encoder.server import EncoderConfig
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.media.decode import decode_image, decode_video
from epdserve.media.hashing import media_uuid
from epdserve.media.limits import MediaLimits
from epdserve.media.processor import ProcessorConfig, VisionInput, VisionProcessor
from epdserve.media.workers import media_threads
from epdserve.models.loader import checkpoint_files, load_model
from epdserve.shapes import ShapesWorld
from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import make_consumer
from tests.numerics import assert_close_rel
from tests.server_utils import http, internal_headers, post_json

torch.set_num_threads(1)

MODEL = "shapes-qwen2vl"
VISION_PREFIXES = ("visual.", "model.visual.")  # checkpoint names of the vision tower (both layouts)


class Encoder:
    """A running encoder process: its URL and its log."""

    def __init__(self, url: str, log: Path) -> None:
        self.url = url
        self.log = log

    def encode(self, items: list[dict[str, str]], **extra: Any) -> tuple[int, dict]:
        payload = {"version": ENCODER_PROTOCOL_VERSION, "model": MODEL, "items": items, **extra}
        return post_json(self.url + "/v1/encode", payload, internal_headers())

    def metric(self, name: str) -> float:
        status, body = http("GET", self.url + "/metrics")
        assert status == 200
        m = re.search(rf"^{re.escape(name)} (\S+)$", body.decode(), re.MULTILINE)
        assert m is not None, f"{name} not in /metrics"
        return float(m.group(1))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Encoder]:
    log = tmp_path_factory.mktemp("encoder") / "encoder.log"
    port = free_port()
    args = ["encoder", "--port", str(port), "--threads", "1", "--ec-shm-bytes", str(16 << 20)]
    # a short batching window makes "concurrent items share a forward" deterministic on a busy CPU
    proc = start_role([*args, "--encode-batch-wait-ms", "100"], log_path=str(log))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=120)
        yield Encoder(url, log)
    finally:
        stop(proc)


@pytest.fixture(scope="module")
def tower(model_dir: Path) -> torch.nn.Module:
    model, _ = load_model(model_dir, parts=frozenset({"vision"}))
    visual = model.visual
    assert isinstance(visual, torch.nn.Module)
    return visual


@pytest.fixture(scope="module")
def processor(model_dir: Path) -> VisionProcessor:
    return VisionProcessor(ProcessorConfig.from_pretrained(model_dir))


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def gif_bytes(frames: list[Image.Image]) -> bytes:
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100, loop=0)
    return buf.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def reference(tower: torch.nn.Module, vi: VisionInput) -> torch.Tensor:
    with torch.inference_mode():
        return tower(torch.from_numpy(vi.pixel_values), torch.tensor([vi.grid_thw]))


def read_back(item: dict) -> torch.Tensor:
    """The item's embeddings through the real EC consumer (validated against its metadata)."""

    async def main() -> torch.Tensor:
        consumer = make_consumer(ECConfig())
        try:
            rows, width = item["shape"]
            t = await consumer.get(item["ec_handle"], rows, width, MODEL)
            await consumer.release(item["ec_handle"])
            return t
        finally:
            await consumer.close()

    return asyncio.run(main())


def lm_server_uuid(processor: VisionProcessor, modality: str, data: bytes) -> str:
    """The uuid the language-model server's media pipeline gives the same bytes."""
    with ThreadPoolExecutor(1) as pool:
        resolver = MediaResolver(MODEL, processor, MediaLimits(), pool)
        return media_uuid(MODEL, modality, data, resolver.processor_kwargs)


def test_loads_only_the_vision_tower(model_dir: Path, encoder: Encoder) -> None:
    _, report = load_model(model_dir, parts=frozenset({"vision"}))
    everything = set(checkpoint_files(model_dir))
    vision = {n for n in everything if n.startswith(VISION_PREFIXES)}
    assert vision and vision != everything
    assert set(report.tensors) == vision  # every vision tensor, and not one language-model tensor
    # the process reports what it read: the same vision-only count, in /metrics and in its log
    assert encoder.metric("epd_encoder_weight_tensors_loaded") == len(report.tensors)
    assert encoder.metric("epd_encoder_checkpoint_tensors") == len(everything)
    line = f"encoder loaded {len(report.tensors)} of {len(everything)} checkpoint tensors (vision tower only)"
    assert line in encoder.log.read_text()


def test_models_and_health(encoder: Encoder) -> None:
    assert http("GET", encoder.url + "/v1/models")[0] == 401  # an internal role
    status, body = http("GET", encoder.url + "/v1/models", headers=internal_headers())
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [MODEL]
    status, body = http("GET", encoder.url + "/health")
    assert status == 200 and json.loads(body)["role"] == "encoder"


def test_image_matches_the_in_process_tower_then_hits_the_cache(
    encoder: Encoder, tower: torch.nn.Module, processor: VisionProcessor
) -> None:
    data = png_bytes(ShapesWorld(3).scene().render())
    vi = processor.image(decode_image(data, MediaLimits()))
    expected = reference(tower, vi)

    status, body = encoder.encode([{"modality": "image", "url": data_url(data, "image/png")}])
    assert status == 200, body
    assert body["version"] == ENCODER_PROTOCOL_VERSION
    (item,) = body["items"]
    assert item["status"] == "computed"
    assert item["modality"] == "image"
    assert item["uuid"] == lm_server_uuid(processor, "image", data)
    assert tuple(item["grid_thw"]) == vi.grid_thw
    t, h, w = vi.grid_thw
    assert item["num_embeddings"] == t * h * w // processor.config.merge_size**2 == expected.shape[0]
    assert item["shape"] == list(expected.shape) and item["dtype"] == "float32"
    assert item["ec_handle"]["connector"] == "shm" and item["ec_handle"]["key"] == item["uuid"]
    assert set(item["timings"]) == {"fetch_ms", "preprocess_ms", "queue_ms", "encode_ms", "put_ms"}
    assert item["timings"]["encode_ms"] > 0
    first = read_back(item)
    assert_close_rel(first, expected)

    hits = encoder.metric('epd_encoder_items_total{status="cache_hit"}')
    status, body = encoder.encode([{"modality": "image", "url": data_url(data, "image/png")}])
    assert status == 200, body
    (again,) = body["items"]
    assert again["status"] == "cache_hit"
    assert again["uuid"] == item["uuid"] and again["grid_thw"] == item["grid_thw"]
    assert again["timings"]["encode_ms"] == 0
    assert again["ec_handle"] != item["ec_handle"]  # a fresh handle: the consumer released the first
    assert torch.equal(read_back(again), first)
    assert encoder.metric('epd_encoder_items_total{status="cache_hit"}') == hits + 1


def test_video_gif(encoder: Encoder, tower: torch.nn.Module, processor: VisionProcessor) -> None:
    data = gif_bytes(ShapesWorld(4).video().frames())
    video = decode_video(data, MediaLimits())
    vi = processor.video(video.frames)
    expected = reference(tower, vi)
    status, body = encoder.encode([{"modality": "video", "url": data_url(data, "image/gif")}])
    assert status == 200, body
    (item,) = body["items"]
    assert item["modality"] == "video" and item["status"] == "computed"
    assert tuple(item["grid_thw"]) == vi.grid_thw and vi.grid_thw[0] >= 2
    assert item["uuid"] == lm_server_uuid(processor, "video", data)
    assert item["num_embeddings"] == expected.shape[0]
    assert_close_rel(read_back(item), expected)
    # the clip's timing (100 ms frames, 2 per temporal patch), as a worker decoding it would take it
    assert item["second_per_grid"] == processor.config.video_second_per_grid(video.interval_s) == pytest.approx(0.2)
    status, body = encoder.encode([{"modality": "video", "url": data_url(data, "image/gif")}])
    (again,) = body["items"]
    assert again["status"] == "cache_hit" and again["second_per_grid"] == item["second_per_grid"]
    read_back(again)


def test_concurrent_requests_are_batched(encoder: Encoder, tower: torch.nn.Module, processor: VisionProcessor) -> None:
    images = [png_bytes(ShapesWorld(100 + i).scene().render()) for i in range(8)]
    batches = encoder.metric("epd_encoder_batches_total")
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda d: encoder.encode([{"modality": "image", "url": data_url(d, "image/png")}]), images)
        )
    assert [status for status, _ in results] == [200] * 8, results
    items = [body["items"][0] for _, body in results]
    assert [it["status"] for it in items] == ["computed"] * 8
    assert len({it["uuid"] for it in items}) == 8
    ran = encoder.metric("epd_encoder_batches_total") - batches
    assert 1 <= ran < 8  # several items shared a forward
    for data, item in zip(images, items, strict=True):  # and the batch was split back correctly
        expected = reference(tower, processor.image(decode_image(data, MediaLimits())))
        assert_close_rel(read_back(item), expected)


def test_several_items_in_one_request_keep_their_order(encoder: Encoder) -> None:
    img = data_url(png_bytes(ShapesWorld(7).scene().render()), "image/png")
    vid = data_url(gif_bytes(ShapesWorld(8).video().frames()), "image/gif")
    status, body = encoder.encode([{"modality": "video", "url": vid}, {"modality": "image", "url": img}])
    assert status == 200, body
    assert [it["modality"] for it in body["items"]] == ["video", "image"]
    for it in body["items"]:
        assert read_back(it).shape[0] == it["num_embeddings"]


@pytest.mark.parametrize(
    ("items", "extra", "status", "message"),
    [
        ([{"modality": "image", "url": "data:image/png;base64,!!!not base64"}], {}, 400, "base64"),
        ([{"modality": "image", "url": data_url(b"hello, not an image", "image/png")}], {}, 400, "UNKNOWN"),
        ([{"modality": "video", "url": data_url(b"\x00" * 64, "video/mp4")}], {}, 400, "video"),
        ([{"modality": "image", "url": "ftp://example.com/a.png"}], {}, 400, "scheme"),
        ([{"modality": "image", "url": "http://127.0.0.1:1/a.png"}], {}, 400, "private"),
        ([{"modality": "image", "url": "x"}], {"version": 99}, 400, "protocol version 99"),
        ([{"modality": "image", "url": "x"}], {"model": "other"}, 404, "does not exist"),
    ],
)
def test_bad_input_is_a_json_error_and_the_encoder_keeps_serving(
    encoder: Encoder, items: list[dict], extra: dict, status: int, message: str
) -> None:
    got, body = encoder.encode(items, **extra)
    assert got == status, body
    assert message in body["error"]["message"]
    assert body["error"]["type"] == "invalid_request_error"
    ok, good = encoder.encode(
        [{"modality": "image", "url": data_url(png_bytes(ShapesWorld(9).scene().render()), "image/png")}]
    )
    assert ok == 200 and good["items"][0]["num_embeddings"] > 0


def test_one_bad_item_fails_the_request_and_names_the_item(encoder: Encoder) -> None:
    good = {"modality": "image", "url": data_url(png_bytes(ShapesWorld(10).scene().render()), "image/png")}
    status, body = encoder.encode([good, {"modality": "image", "url": "data:image/png;base64,%%%"}])
    assert status == 400 and body["error"]["param"] == "items[1].url"


def image_item(seed: int) -> dict[str, str]:
    return {"modality": "image", "url": data_url(png_bytes(ShapesWorld(seed).scene().render()), "image/png")}


def test_items_the_prompt_cannot_hold_are_refused_before_any_is_encoded(
    encoder: Encoder, processor: VisionProcessor
) -> None:
    """Two new images against a prompt's room: past it, the call is refused as the language model
    would refuse the prompt, and no forward runs; within it they are encoded."""
    seeds = (60, 61)
    items = [image_item(seed) for seed in seeds]
    grids = [processor.image(ShapesWorld(seed).scene().render()).grid_thw for seed in seeds]
    tokens = sum(t * h * w // 4 for t, h, w in grids)  # placeholders: 2x2 patches merged
    batches = encoder.metric("epd_encoder_batches_total")
    for context in ({"max_model_len": tokens}, {"max_model_len": tokens + 40, "completion_tokens": 41}):
        status, body = encoder.encode(items, context=context)
        assert status == 400, body
        error = body["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages", body
        assert f"{tokens} or more tokens" in error["message"]
    assert encoder.metric("epd_encoder_batches_total") == batches  # the vision tower never ran
    for context in ({"max_model_len": tokens + 1}, {"max_model_len": tokens + 40, "completion_tokens": 40}):
        status, body = encoder.encode(items, context=context)  # the placeholders fit, with a token to spare
        assert status == 200 and sum(it["num_embeddings"] for it in body["items"]) == tokens, body
    # an item this encoder has cached is counted as well (its tokens are in the prompt all the same)
    t, h, w = processor.image(ShapesWorld(62).scene().render()).grid_thw
    room = {"max_model_len": t * h * w // 4 + 1}  # the new item alone fits
    status, body = encoder.encode([items[0], image_item(62)], context=room)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    status, body = encoder.encode([items[0]], context={"max_model_len": tokens})
    assert status == 200 and body["items"][0]["status"] == "cache_hit", body


def test_a_bad_item_fails_its_call_without_holding_the_others_counted(encoder: Encoder) -> None:
    bad = {"modality": "image", "url": "data:image/png;base64,%%%"}
    status, body = encoder.encode([image_item(63), bad], context={"max_model_len": 4096})
    assert status == 400 and body["error"]["param"] == "items[1].url", body
    status, body = encoder.encode([image_item(64)], context={"max_model_len": 0})  # no context has no room
    assert status == 400 and "context.max_model_len" in body["error"]["message"], body


def test_not_json_and_unknown_routes(encoder: Encoder) -> None:
    status, body = http("POST", encoder.url + "/v1/encode", b"{not json", headers=internal_headers())
    assert status == 400 and "JSON" in json.loads(body)["error"]["message"]
    status, body = http("GET", encoder.url + "/v1/chat/completions")
    assert status in (404, 405) and "error" in json.loads(body)


def test_media_threads_default_to_the_cores_free_for_them() -> None:
    # pinned to one core (as `up --pin-cores` pins an encoder, and a PD worker's front end apart
    # from its engine core), one thread: a burst's images are then preprocessed in turn
    code = (
        "from epdserve.media.workers import media_threads; "
        "print(media_threads(0), media_threads(3), media_threads(0, engine_cores=[99]), media_threads(0, (), 1))"
    )
    cpu = sorted(os.sched_getaffinity(0))[0]
    done = subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "3", "1", "1"]
    # unpinned: every core, less the engine core's where it computes among them
    mine = sorted(os.sched_getaffinity(0))
    assert media_threads(0) == len(mine)
    assert media_threads(0, engine_cores=mine[:1]) == max(1, len(mine) - 1)
    assert media_threads(0, engine_threads=1) == max(1, len(mine) - 1)
    with pytest.raises(ValueError, match="preprocess_threads"):
        EncoderConfig(Path("unused"), preprocess_threads=-1)
