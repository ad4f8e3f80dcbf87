"""Adaptive dispatch's cost model (router.dispatch) and the load reports that feed it."""

from __future__ import annotations

import base64
import io
import math

import msgspec
import pytest
from PIL import Image

from epdserve.api.load import LoadReport, decode_load_report
from epdserve.common.rates import CostRate
from epdserve.encoder.protocol import EncodedItem, ItemTimings
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.router.dispatch import DispatchModel, Side

PROC = ProcessorConfig(max_pixels=448 * 448)
ENCODER = LoadReport(s_per_patch=1e-4)
WORKER = LoadReport(vision=True, vision_s_per_patch=1e-4, fetch_s_per_byte=1e-9)


def png_url(width: int, height: int, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (10, 200, 30)).save(buf, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()


def item(patches_hw: tuple[int, int], encode_ms: float, preprocess_ms: float, status: str = "computed") -> EncodedItem:
    h, w = patches_hw
    rows = h * w // 4
    return EncodedItem(
        uuid="u",
        modality="image",
        grid_thw=(1, h, w),
        num_embeddings=rows,
        dtype="float32",
        shape=(rows, 256),
        ec_handle={},
        status=status,  # type: ignore[arg-type]
        timings=ItemTimings(preprocess_ms=preprocess_ms, encode_ms=encode_ms, put_ms=0.5),
    )


def trained(hop_s: float = 0.004) -> DispatchModel:
    """A model that saw one 64-patch item: 0.1 ms/patch of forward, 0.05 ms/patch preprocess."""
    m = DispatchModel(PROC)
    it = item((8, 8), encode_ms=6.4, preprocess_ms=3.2)
    m.observe([it], call_s=(6.4 + 3.2) / 1e3 + hop_s)
    return m


@pytest.mark.parametrize("size", [(100, 60), (448, 448), (1000, 200), (28, 28)])
@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_patches_from_a_data_url_match_the_processor(size: tuple[int, int], fmt: str) -> None:
    buf = io.BytesIO()
    img = Image.new("RGB", size, (1, 2, 3))
    img.save(buf, format=fmt)
    url = f"data:image/{fmt.lower()};base64," + base64.b64encode(buf.getvalue()).decode()
    grid = VisionProcessor(PROC).image(img).grid_thw
    assert DispatchModel(PROC).patches("image", url) == grid[1] * grid[2]


def test_patches_fall_back_to_the_average_of_items_seen() -> None:
    m = DispatchModel(PROC)
    assert m.patches("image", "https://example.com/a.png") == 0  # nothing seen yet
    assert m.patches("image", "data:image/png;base64,bm90IGFuIGltYWdl") == 0  # not an image
    m.observe([item((8, 8), 1, 1), item((16, 16), 1, 1)], call_s=0.01)
    assert 64 < m.patches("image", "https://example.com/a.png") < 256
    assert m.patches("video", "https://example.com/a.mp4") == 0


def test_observe_learns_costs_per_patch_and_the_hop() -> None:
    m = trained(hop_s=0.004)
    assert m.forward.value == pytest.approx(1e-4)
    assert m.preprocess.value == pytest.approx(5e-5)
    assert m.hop.value == pytest.approx(0.004)
    assert m.bytes_per_patch.value == pytest.approx(16 * 256 * 4 / 64)
    hits = DispatchModel(PROC)
    hits.observe([item((8, 8), 0, 0.1, status="cache_hit")], call_s=0.002)
    assert not hits.measured  # a cache hit says nothing of the forward's cost


def test_unmeasured_costs_keep_the_encoder_path() -> None:
    choice = DispatchModel(PROC).choose(64, Side(ENCODER, 0, WORKER, 0))
    assert not choice.local


def test_an_idle_worker_saves_the_hop() -> None:
    choice = trained().choose(64, Side(ENCODER, 0, WORKER, 0))
    assert choice.local and choice.local_s < choice.remote_s
    assert choice.remote_s - choice.local_s == pytest.approx(0.004 + 64 * 256 * 1e-9, rel=1e-6)


def test_a_busy_worker_keeps_the_encoder_path() -> None:
    # 1024 patches stall 8 running requests 0.1 s each: far more than the 4 ms hop
    choice = trained().choose(1024, Side(ENCODER, 0, WORKER, 8))
    assert not choice.local
    assert choice.local_s == pytest.approx(1024 * (5e-5 + 1e-4) * 9)


def test_a_queued_encoder_sends_media_to_the_worker() -> None:
    m = trained()
    assert not m.choose(256, Side(ENCODER, 0, WORKER, 2)).local
    assert m.choose(256, Side(ENCODER, 20_000, WORKER, 2)).local  # 2 s of patches queued on the encoder


def test_only_requests_awaiting_their_first_token_pay_for_a_raw_encode_by_default() -> None:
    m = trained()  # interference 0 by default: a decoding request's stall is no TTFT
    waiting = m.choose(1024, Side(ENCODER, 0, WORKER, 8))
    decoding = m.choose(1024, Side(ENCODER, 0, WORKER, 0, worker_decoding=8))
    assert decoding.local_s == pytest.approx(1024 * (5e-5 + 1e-4))
    assert decoding.local and not waiting.local
    weighed = DispatchModel(PROC, interference=0.25)  # an operator who weighs the time between tokens
    weighed.observe([item((8, 8), 6.4, 3.2)], call_s=0.0136)
    quarter = weighed.choose(1024, Side(ENCODER, 0, WORKER, 0, worker_decoding=8))
    assert quarter.local_s == pytest.approx(1024 * (5e-5 + 1e-4) * (1 + 0.25 * 8))
    assert not quarter.local


def test_workers_without_vision_and_missing_encoders() -> None:
    m = trained()
    no_vision = LoadReport(vision=False)
    assert not m.choose(64, Side(ENCODER, 0, no_vision, 0)).local
    assert not m.choose(64, Side(None, 0, no_vision, 0)).local
    assert m.choose(64, Side(None, 0, WORKER, 50)).local  # no encoder: the worker's tower serves
    assert math.isinf(m.choose(64, Side(None, 0, WORKER, 50)).remote_s)


def test_load_report_round_trip_and_bounds() -> None:
    report = LoadReport(load_ratio=0.5, vision=True, vision_s_per_patch=1e-4, running=3)
    assert decode_load_report(msgspec.json.encode(report)) == report
    assert decode_load_report(b'{"load_ratio": 0.2}') == LoadReport(load_ratio=0.2)  # a peer from before
    for bad in (
        b'{"load_ratio": -1}',
        b'{"load_ratio": 1e9}',
        b'{"vision_s_per_patch": 5000}',
        b'{"running": -2}',
        b'{"version": 99}',
        b"[1]",
        b"nope",
    ):
        with pytest.raises(ValueError):
            decode_load_report(bad)


def test_cost_rate_follows_recent_intervals() -> None:
    r = CostRate(weight=0.5)
    assert r.update(0.0, 0) == 0.0
    assert r.update(1.0, 100) == pytest.approx(0.01)
    assert r.update(1.0, 100) == pytest.approx(0.01)  # no work in the interval: unchanged
    assert r.update(3.0, 200) == pytest.approx(0.015)  # 0.02 for the last interval, averaged
    assert r.update(2.0, 100) == pytest.approx(0.015)  # totals went backwards (a restart): ignored


def test_a_few_slow_calls_do_not_make_the_hop_look_expensive() -> None:
    m = trained(hop_s=0.004)
    for _ in range(9):
        m.observe([item((8, 8), 6.4, 3.2)], call_s=0.0096 + 0.004)
    for _ in range(3):  # calls that also waited on a busy event loop
        m.observe([item((8, 8), 6.4, 3.2)], call_s=0.0096 + 0.2)
    assert m.hop.value == pytest.approx(0.004)


def test_the_encoders_reported_preprocessing_cost_wins_over_item_timings() -> None:
    m = trained()  # item timings say 0.05 ms/patch of preprocessing (wall time, pool waits included)
    cheap = LoadReport(s_per_patch=1e-4, preprocess_s_per_patch=1e-6)
    side = Side(cheap, 0, WORKER, 2)
    choice = m.choose(256, side)
    assert choice.local_s == pytest.approx(256 * (1e-6 + 1e-4) * 3)
    assert choice.remote_s == pytest.approx(256 * (1e-6 + 1e-4) + 0.004 + 256 * 256 * 1e-9)
