"""P/D disaggregation in the engine: a prefill core hands a request's KV to a decode core through
a real KV connector; the decode core continues with the same tokens an aggregated core produces,
loads the blocks into its prefix cache, and recomputes the prefill when the KV cannot be loaded."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch

from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.client import InprocClient
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.messages import AddRequest, EngineOutput, KVTransfer, MediaSpec, WireTensor
from epdserve.hf_reference import HFReference
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.models.config import ModelConfig
from epdserve.shapes import ShapesWorld
from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import make_producer
from epdserve.transfer.kv import kv_config
from tests.server_utils import TEST_DEVICE

ENGINE = EngineConfig(device=TEST_DEVICE, num_kv_blocks=256, max_model_len=2048, block_size=16)
MAX_NEW = 12


def kv_cfg(connector: str, name: str) -> ECConfig:
    return kv_config(ECConfig(shm_bytes=16 << 20), connector, name, ENGINE.dtype)  # type: ignore[arg-type]


async def collect(client: InprocClient, add: AddRequest) -> list[EngineOutput]:
    return [o async for o in client.generate(add)]


def prompts(model_dir: Path, hf: HFReference) -> list[AddRequest]:
    """Text, an image (by value) and a video (by value), greedy, fixed length."""
    builder = InputBuilder(hf.tok, ModelConfig.from_pretrained(model_dir))
    proc = VisionProcessor(ProcessorConfig.from_pretrained(model_dir))
    world = ShapesWorld(7)
    sample = world.sample("describe")
    image = proc.image(sample.scenes[0].render())
    video = proc.video(world.video().frames())
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    cases = [
        ([{"role": "user", "content": "Name three shapes and their colours."}], []),
        (
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sample.question}]}],
            [MediaInput("img", "image", image.grid_thw, image.pixel_values)],
        ),
        (
            [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Where does it move?"}]}],
            [MediaInput("vid", "video", video.grid_thw, video.pixel_values)],
        ),
    ]
    out = []
    for i, (messages, media) in enumerate(cases):
        p = builder.build(messages, media)
        pos = WireTensor.of(p.mrope_positions) if p.mrope_positions is not None else None
        out.append(AddRequest(f"r{i}", p.token_ids, sp, p.mm_items, pos, p.mrope_delta))
    return out


def tokens(outs: list[EngineOutput]) -> list[int]:
    assert outs[-1].finished and outs[-1].error is None, outs[-1].error
    return [t for o in outs for t in o.token_ids]


@pytest.fixture(scope="module")
def reqs(model_dir: Path, hf: HFReference) -> list[AddRequest]:
    return prompts(model_dir, hf)


@pytest.fixture(scope="module")
def aggregated(model_dir: Path, reqs: list[AddRequest]) -> dict[str, list[int]]:
    async def run() -> dict[str, list[int]]:
        client = InprocClient(EngineCore.from_pretrained(model_dir, ENGINE))
        await client.start()
        try:
            outs = await asyncio.gather(*(collect(client, r) for r in reqs))
        finally:
            await client.close()
        return {r.request_id: tokens(o) for r, o in zip(reqs, outs, strict=True)}

    return asyncio.run(run())


def prefill_and_decode(model_dir: Path, reqs: list[AddRequest], connector: str, tamper=None, decode_engine=ENGINE):
    """Each request prefilled on a P core, its KV handed to a D core; per request the D core's
    outputs, and both cores' stats."""
    kv = kv_cfg(connector, f"t-p-{connector}")

    async def run():
        p = InprocClient(EngineCore.from_pretrained(model_dir, ENGINE, vision=True, role="prefill", kv=kv))
        d = InprocClient(EngineCore.from_pretrained(model_dir, decode_engine, role="decode", kv=kv))
        await p.start()
        await d.start()
        try:
            handed = await asyncio.gather(
                *(collect(p, msgspec.structs.replace(r, kv=KVTransfer(produce=True))) for r in reqs)
            )
            continued = []
            for r, outs in zip(reqs, handed, strict=True):
                (first,) = outs
                assert first.finish_reason == "transferred" and first.kv_handle is not None
                handle = tamper(first.kv_handle) if tamper else first.kv_handle
                # (the media's pixels go along: they are a source only if the KV cannot be loaded)
                add = msgspec.structs.replace(r, kv=KVTransfer(first_token=first.token_ids[0], handle=handle))
                continued.append([first, *await collect(d, add)])
            # a follow-up of the first prompt, computed on the decode core: its prefix is the loaded KV
            follow = msgspec.structs.replace(reqs[0], request_id="follow-up")
            assert tokens(await collect(d, follow)) == tokens(continued[0])
            return continued, await p.stats(), await d.stats(), p.core.kv_producer.live_handles
        finally:
            await p.close()
            await d.close()

    return asyncio.run(run())


@pytest.mark.parametrize("connector", ["shm", "tcp"])
def test_decode_continues_from_transferred_kv_with_the_aggregated_tokens(
    model_dir: Path, reqs: list[AddRequest], aggregated: dict[str, list[int]], connector: str
) -> None:
    outs, pstats, dstats, live = prefill_and_decode(model_dir, reqs, connector)
    for r, o in zip(reqs, outs, strict=True):
        assert tokens(o) == aggregated[r.request_id], r.request_id
    assert pstats.kv_transfers_out == len(reqs)
    assert dstats.kv_transfers_in == len(reqs) and dstats.kv_fallbacks == 0
    assert dstats.kv_bytes_in > 0
    assert live == 0  # the decode side released every KV lease it read
    # the loaded blocks were registered with their hashes: the follow-up found its prompt cached
    assert dstats.prefix_cache_hit_tokens >= ENGINE.block_size


def test_a_decode_instance_with_another_block_size_takes_the_same_kv(
    model_dir: Path, reqs: list[AddRequest], aggregated: dict[str, list[int]]
) -> None:
    outs, _, dstats, _ = prefill_and_decode(
        model_dir, reqs[:2], "shm", decode_engine=dataclasses.replace(ENGINE, block_size=32, num_kv_blocks=128)
    )
    assert dstats.kv_fallbacks == 0
    for r, o in zip(reqs[:2], outs, strict=True):
        assert tokens(o) == aggregated[r.request_id]


@pytest.mark.parametrize(
    "tamper",
    [
        lambda h: {**h, "shape": [h["shape"][0] + 1, h["shape"][1]]},  # forged: the MAC no longer verifies
        lambda h: {**h, "mac": "0" * 64},
    ],
    ids=["forged-shape", "bad-mac"],
)
def test_kv_that_cannot_be_loaded_is_recomputed_with_the_same_tokens(
    model_dir: Path, reqs: list[AddRequest], aggregated: dict[str, list[int]], tamper
) -> None:
    # text only: the media of a recomputed request would need EC handles (tested through the router)
    outs, _, dstats, _ = prefill_and_decode(model_dir, reqs[:1], "shm", tamper=tamper)
    assert dstats.kv_fallbacks == 1 and dstats.kv_transfers_in == 0
    assert tokens(outs[0]) == aggregated["r0"]


def test_recompute_fetches_the_media_by_handle_and_unused_leases_are_given_back(
    model_dir: Path, reqs: list[AddRequest], aggregated: dict[str, list[int]]
) -> None:
    """A decode request carries EC leases for its media: read only when the KV fails, given back
    unread when the KV loads."""

    async def run(break_kv: bool) -> tuple[list[int], int, int]:
        kv = kv_cfg("shm", "t-p-media")
        ec = ECConfig(shm_bytes=8 << 20, instance="t-e-media")
        encoder = make_producer(ec)
        p = InprocClient(EngineCore.from_pretrained(model_dir, ENGINE, role="prefill", kv=kv))
        d = InprocClient(EngineCore.from_pretrained(model_dir, ENGINE, vision=False, role="decode", kv=kv, ec=ec))
        await p.start()
        await d.start()
        try:
            r = reqs[1]
            (first,) = await collect(p, msgspec.structs.replace(r, kv=KVTransfer(produce=True)))
            # the encoder's embeddings of the image, as the router would have them leased for D
            vision = p.core.runner.model.visual
            item = r.media[0]
            grid = torch.tensor([item.grid_thw])
            with torch.inference_mode():
                emb = vision(item.pixels.to_torch(), grid)
            lease = encoder.put(item.uuid, emb, model_dir.name)
            media = [MediaSpec(item.uuid, "image", item.offset, item.length, item.grid_thw, handle=lease)]
            handle = {**first.kv_handle, "mac": "0" * 64} if break_kv else first.kv_handle
            add = msgspec.structs.replace(r, media=media, kv=KVTransfer(first_token=first.token_ids[0], handle=handle))
            outs = [first, *await collect(d, add)]
            await asyncio.sleep(0.2)  # the release travels through the fetcher's loop
            return tokens(outs), encoder.live_handles, (await d.stats()).kv_fallbacks
        finally:
            await p.close()
            await d.close()
            encoder.close()

    for break_kv in (False, True):
        got, live, fallbacks = asyncio.run(run(break_kv))
        assert got == aggregated["r1"], break_kv
        assert live == 0, break_kv  # read or not, the lease was given back
        assert fallbacks == int(break_kv)


def test_only_the_right_role_takes_kv_requests(model_dir: Path, reqs: list[AddRequest]) -> None:
    async def run() -> list[EngineOutput]:
        both = InprocClient(EngineCore.from_pretrained(model_dir, ENGINE))
        await both.start()
        try:
            produce = await collect(both, msgspec.structs.replace(reqs[0], request_id="a", kv=KVTransfer(produce=True)))
            cont = await collect(both, msgspec.structs.replace(reqs[0], request_id="b", kv=KVTransfer(first_token=5)))
            return [*produce, *cont]
        finally:
            await both.close()

    outs = asyncio.run(run())
    assert [o.error_kind for o in outs] == ["invalid_request", "invalid_request"]
    assert "not a prefill instance" in (outs[0].error or "")
    assert "not a decode instance" in (outs[1].error or "")


def test_a_kv_handle_sent_to_an_instance_without_kv_connector_fails_only_that_request(
    model_dir: Path, reqs: list[AddRequest]
) -> None:
    async def run() -> tuple[list[EngineOutput], list[EngineOutput]]:
        both = InprocClient(EngineCore.from_pretrained(model_dir, ENGINE))
        await both.start()
        try:
            kv = KVTransfer(first_token=5, handle={"connector": "shm", "mac": "0" * 64})
            refused = await collect(both, msgspec.structs.replace(reqs[0], request_id="k", kv=kv))
            after = await collect(both, msgspec.structs.replace(reqs[0], request_id="after"))
            return refused, after
        finally:
            await both.close()

    refused, after = asyncio.run(run())
    assert [o.error_kind for o in refused] == ["invalid_request"]
    assert after[-1].finished and after[-1].error is None  # the core keeps serving
