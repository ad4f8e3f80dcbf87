"""The /v1/encode wire messages: one encode/decode path, version checks, validation errors."""

from __future__ import annotations

import json

import msgspec
import pytest

from epdserve.api.errors import BadRequest
from epdserve.api.protocol import ImageEmbedsPart, VideoEmbedsPart, decode_chat_request
from epdserve.encoder.protocol import (
    ENCODER_PROTOCOL_VERSION,
    EncodedItem,
    EncodeItem,
    EncodeRequest,
    EncodeResponse,
    EncoderProtocolError,
    ItemTimings,
    decode_request,
    decode_response,
    encode_request,
    encode_response,
)
from epdserve.media.limits import MediaLimits


def encoded(modality: str = "image", grid: tuple[int, int, int] = (1, 4, 6)) -> EncodedItem:
    rows = grid[0] * grid[1] * grid[2] // 4
    return EncodedItem(
        uuid="ab" * 32,
        modality=modality,  # type: ignore[arg-type]
        grid_thw=grid,
        num_embeddings=rows,
        dtype="float32",
        shape=(rows, 64),
        ec_handle={"connector": "shm", "key": "ab" * 32, "offset": 0},
        status="computed",
        timings=ItemTimings(fetch_ms=1.0, encode_ms=2.5),
    )


def test_request_round_trip_and_default_version() -> None:
    req = EncodeRequest(model="m", items=[EncodeItem("image", "data:x"), EncodeItem("video", "https://h/v.mp4")])
    body = encode_request(req)
    assert json.loads(body)["version"] == ENCODER_PROTOCOL_VERSION
    assert decode_request(body, max_items=8) == req


def test_response_round_trip() -> None:
    resp = EncodeResponse(items=[encoded(), encoded("video", (2, 4, 4))])
    back = decode_response(encode_response(resp))
    assert back == resp
    assert json.loads(encode_response(resp))["items"][0]["grid_thw"] == [1, 4, 6]


@pytest.mark.parametrize(
    ("payload", "match", "param"),
    [
        (
            {"version": ENCODER_PROTOCOL_VERSION + 1, "model": "m", "items": [{"modality": "image", "url": "x"}]},
            f"protocol version {ENCODER_PROTOCOL_VERSION + 1}",
            "version",
        ),
        ({"model": "m", "items": [{"modality": "image", "url": "x"}]}, "version", "version"),
        ({"version": ENCODER_PROTOCOL_VERSION, "model": "m", "items": []}, "length >= 1", "items"),
        (
            {"version": ENCODER_PROTOCOL_VERSION, "model": "m", "items": [{"modality": "pointcloud", "url": "x"}]},
            "pointcloud",
            "items[0].modality",
        ),
        (
            {"version": ENCODER_PROTOCOL_VERSION, "model": "m", "items": [{"modality": "image", "url": ""}]},
            "length >= 1",
            "items[0].url",
        ),
        (
            {
                "version": ENCODER_PROTOCOL_VERSION,
                "model": "m",
                "items": [{"modality": "image", "url": "x", "extra": 1}],
            },
            "unknown field",
            "items[0]",
        ),
        (
            {"version": ENCODER_PROTOCOL_VERSION, "model": "m", "items": [{"modality": "image", "url": "x"}] * 3},
            "At most 2 items",
            "items",
        ),
    ],
)
def test_bad_requests_are_400(payload: dict, match: str, param: str | None) -> None:
    with pytest.raises(BadRequest, match=match) as e:
        decode_request(json.dumps(payload).encode(), max_items=2)
    assert e.value.status == 400 and e.value.param == param


def test_version_mismatch_has_its_own_code_and_wins_over_shape_errors() -> None:
    # a future version may change the item shape: the client must hear about the version
    with pytest.raises(BadRequest) as e:
        decode_request(b'{"version": 7, "items": "whatever"}', max_items=8)
    assert e.value.code == "unsupported_protocol_version"


def test_not_json_is_400() -> None:
    with pytest.raises(BadRequest, match="not valid JSON"):
        decode_request(b"{nope", max_items=8)


def test_response_version_mismatch_and_garbage_are_protocol_errors() -> None:
    body = msgspec.json.encode({"version": ENCODER_PROTOCOL_VERSION + 1, "items": []})
    with pytest.raises(EncoderProtocolError, match=f"version {ENCODER_PROTOCOL_VERSION + 1}"):
        decode_response(body)
    with pytest.raises(EncoderProtocolError, match="invalid encode response"):
        decode_response(msgspec.json.encode({"version": ENCODER_PROTOCOL_VERSION, "items": [{"uuid": 3}]}))
    with pytest.raises(EncoderProtocolError):
        decode_response(b"<html>")


def test_embeds_part_is_what_the_lm_server_accepts() -> None:
    items = [encoded(), encoded("video", (2, 4, 4))]
    content = [it.embeds_part() for it in items] + [{"type": "text", "text": "what?"}]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()
    parts = decode_chat_request(body, MediaLimits()).media_parts()
    assert isinstance(parts[0], ImageEmbedsPart) and parts[0].image_embeds.image_grid_thw == (1, 4, 6)
    assert isinstance(parts[1], VideoEmbedsPart) and parts[1].video_embeds.video_grid_thw == (2, 4, 4)
    assert parts[0].uuid == items[0].uuid and parts[0].ec_handle == items[0].ec_handle


def test_a_video_item_carries_its_timing_to_the_worker_and_older_peers_still_talk() -> None:
    """``second_per_grid`` is optional on both sides of version 3: an encoder that sends none, a
    router that ignores it."""
    video = msgspec.structs.replace(encoded("video", (2, 4, 4)), second_per_grid=0.2)
    part = video.embeds_part()
    assert part["video_embeds"] == {"video_grid_thw": [2, 4, 4], "second_per_grid": 0.2}
    assert "second_per_grid" not in encoded().embeds_part()["image_embeds"]
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()
    (parsed,) = decode_chat_request(body, MediaLimits()).media_parts()
    assert isinstance(parsed, VideoEmbedsPart) and parsed.video_embeds.second_per_grid == 0.2
    # an older encoder's answer (no field) and an older router reading a newer one (unknown field)
    old = json.loads(encode_response(EncodeResponse(items=[video])))
    del old["items"][0]["second_per_grid"]
    assert decode_response(json.dumps(old).encode()).items[0].second_per_grid is None
    assert "second_per_grid" not in encoded("video", (2, 4, 4)).embeds_part()["video_embeds"]

    # a router of an earlier build meets the field as this one meets a later build's: ignored
    old["items"][0]["a_later_field"] = 1
    assert decode_response(json.dumps(old).encode()).items[0].uuid == video.uuid


@pytest.mark.parametrize("second", [0, -1.0, 1e9, "fast"])
def test_a_video_embeds_timing_out_of_bounds_is_400(second: object) -> None:
    part = {
        "type": "video_embeds",
        "video_embeds": {"video_grid_thw": [2, 4, 4], "second_per_grid": second},
        "uuid": "u",
    }
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()
    with pytest.raises(BadRequest) as e:
        decode_chat_request(body, MediaLimits())
    assert e.value.param is not None and "second_per_grid" in e.value.param
