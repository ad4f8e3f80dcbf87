"""Metadata-only parts: who may send which (handles only internally; inline data only with
--enable-mm-embeds), and inline embeddings decoded and validated, their uuid taken from their bytes."""

from __future__ import annotations

import asyncio
import base64

import msgspec
import pytest
import torch

from epdserve.api.errors import BadRequest
from epdserve.api.protocol import ImageEmbedsPart, VideoEmbedsPart, check_embeds_trust, decode_chat_request
from epdserve.engine.inputs import MediaInput
from epdserve.media.limits import MediaLimits
from epdserve.pd.embeds import MetadataEmbeds

WIDTH, MERGE = 8, 2


def request(part: dict) -> bytes:
    return msgspec.json.encode({"model": "m", "messages": [{"role": "user", "content": [part]}]})


def inline(t: torch.Tensor, uuid: str = "client-chosen", grid: tuple = (1, 2, 4)) -> dict:
    raw = t.contiguous().view(torch.int16 if t.dtype.itemsize == 2 else torch.int32).numpy().tobytes()
    dtype = str(t.dtype).removeprefix("torch.")
    embeds = {"image_grid_thw": list(grid), "data": base64.b64encode(raw).decode(), "dtype": dtype}
    return {"type": "image_embeds", "image_embeds": embeds, "uuid": uuid}


HANDLE = {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 2, 4]}, "uuid": "u", "ec_handle": {"k": 1}}


@pytest.mark.parametrize(
    ("part", "internal", "enabled", "ok"),
    [
        (HANDLE, False, False, False),  # a client's handle: never
        (HANDLE, False, True, False),  # not even with --enable-mm-embeds
        (HANDLE, True, False, True),  # the router's authenticated call
        (inline(torch.zeros(2, WIDTH)), False, False, False),  # inline only where switched on
        (inline(torch.zeros(2, WIDTH)), False, True, True),
        ({**HANDLE, "image_embeds": {"image_grid_thw": [1, 2, 4], "data": "AA=="}}, True, True, False),  # both
        ({**HANDLE, "ec_handle": None}, True, True, False),  # neither
    ],
)
def test_who_may_send_which_part(part: dict, internal: bool, enabled: bool, ok: bool) -> None:
    req = decode_chat_request(request(part), MediaLimits())
    if ok:
        check_embeds_trust(req, internal, enabled)
    else:
        with pytest.raises(BadRequest) as e:
            check_embeds_trust(req, internal, enabled)
        assert e.value.param is not None and e.value.param.startswith("messages[0].content[0]")


def resolve(part: dict):
    parsed = msgspec.convert(part, ImageEmbedsPart)
    resolver = MetadataEmbeds("m", WIDTH, lambda g: g[0] * g[1] * g[2] // (MERGE * MERGE))
    return asyncio.run(resolver(parsed))


def test_inline_embeddings_are_decoded_and_keyed_by_their_content() -> None:
    t = torch.randn(2, WIDTH)
    got = resolve(inline(t))
    assert torch.equal(got.embeddings.to_torch(), t) and got.grid_thw == (1, 2, 4)
    # the prefix-cache key comes from the bytes: a client cannot borrow another item's uuid
    assert got.uuid.startswith("inline-") and got.uuid != "client-chosen"
    assert resolve(inline(t, uuid="other")).uuid == got.uuid
    assert resolve(inline(t + 1)).uuid != got.uuid


def test_a_video_part_takes_its_own_timing_and_the_timing_keys_inline_data() -> None:
    resolver = MetadataEmbeds("m", WIDTH, lambda g: g[0] * g[1] * g[2] // (MERGE * MERGE), second_per_grid=2.0)
    raw = base64.b64encode(torch.zeros(4, WIDTH).numpy().tobytes()).decode()

    def video(second: float | None, data: str | None = None) -> MediaInput:
        embeds: dict = {"video_grid_thw": [2, 2, 4], "data": data}
        if second is not None:
            embeds["second_per_grid"] = second
        part = {
            "type": "video_embeds",
            "video_embeds": embeds,
            "uuid": "u",
            "ec_handle": None if data else {"key": "u"},
        }
        return asyncio.run(resolver(msgspec.convert(part, VideoEmbedsPart)))

    assert video(0.2).second_per_grid == 0.2  # the encoder's, from the clip
    assert video(None).second_per_grid == 2.0  # none given: the processor's fps
    # the same embeddings at another pace sit at other positions: another prefix-cache key
    assert video(0.2, raw).uuid != video(0.4, raw).uuid != video(None, raw).uuid
    assert video(0.2, raw).uuid == video(0.2, raw).uuid


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inline_embeddings_keep_their_values(dtype: torch.dtype) -> None:
    # large finite values (bfloat16's max, float16's) are finite: only inf/NaN are refused
    t = torch.randn(2, WIDTH).to(dtype)
    t[0, 0] = torch.finfo(dtype).max
    t[1, 1] = -torch.finfo(dtype).max
    got = resolve(inline(t))
    assert got.embeddings.dtype == str(dtype).removeprefix("torch.")
    assert torch.equal(got.embeddings.to_torch(), t)


@pytest.mark.parametrize(
    ("part", "message"),
    [
        (inline(torch.zeros(3, WIDTH)), "needs 2 rows"),  # wrong size for the grid
        (inline(torch.full((2, WIDTH), float("nan"))), "NaN"),
        (inline(torch.zeros(2, WIDTH, dtype=torch.bfloat16).index_fill(1, torch.tensor([3]), float("inf"))), "NaN"),
        (inline(torch.zeros(2, WIDTH, dtype=torch.bfloat16).index_fill(1, torch.tensor([5]), float("-nan"))), "NaN"),
        (inline(torch.zeros(2, WIDTH, dtype=torch.float16).index_fill(1, torch.tensor([0]), float("-inf"))), "NaN"),
        ({**inline(torch.zeros(2, WIDTH)), "image_embeds": {"image_grid_thw": [1, 2, 4], "data": "%%"}}, "base64"),
    ],
)
def test_bad_inline_embeddings_are_400(part: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        resolve(part)
