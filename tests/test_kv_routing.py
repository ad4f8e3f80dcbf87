"""KV-aware routing: the router names a prompt's blocks exactly as a worker's block manager does,
its index weighs cached prefix against load and forgets workers whose digest went stale, and with
real processes a conversation's next turn lands on the worker holding its KV."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import openai
import pytest

from epdserve.api.chat_messages import template_messages
from epdserve.api.kv_digest import KVDigest
from epdserve.api.protocol import decode_chat_request
from epdserve.api.tokenizer import FastTokenizer
from epdserve.bench.workload import image_data_url
from epdserve.common.sampling_params import SamplingParams
from epdserve.encoder.protocol import EncodedItem
from epdserve.engine.block_manager import BlockManager
from epdserve.engine.core import request_from
from epdserve.engine.inputs import InputBuilder, MediaInput
from epdserve.engine.messages import AddRequest
from epdserve.media.limits import MediaLimits
from epdserve.models.config import ModelConfig
from epdserve.router.kv_routing import KVIndex, PromptBlocks
from epdserve.router.pool import Worker
from epdserve.router.refs import media_refs
from epdserve.shapes import ShapesWorld
from epdserve.up import Deployment, Topology
from tests.checkpoints import build
from tests.server_utils import counter, http, internal_headers

BS = 16


def chat_body(turns: list[tuple[str, str]], image_url: str) -> dict:
    """A conversation whose first user turn carries an image; ``turns``: (question, answer)."""
    messages: list[dict] = []
    for i, (question, answer) in enumerate(turns):
        content: list[dict] = [{"type": "text", "text": question}]
        if i == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_url}})
        messages.append({"role": "user", "content": content})
        if answer:
            messages.append({"role": "assistant", "content": answer})
    return {"model": "shapes-qwen2vl", "messages": messages}


def test_the_router_names_blocks_as_the_block_manager_does(model_dir: Path) -> None:
    image = image_data_url(ShapesWorld(3).scene().render())
    body = chat_body([("Describe the image.", "A red circle."), ("And its color?", "")], image)
    body["messages"].insert(0, {"role": "system", "content": "You are terse."})
    req = decode_chat_request(msgspec.json.encode(body), MediaLimits(), 100_000)
    refs = media_refs(body)
    grid = (1, 8, 12)
    for r in refs:  # what an encoder answered
        r.result = EncodedItem(
            uuid="u-1", modality="image", grid_thw=grid, num_embeddings=24, dtype="float32",
            shape=(24, 256), ec_handle={}, status="computed",
        )  # fmt: skip
    ours = PromptBlocks(model_dir).blocks(req, [(r.modality, r.result) for r in refs], BS).hashes
    # the worker: its own tokenizer and prompt builder, a Request, the block manager's hashes
    builder = InputBuilder(FastTokenizer(model_dir), ModelConfig.from_pretrained(model_dir))
    prompt = builder.build(template_messages(req), [MediaInput("u-1", "image", grid)], None)
    engine_req = request_from(AddRequest("r", prompt.token_ids, SamplingParams(), prompt.mm_items))
    theirs = BlockManager(64, BS)._hashes_upto(engine_req, len(prompt.token_ids))
    assert len(ours) == len(prompt.token_ids) // BS >= 4
    assert ours == theirs
    # before any encode, an item not known yet ends the named prefix: exactly the blocks before it
    early = PromptBlocks(model_dir).blocks(req, [("image", None)], BS)
    first = prompt.mm_items[0].offset // BS
    assert early.hashes == ours[:first] and not early.complete
    known = PromptBlocks(model_dir).blocks(req, [(r.modality, r.result) for r in refs], BS)
    assert known.complete and known.item_ends == [prompt.mm_items[0].offset + prompt.mm_items[0].length]
    # another image (uuid) changes every block from the one holding its placeholders on
    refs[0].result = msgspec.structs.replace(refs[0].result, uuid="u-2")
    other = PromptBlocks(model_dir).blocks(req, [(r.modality, r.result) for r in refs], BS).hashes
    assert other[:first] == ours[:first] and all(a != b for a, b in zip(other[first:], ours[first:], strict=True))


def test_a_prompt_over_the_context_names_no_blocks_and_is_not_tokenized_to_its_end(model_dir: Path) -> None:
    text = "the quick brown fox jumps over the lazy dog\n" * 25_000  # about a million characters
    body = {"model": "shapes-qwen2vl", "messages": [{"role": "user", "content": text}]}
    req = decode_chat_request(msgspec.json.encode(body), MediaLimits(), 2_000_000)
    blocks = PromptBlocks(model_dir)
    tok = blocks.builder.tok
    assert tok.bytes_per_token * 2048 < len(text)  # refused by the length bound alone
    assert blocks.blocks(req, [], BS, max_tokens=2048) == ([], [], True)
    # under the length bound, over the context: counted chunk by chunk, up to the limit
    body["messages"][0]["content"] = text[: tok.bytes_per_token * 2000]
    req = decode_chat_request(msgspec.json.encode(body), MediaLimits(), 2_000_000)
    assert blocks.blocks(req, [], BS, max_tokens=2048) == ([], [], True)
    assert len(blocks.blocks(req, [], BS).hashes) > 2048 // BS  # without a limit: named in full


def test_a_videos_blocks_follow_the_encoders_timing(tmp_path: Path) -> None:
    """Qwen3-VL writes a video's timestamps into the prompt: the router names its blocks with the
    encoder's ``second_per_grid``, as the worker builds the prompt from the part that carries it."""
    ckpt = build("qwen3_vl", tmp_path / "qwen3_vl", seed=0)
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": "data:image/gif;base64,R0lG"}}, {"type": "text", "text": "?"}]}]}  # fmt: skip
    req = decode_chat_request(msgspec.json.encode(body), MediaLimits(), 100_000)
    grid = (4, 4, 4)
    item = EncodedItem(
        uuid="v-1", modality="video", grid_thw=grid, num_embeddings=16, dtype="float32", shape=(16, 64),
        ec_handle={}, status="computed", second_per_grid=0.2,
    )  # fmt: skip
    blocks = PromptBlocks(ckpt)
    ours = blocks.blocks(req, [("video", item)], 4).hashes
    builder = InputBuilder(FastTokenizer(ckpt), ModelConfig.from_pretrained(ckpt))
    prompt = builder.build(template_messages(req), [MediaInput("v-1", "video", grid, second_per_grid=0.2)], None)
    engine_req = request_from(AddRequest("r", prompt.token_ids, SamplingParams(), prompt.mm_items))
    assert ours == BlockManager(64, 4)._hashes_upto(engine_req, len(prompt.token_ids))
    # an encoder that gave no timing: the checkpoint's fps, another prompt
    untimed = blocks.blocks(req, [("video", msgspec.structs.replace(item, second_per_grid=None))], 4).hashes
    assert untimed != ours


def test_the_index_weighs_cached_prefix_against_load_and_forgets_stale_workers() -> None:
    a, b = Worker("http://a"), Worker("http://b")
    hashes = [bytes([i]) * 16 for i in range(10)]
    index = KVIndex(stale_s=0.3)
    assert index.choose([a, b], hashes, load_tokens=64) is None  # nothing known: balance load
    index.update(a.url, KVDigest(model="m", block_size=BS, hashes=b"".join(hashes[:6])))
    index.update(b.url, KVDigest(model="m", block_size=BS, hashes=b"".join(hashes[:2] + hashes[3:])))
    assert index.cached_blocks(a.url, hashes) == 6 and index.cached_blocks(b.url, hashes) == 2
    assert index.choose([a, b], hashes, load_tokens=64) == (a, 6 * BS)
    a.outstanding = 2  # 96 cached tokens beyond b's, less than two requests' worth of load
    assert index.choose([a, b], hashes, load_tokens=64)[0] is b  # type: ignore[index]
    index.note(b.url, hashes)  # a prompt just routed to b: its blocks will be there
    assert index.cached_blocks(b.url, hashes) == 10
    time.sleep(0.35)
    assert not index.fresh(a.url) and index.choose([a, b], hashes, load_tokens=64) is None
    with pytest.raises(ValueError):
        index.update(a.url, KVDigest(model="m", block_size=32, hashes=b""))
    with pytest.raises(ValueError):
        KVDigest(model="m", block_size=BS, hashes=b"x" * 17).hash_set()


# ---- real processes ---------------------------------------------------------------------------------


def _queried(url: str) -> float:
    metrics = http("GET", url + "/metrics")[1].decode()
    m = re.search(r"^epd_prefix_cache_queries_total (\S+)$", metrics, re.MULTILINE)
    assert m is not None, metrics
    return float(m[1])


def converse(client: openai.OpenAI, convs: list[dict], workers: list[str], turns: int) -> None:
    """Each conversation's turns in rounds; every turn after the first must run on the worker
    (of ``workers``, seen by its prefix-cache queries) that ran its first."""
    homes: list[str] = []
    for turn in range(turns):
        for c in convs:
            before = [_queried(u) for u in workers]
            body = chat_body(c["turns"], c["image"])
            r = client.chat.completions.create(
                model="shapes-qwen2vl", messages=body["messages"], max_tokens=8, temperature=0
            )
            served = [u for u, b in zip(workers, before, strict=True) if _queried(u) > b]
            assert len(served) == 1
            if turn == 0:
                homes.append(served[0])
            else:
                assert served[0] == homes[convs.index(c)], f"turn {turn} left its KV"
            c["turns"][-1] = (c["turns"][-1][0], r.choices[0].message.content or "")
            c["turns"].append(("What else?", ""))


def kv_deployment(topology: str, pd_args: list[str] | None = None, probe_s: float = 0.5) -> Deployment:
    """A started deployment whose router routes by KV (digests polled every ``probe_s``)."""
    d = Deployment(
        Topology.parse(topology),
        None,
        port=0,
        extra_pd_args=pd_args or ["--max-model-len", "2048", "--num-kv-blocks", "512"],
        extra_router_args=["--policy", "kv_aware", "--probe-interval", str(probe_s)],
    )
    d.start()
    return d


@pytest.fixture(scope="module")
def kv_aware() -> Iterator[Deployment]:
    d = kv_deployment("1e+2pd")
    try:
        yield d
    finally:
        d.stop()


def test_each_conversation_follows_its_kv(kv_aware: Deployment) -> None:
    d = kv_aware
    pds = [r.url for r in d.roles if r.name.startswith("pd")]
    client = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=120)
    time.sleep(1.5)  # the router has the workers' first digests
    convs = [
        {"image": image_data_url(ShapesWorld(40 + i).scene().render()), "turns": [("Describe the image.", "")]}
        for i in range(4)
    ]
    converse(client, convs, pds, turns=3)
    # new conversations at once share only the template's preamble: load spreads them
    before = [_queried(u) for u in pds]
    fresh = [
        chat_body([("Describe the image.", "")], image_data_url(ShapesWorld(60 + i).scene().render())) for i in range(6)
    ]
    with ThreadPoolExecutor(6) as pool:
        list(
            pool.map(
                lambda b: client.chat.completions.create(
                    model="shapes-qwen2vl", messages=b["messages"], max_tokens=16, temperature=0
                ),
                fresh,
            )
        )
    assert all(_queried(u) > b for u, b in zip(pds, before, strict=True))
    metrics = http("GET", d.url + "/metrics")[1].decode()
    routed = re.search(r"^epd_router_kv_routed_total (\S+)$", metrics, re.MULTILINE)
    assert routed is not None and float(routed[1]) >= 8


def test_million_character_prompts_do_not_stall_kv_aware_routing(kv_aware: Deployment) -> None:
    """The router tokenizes prompts to name their blocks: a burst of prompts far over the context
    is refused (by the worker) without the router tokenizing them through, and a short request
    sent meanwhile is answered."""
    long = {"model": "shapes-qwen2vl", "max_tokens": 4, "messages": [{"role": "user", "content": "fox " * 250_000}]}
    short = {"model": "shapes-qwen2vl", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}

    def post(body: dict) -> tuple[int, bytes, float]:
        t0 = time.perf_counter()
        status, raw = http("POST", d.url + "/v1/chat/completions", msgspec.json.encode(body), timeout=120)
        return status, raw, time.perf_counter() - t0

    d = kv_aware
    with ThreadPoolExecutor(9) as pool:
        t0 = time.perf_counter()
        longs = [pool.submit(post, long) for _ in range(8)]
        time.sleep(0.05)
        quick = pool.submit(post, short)
        answers = [f.result() for f in longs]
        status, _, short_s = quick.result()
        burst_s = time.perf_counter() - t0
    assert status == 200
    for code, raw, _ in answers:
        assert code == 400 and msgspec.json.decode(raw)["error"]["code"] == "context_length_exceeded", raw[:300]
    assert burst_s < 15 and short_s < 10, (burst_s, short_s)  # generous: counting them through took many s


def test_media_inside_the_workers_kv_are_not_encoded_and_a_lost_race_costs_an_encode() -> None:
    """A follow-up turn whose image lies inside the KV its worker holds is answered without an
    encode call; if those blocks are evicted after the router chose (here: a flood of other
    prompts straight to the worker, while the router still remembers what it sent there), the
    worker refuses the cached handle, the router encodes and the answer is the same."""
    d = kv_deployment("1e+1pd", ["--max-model-len", "704", "--num-kv-blocks", "44"], probe_s=5)
    try:
        enc = next(r.url for r in d.roles if r.name.startswith("encoder"))
        pd = next(r.url for r in d.roles if r.name.startswith("pd"))
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=120)

        def answer(body: dict) -> str:
            r = client.chat.completions.create(
                model="shapes-qwen2vl", messages=body["messages"], max_tokens=12, temperature=0
            )
            return r.choices[0].message.content or ""

        deadline = time.monotonic() + 15
        while counter(d.url, "router_kv_workers_fresh") < 1:  # the worker's first digest
            assert time.monotonic() < deadline, "the router has no KV digest"
            time.sleep(0.2)
        image = image_data_url(ShapesWorld(77).scene().render())
        question = "Describe the image: name every shape you see, its color and where it is."  # the prompt's full blocks cover the image
        first = answer(chat_body([(question, "")], image))
        assert counter(enc, "encode_requests_total") == 1
        follow_up = chat_body([(question, first), ("What else?", "")], image)
        second = answer(follow_up)
        assert counter(enc, "encode_requests_total") == 1  # the image was never encoded again
        assert counter(d.url, "router_encodes_skipped_total") >= 1
        assert counter(d.url, "router_pd_retries_total") == 0
        # evict: long text prompts fill the worker's cache
        for i in range(2):
            words = " ".join(f"w{i}x{j}" for j in range(95))
            flood = {"model": "shapes-qwen2vl", "max_tokens": 1, "messages": [{"role": "user", "content": words}]}
            status, raw = http(
                "POST", pd + "/v1/chat/completions", msgspec.json.encode(flood), headers=internal_headers()
            )
            assert status == 200, raw
        assert answer(follow_up) == second
        assert counter(d.url, "router_pd_retries_total") == 1 and counter(enc, "encode_requests_total") == 2
    finally:
        d.stop()


def test_prefill_workers_are_chosen_by_kv_too() -> None:
    """E/P/D with kv_aware: each conversation's turns run on the prefill worker holding its KV, and
    an image inside that KV is not encoded again."""
    d = kv_deployment("1e+2p+1d")
    try:
        prefills = [r.url for r in d.roles if r.name.startswith("prefill")]
        deadline = time.monotonic() + 15
        while counter(d.url, "router_kv_workers_fresh") < 2:
            assert time.monotonic() < deadline, "the router has no KV digests"
            time.sleep(0.2)
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="none", max_retries=0, timeout=120)
        question = "Describe the image: name every shape you see, its color and where it is."
        convs = [
            {"image": image_data_url(ShapesWorld(90 + i).scene().render()), "turns": [(question, "")]} for i in range(3)
        ]
        encoder = next(r.url for r in d.roles if r.name.startswith("encoder"))
        converse(client, convs, prefills, turns=3)
        assert counter(d.url, "router_kv_routed_total") >= 6
        # later turns' images lie inside the prefill worker's KV: not encoded again
        assert counter(d.url, "router_encodes_skipped_total") >= 3
        assert counter(encoder, "encode_requests_total") <= 9 - 3
    finally:
        d.stop()
