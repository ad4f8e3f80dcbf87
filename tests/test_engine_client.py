"""The engine core behind its client: in-process and in its own process give the same tokens; the
core fetches embeddings by handle; a dead core fails every open stream and reports itself."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import torch

from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.client import CoreStartError, InprocClient, MPClient
from epdserve.engine.config import EngineConfig
from epdserve.engine.core import EngineCore
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.messages import AddRequest, CoreStart, EngineOutput, MediaSpec, WireTensor
from epdserve.hf_reference import HFReference
from epdserve.models.config import ModelConfig
from epdserve.transfer.cached import cached_handle
from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import make_producer
from tests.server_utils import TEST_DEVICE

ENGINE = EngineConfig(device=TEST_DEVICE, num_kv_blocks=256, max_model_len=2048)
PROMPTS = ["Describe the image.", "What colour is the sky?", "Count to five.", "Name a shape."]


def text_request(hf: HFReference, rid: str, text: str, max_tokens: int = 10, **params) -> AddRequest:
    ids = hf.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return AddRequest(rid, list(ids), sp)


async def collect(stream: AsyncIterator[EngineOutput]) -> list[EngineOutput]:
    return [o async for o in stream]


def tokens(outs: list[EngineOutput]) -> list[int]:
    assert outs[-1].finished and outs[-1].error is None, outs[-1].error
    return [t for o in outs for t in o.token_ids]


def start_msg(model_dir: Path) -> CoreStart:
    return CoreStart(str(model_dir), model_dir.name, ENGINE, True, ECConfig())


@pytest.fixture(scope="module")
def core(model_dir: Path) -> Iterator[tuple[asyncio.AbstractEventLoop, MPClient]]:
    """A core in its own process, its client on an event loop of its own, for the tests that
    leave it as they found it (every request finished)."""
    loop = asyncio.new_event_loop()
    client = MPClient(start_msg(model_dir))
    loop.run_until_complete(client.start())
    try:
        yield loop, client
    finally:
        loop.run_until_complete(client.close())
        loop.close()


def test_process_core_equals_inprocess_core_and_transformers(
    core: tuple[asyncio.AbstractEventLoop, MPClient], model_dir: Path, hf: HFReference
) -> None:
    reqs = [text_request(hf, f"r{i}", p) for i, p in enumerate(PROMPTS)]
    expected = {
        r.request_id: hf.generate_ids(hf.inputs([{"role": "user", "content": p}]), max_new_tokens=10)
        for r, p in zip(reqs, PROMPTS, strict=True)
    }

    async def run(client) -> dict[str, list[int]]:
        outs = await asyncio.gather(*(collect(client.generate(r)) for r in reqs))
        return {r.request_id: tokens(o) for r, o in zip(reqs, outs, strict=True)}

    async def in_process() -> dict[str, list[int]]:
        client = InprocClient(EngineCore.from_pretrained(model_dir, ENGINE))
        await client.start()
        try:
            return await run(client)
        finally:
            await client.close()

    inproc = asyncio.run(in_process())
    loop, mp_client = core
    mp = loop.run_until_complete(run(mp_client))
    assert mp == inproc
    # the ignore_eos oracle: transformers stops at EOS, so compare the common prefix it produced
    for rid, want in expected.items():
        assert mp[rid][: len(want)] == want, rid


def test_dead_core_fails_open_streams_and_reports_unhealthy(model_dir: Path, hf: HFReference) -> None:
    deaths: list[str] = []

    async def scenario() -> tuple[list[EngineOutput], bool, list[EngineOutput]]:
        client = MPClient(start_msg(model_dir), on_death=deaths.append)
        await client.start()
        assert client.healthy
        long = text_request(hf, "long", PROMPTS[0], max_tokens=1500)
        stream = client.generate(long)
        first = await anext(stream)  # it is running
        os.kill(client.pid, signal.SIGKILL)
        rest = await asyncio.wait_for(collect(stream), 30)
        healthy = client.healthy
        after = await collect(client.generate(text_request(hf, "after", PROMPTS[1])))
        await client.close()
        return [first, *rest], healthy, after

    outs, healthy, after = asyncio.run(scenario())
    assert outs[-1].finish_reason == "error" and outs[-1].error_kind == "internal"
    assert not healthy
    assert len(deaths) == 1 and "exit" in deaths[0]
    assert after[-1].finish_reason == "error"  # a request after the death fails at once


def test_core_that_cannot_start_says_why(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["NoSuchModel"]}')
    bad = CoreStart(str(tmp_path), "x", ENGINE, True, ECConfig())
    with pytest.raises(CoreStartError, match=r"NoSuchModel.*supported: .*Qwen2VLForConditionalGeneration"):
        asyncio.run(MPClient(bad, ready_timeout_s=120).start())


def test_closing_a_stream_aborts_the_request_in_the_core(
    core: tuple[asyncio.AbstractEventLoop, MPClient], hf: HFReference
) -> None:
    loop, client = core

    async def scenario() -> tuple[int, int]:
        assert (await client.stats()).running == 0
        stream = client.generate(text_request(hf, "a", PROMPTS[0], max_tokens=1500))
        await anext(stream)
        running = (await client.stats()).running
        await stream.aclose()  # type: ignore[attr-defined]
        for _ in range(100):
            if (await client.stats()).running == 0:
                break
            await asyncio.sleep(0.02)
        return running, (await client.stats()).running

    assert loop.run_until_complete(scenario()) == (1, 0)


def test_core_fetches_embeddings_by_handle(model_dir: Path, hf: HFReference) -> None:
    """A metadata-only item waits in the scheduler for its embeddings; the tokens equal the same
    request with the embeddings inline, and a forged handle fails only its own request (400)."""
    cfg = ModelConfig.from_pretrained(model_dir)
    builder = InputBuilder(hf.tok, cfg)
    grid = (1, 8, 8)
    rows = builder.num_tokens(grid)
    emb = torch.randn(rows, cfg.text.hidden_size, generator=torch.Generator().manual_seed(0)) * 0.05
    ec = ECConfig(shm_bytes=8 << 20, instance="t-core")
    producer = make_producer(ec)
    try:
        handle = producer.put("img-1", emb, model_dir.name)
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe it."}]}]
        by_value = builder.build(messages, [MediaInput("img-1", "image", grid, embeddings=WireTensor.of(emb))])
        item = by_value.mm_items[0]
        sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        pos = WireTensor.of(by_value.mrope_positions)

        def add(rid: str, spec: MediaSpec) -> AddRequest:
            return AddRequest(rid, by_value.token_ids, sp, [spec], pos, by_value.mrope_delta)

        inline = MediaSpec("img-inline", "image", item.offset, item.length, grid, embeddings=WireTensor.of(emb))
        fetched = MediaSpec(item.uuid, "image", item.offset, item.length, grid, handle=handle)
        forged = MediaSpec(item.uuid, "image", item.offset, item.length, grid, handle={**handle, "nbytes": 1})

        async def run() -> tuple[list[EngineOutput], ...]:
            client = MPClient(CoreStart(str(model_dir), model_dir.name, ENGINE, False, ec))
            await client.start()
            try:
                return tuple(
                    await asyncio.gather(
                        collect(client.generate(add("inline", inline))),
                        collect(client.generate(add("handle", fetched))),
                        collect(client.generate(add("forged", forged))),
                    )
                )
            finally:
                await client.close()

        a, b, c = asyncio.run(run())
        assert tokens(a) == tokens(b)
        assert c[-1].finish_reason == "error" and c[-1].error_kind == "invalid_handle"
        assert producer.live_handles == 0  # the fetched lease was released by the core
    finally:
        producer.close()


def _maps_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def _allowed_cpus(pid: int) -> set[str]:
    """The Cpus_allowed_list of every thread of ``pid``."""
    return {
        line.split(":", 1)[1].strip()
        for t in Path(f"/proc/{pid}/task").iterdir()
        for line in (t / "status").read_text().splitlines()
        if line.startswith("Cpus_allowed_list:")
    }


def test_the_serve_front_end_never_loads_torch(model_dir: Path) -> None:
    """Only the engine core process holds torch: the front end renders, preprocesses images and
    builds positions with numpy, for a text and an image request alike. ``--engine-cpus`` pins
    every thread of the core process, and only that process."""
    from epdserve.bench.workload import image_data_url
    from epdserve.launcher import free_port, start_role, stop, wait_healthy
    from epdserve.shapes import ShapesWorld
    from tests.server_utils import post_json

    port = free_port()
    core = max(os.sched_getaffinity(0))
    args = ["serve", "--port", str(port), "--max-model-len", "1024", "--num-kv-blocks", "128"]
    proc = start_role([*args, "--engine-cpus", str(core)])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        image = ShapesWorld(3).sample("describe").scenes[0].render()
        for content in (
            "Name a shape.",
            [{"type": "image_url", "image_url": {"url": image_data_url(image)}}, {"type": "text", "text": "Describe."}],
        ):
            body = {"model": "shapes-qwen2vl", "messages": [{"role": "user", "content": content}], "max_tokens": 4}
            status, out = post_json(f"{url}/v1/chat/completions", body)
            assert status == 200, out
            assert out["usage"]["completion_tokens"] >= 1
        children = [
            int(c) for t in Path(f"/proc/{proc.pid}/task").iterdir() for c in (t / "children").read_text().split()
        ]
        assert not _maps_torch(proc.pid)
        assert any(_maps_torch(c) for c in children)  # the check can see torch where it is
        assert [_allowed_cpus(c) for c in children] == [{str(core)}]
        if len(os.sched_getaffinity(0)) > 1:
            assert _allowed_cpus(proc.pid) != {str(core)}
        # the core gives what its heap holds free back to the kernel, as every role server does
        threads = {(t / "comm").read_text().strip() for t in Path(f"/proc/{children[0]}/task").iterdir()}
        assert "epd-free-memory" in threads
    finally:
        stop(proc)


def test_items_inside_cached_kv_are_not_fetched_unless_the_blocks_are_gone(model_dir: Path, hf: HFReference) -> None:
    """A metadata-only item whose placeholders lie in the prefix the engine has cached is never
    fetched (its lease is given back unread); if those blocks are evicted before the request is
    admitted, it fetches the item then and answers the same."""
    cfg = ModelConfig.from_pretrained(model_dir)
    builder = InputBuilder(hf.tok, cfg)
    grid = (1, 8, 8)
    emb = torch.randn(builder.num_tokens(grid), cfg.text.hidden_size, generator=torch.Generator().manual_seed(1)) * 0.05
    ec = ECConfig(shm_bytes=8 << 20, instance="t-skip")
    producer = make_producer(ec)
    engine = EngineCore.from_pretrained(model_dir, ENGINE, vision=False, ec=ec, model_id=model_dir.name)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def add(rid: str, question: str) -> AddRequest:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        handle = producer.put("img-kv", emb, model_dir.name)
        p = builder.build(messages, [MediaInput("img-kv", "image", grid, handle=handle)])
        return AddRequest(rid, p.token_ids, sp, p.mm_items, WireTensor.of(p.mrope_positions), p.mrope_delta)

    def drain() -> list[int]:
        out: list[int] = []
        deadline = time.monotonic() + 60
        while engine.has_work:
            for o in engine.step():
                assert o.error is None, o.error
                out += o.token_ids
            if engine.last_step_idle:
                time.sleep(0.01)  # waiting for a fetch
            assert time.monotonic() < deadline
        return out

    def run(msg: AddRequest) -> list[int]:
        assert engine.add(msg) == []
        return drain()

    try:
        first = run(add("a", "Describe the image in a few words, please."))
        assert engine.fetches_skipped == 0 and engine.stats().ec_bytes > 0
        fetched = engine.stats().ec_bytes
        again = run(add("b", "Describe the image in a few words, please!"))  # same image, same prefix
        assert engine.fetches_skipped == 1 and engine.stats().ec_bytes == fetched  # nothing fetched
        released = time.monotonic() + 10
        while producer.live_handles and time.monotonic() < released:  # given back on the fetcher's thread
            time.sleep(0.01)
        assert producer.live_handles == 0  # its lease was given back unread
        # the blocks go between arrival and admission: it fetches after all and answers the same
        msg = add("c", "Describe the image in a few words, please!")
        assert engine.add(msg) == [] and engine.fetches_skipped == 2
        engine.scheduler.blocks.reset_prefix_cache()
        assert drain() == again and engine.stats().ec_bytes == 2 * fetched
        released = time.monotonic() + 10
        while producer.live_handles and time.monotonic() < released:
            time.sleep(0.01)
        assert len(first) == len(again) == 6 and producer.live_handles == 0
        # a router's cached handle (the item's header, nothing to read): skipped while the blocks
        # are here; once they are gone the request fails alone as embeddings_unavailable (the
        # router then encodes), never with another answer
        header = producer.put("img-kv", emb, model_dir.name)
        producer.release(header)
        cached = cached_handle(header, ec.handle_key, 60)

        def with_cached(rid: str) -> AddRequest:
            msg = add(rid, "Describe the image in a few words, please!")
            producer.release(msg.media[0].handle)
            media = [msgspec.structs.replace(msg.media[0], handle=cached)]
            return msgspec.structs.replace(msg, media=media)

        assert run(with_cached("d")) == again and engine.fetches_skipped == 3
        engine.scheduler.blocks.reset_prefix_cache()
        assert engine.add(with_cached("e")) == []
        failed = []
        deadline = time.monotonic() + 30
        while engine.has_work and time.monotonic() < deadline:
            failed += [o for o in engine.step() if o.error is not None]
            time.sleep(0.01)
        assert [o.error_kind for o in failed] == ["embeddings_unavailable"]
    finally:
        engine.close()
        producer.close()


def test_the_queue_stage_counts_the_step_a_request_waited_for(model_dir: Path, hf: HFReference) -> None:
    """A request read off the channel while a step runs waits for that step: its ``queue`` stage
    says so (the time is not lost between stages)."""
    core = EngineCore.from_pretrained(model_dir, ENGINE, vision=False)
    came = time.perf_counter()
    time.sleep(0.05)  # the step that was running when it came
    assert core.add(text_request(hf, "late", "Name a shape.", max_tokens=1), came) == []
    first = next(o for o in core.step() if o.request_id == "late")
    assert first.stages is not None and first.stages.queue >= 0.05
    assert core.add(text_request(hf, "now", "Name a shape.", max_tokens=1)) == []  # read at once: no wait
    first = next(o for o in core.step() if o.request_id == "now")
    assert first.stages is not None and first.stages.queue < 0.05
