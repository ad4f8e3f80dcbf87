"""Scheduler and block manager (prefix caching with media hashes): unit tests on CPU."""

from __future__ import annotations

import time

from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.block_manager import BlockManager
from epdserve.engine.config import EngineConfig
from epdserve.engine.request import MediaItem, Request, Status
from epdserve.engine.scheduler import Scheduler


def make_request(
    rid: str, n_prompt: int, max_tokens: int = 8, mm: list[MediaItem] | None = None, base: int = 0
) -> Request:
    return Request(
        rid, [base + i for i in range(n_prompt)], SamplingParams(temperature=0, max_tokens=max_tokens), mm or []
    )


def image(uuid: str, offset: int, length: int) -> MediaItem:
    return MediaItem(uuid, "image", offset, length, (1, 2, 2 * length))


def test_prefix_cache_reuses_full_blocks_only() -> None:
    bm = BlockManager(16, 4)
    a = make_request("a", 10)
    bm.take_cached(a, bm.match_prefix(a))
    assert a.num_computed_tokens == 0
    assert bm.allocate(a, 10) and len(a.block_ids) == 3
    a.num_computed_tokens = 10
    bm.commit(a)
    b = make_request("b", 10)
    m = bm.match_prefix(b)
    assert m.num_tokens == 8 and m.block_ids == a.block_ids[:2]
    bm.free(a)
    bm.check_integrity()
    # freed blocks stay cached until evicted
    c = make_request("c", 12)
    assert bm.match_prefix(c).num_tokens == 8


def test_touched_blocks_count_every_block_ever_handed_out() -> None:
    """A block's KV pages are mapped on its first write: the count of blocks ever handed out is
    the distinct ids allocated, whatever was freed, reused or served from the prefix cache, and
    reaches the whole cache, no more, once every block was used."""
    bm = BlockManager(8, 4)
    seen: set[int] = set()
    held = []
    for i, (tokens, base) in enumerate(((10, 0), (6, 0), (12, 100), (9, 200), (16, 300))):
        r = make_request(f"r{i}", tokens, base=base)  # r1 shares r0's first block (prefix cache)
        bm.take_cached(r, bm.match_prefix(r))
        assert bm.allocate(r, tokens - r.num_computed_tokens)
        seen |= set(r.block_ids)
        assert bm.touched == len(seen) == max(seen) + 1
        r.num_computed_tokens = tokens
        bm.commit(r)
        if i == 1:
            held.append(r)
        else:
            bm.free(r)
    assert bm.touched == 8  # the last request took every block still free: the whole cache
    for r in held:
        bm.free(r)
    r = make_request("all", 32, base=1000)
    assert bm.allocate(r, 32) and bm.touched == 8


def test_same_text_different_image_never_shares_blocks() -> None:
    bm = BlockManager(32, 4)
    a = make_request("a", 12, mm=[image("img-A", 2, 4)])
    bm.allocate(a, 12)
    a.num_computed_tokens = 12
    bm.commit(a)
    b = make_request("b", 12, mm=[image("img-B", 2, 4)])
    assert bm.match_prefix(b).num_tokens == 0  # the first block already holds image tokens
    same = make_request("s", 12, mm=[image("img-A", 2, 4)])
    assert bm.match_prefix(same).num_tokens == 8
    # an image that starts in a later block keeps the shared text prefix
    d = make_request("d", 12, mm=[image("img-D", 5, 2)])
    bm.allocate(d, 12)
    d.num_computed_tokens = 12
    bm.commit(d)
    c = make_request("c", 12, mm=[image("img-C", 5, 2)])
    assert bm.match_prefix(c).num_tokens == 4


def test_whole_prompt_hit_still_leaves_a_token_to_compute() -> None:
    bm = BlockManager(8, 4)
    a = make_request("a", 8)
    bm.allocate(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    b = make_request("b", 8)
    assert bm.match_prefix(b).num_tokens == 4


def test_eviction_and_integrity() -> None:
    bm = BlockManager(4, 4)
    a = make_request("a", 16)
    assert bm.allocate(a, 16)
    assert not bm.allocate(make_request("x", 4), 4)
    a.num_computed_tokens = 16
    bm.commit(a)
    bm.free(a)
    bm.check_integrity()
    d = make_request("d", 8, base=100)
    assert bm.allocate(d, 8)  # evicts cached blocks, tail first
    bm.check_integrity()
    assert bm.match_prefix(make_request("a2", 16)).num_tokens == 8


def test_chunked_prefill_respects_token_budget() -> None:
    sch = Scheduler(EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=10, max_model_len=256))
    a, b = make_request("a", 25), make_request("b", 7)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 10)]
    assert not plan.scheduled[0].samples
    a.num_computed_tokens += 10
    plan = sch.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 10)]
    a.num_computed_tokens += 10
    plan = sch.schedule()
    # a finishes its prompt (5 tokens) and b joins with the rest of the budget
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 5), ("b", 5)]
    assert plan.scheduled[0].samples and not plan.scheduled[1].samples


def test_a_step_holds_decodes_when_a_prompt_chunk_runs_beside_them() -> None:
    sch = Scheduler(EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=16, max_model_len=256))
    a = make_request("a", 6)
    sch.add(a)
    plan = sch.schedule()
    assert not plan.holds_decodes  # a prompt alone: nobody waits on it
    a.num_computed_tokens += 6
    a.output_token_ids.append(1)
    assert not sch.schedule().holds_decodes  # a decode alone
    b = make_request("b", 9, base=100)
    sch.add(b)
    plan = sch.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 9)]
    assert plan.holds_decodes  # a's next token waits on b's prompt


def test_preemption_instead_of_crash_when_blocks_run_out() -> None:
    sch = Scheduler(EngineConfig(block_size=4, num_kv_blocks=4, max_num_batched_tokens=64, max_model_len=16))
    a, b = make_request("a", 8), make_request("b", 8)
    sch.add(a)
    sch.add(b)
    plan = sch.schedule()
    assert len(plan.scheduled) == 2
    for s in plan.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        s.request.output_token_ids.append(1)
    plan = sch.schedule()  # both need a 3rd block; only one fits: b is preempted and recomputed later
    assert [s.request.request_id for s in plan.scheduled] == ["a"]
    assert plan.preempted == [b] and b.status is Status.WAITING and b.num_computed_tokens == 0
    assert sch.waiting[0] is b
    sch.finish(a, "stop")
    plan = sch.schedule()
    assert [(s.request.request_id, s.num_new_tokens) for s in plan.scheduled] == [("b", 9)]
    sch.blocks.check_integrity()


def test_not_ready_requests_wait_without_blocking_others() -> None:
    sch = Scheduler(EngineConfig(block_size=4, num_kv_blocks=16, max_model_len=64))
    a, b = make_request("a", 4), make_request("b", 4)
    a.pending_fetches = 1
    sch.add(a)
    sch.add(b)
    assert [s.request.request_id for s in sch.schedule().scheduled] == ["b"]
    assert list(sch.waiting) == [a]
    a.pending_fetches = 0
    assert [s.request.request_id for s in sch.schedule().scheduled] == ["b", "a"]


def test_text_only_requests_join_the_batch_before_earlier_media_ones() -> None:
    # room for one new prompt per step (8 tokens each, a budget of 8); no media waits long enough to
    # join the text's group, however slowly the test runs
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, max_model_len=64, media_max_wait_s=3600
    )
    sch = Scheduler(cfg)
    media = [make_request(f"m{i}", 8, mm=[image(f"img{i}", 2, 4)], base=100 * i) for i in range(3)]
    text = make_request("t", 8, base=900)
    for r in [*media, text]:  # the text request arrives last
        r.t_added = time.perf_counter()
        sch.add(r)
    first = sch.schedule()
    assert [s.request.request_id for s in first.scheduled] == ["t"]
    # the media requests keep their arrival order among themselves
    for s in first.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
    second = sch.schedule()
    assert [s.request.request_id for s in second.scheduled] == ["t", "m0"]


def test_a_media_request_that_waited_long_is_not_passed_by_text() -> None:
    sch = Scheduler(
        EngineConfig(block_size=4, num_kv_blocks=64, max_num_batched_tokens=8, max_model_len=64, media_max_wait_s=0.5)
    )
    old = make_request("m", 8, mm=[image("img", 2, 4)])
    old.t_added = time.perf_counter() - 1.0  # waited past media_max_wait_s
    text = make_request("t", 8, base=900)
    text.t_added = time.perf_counter()
    sch.add(old)
    sch.add(text)
    assert [s.request.request_id for s in sch.schedule().scheduled] == ["m"]


def _stepper(sch: Scheduler):  # type: ignore[no-untyped-def]
    """One scheduling step, its chunks taken as run: the ids of the requests that joined."""

    def step() -> list[str]:
        out = sch.schedule()
        joined = [s.request.request_id for s in out.scheduled if s.start == 0]
        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            if s.samples:
                s.request.output_token_ids.append(1)
        return joined

    return step


def test_a_burst_of_media_takes_the_vision_budget_in_turn() -> None:
    """While the step's vision work (as the runner estimates it) stays within ``vision_step_s``
    new media requests join; past it they wait, in order, but the first always joins, and text and
    media the tower need not encode join anyway."""
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=256, max_num_batched_tokens=256, max_model_len=64, media_max_wait_s=0
    )
    sch = Scheduler(cfg)
    seconds = {"m0": 0.4, "m1": 0.4, "m2": 0.05, "m3": 0.0, "big": 2.0}  # the tower's estimate per request
    # each request's image is prompt positions 2-5; the runner counts only items a chunk reaches
    sch.vision_cost = lambda req, start, end: seconds.get(req.request_id, 0.0) if start < 6 and end > 2 else 0.0
    for i, rid in enumerate(["big", "m0", "m1", "m2", "m3"]):
        sch.add(make_request(rid, 8, mm=[image(f"img-{rid}", 2, 4)], base=100 * i))
    sch.add(make_request("t", 8, base=900))
    step = _stepper(sch)
    # over the budget alone, the first joins; the rest wait except what costs the tower nothing
    assert step() == ["big", "m3", "t"]
    assert step() == ["m0"]  # 0.4 fits; 0.4 more would not
    assert step() == ["m1", "m2"]  # 0.45 in all
    assert not sch.waiting


def test_without_a_vision_bound_a_burst_joins_at_once() -> None:
    cfg = EngineConfig(block_size=4, num_kv_blocks=256, max_num_batched_tokens=256, max_model_len=64, vision_step_s=0)
    sch = Scheduler(cfg)
    sch.vision_cost = lambda req, start, end: 5.0
    for i in range(3):
        sch.add(make_request(f"m{i}", 8, mm=[image(f"img{i}", 2, 4)], base=100 * i))
    assert len(sch.schedule().scheduled) == 3


def test_a_prompt_in_progress_never_waits_for_another_requests_images_past_the_bound() -> None:
    """Past the bound the first media request joins only a step whose running requests all
    decode: the next chunk of a prompt in progress, or a text prompt that joined first, does not
    wait for its images; what fits the bound joins anyway."""
    cfg = EngineConfig(block_size=4, num_kv_blocks=256, max_num_batched_tokens=8, max_model_len=64)
    sch = Scheduler(cfg)
    seconds = {"a": 2.0, "b": 2.0, "c": 0.3, "m": 2.0}
    sch.vision_cost = lambda req, start, end: seconds.get(req.request_id, 0.0) if start < 6 and end > 2 else 0.0
    sch.add(make_request("a", 12, mm=[image("img-a", 2, 4)]))  # two chunks of 8 tokens
    sch.add(make_request("b", 4, mm=[image("img-b", 0, 4)], base=100))
    step = _stepper(sch)
    assert step() == ["a"]  # its first chunk takes the step's budget
    assert step() == []  # a's last chunk runs: b's 2 s would hold back its first token
    assert step() == ["b"]  # every running request decodes: b joins past the bound
    sch.add(make_request("t", 4, base=300))
    sch.add(make_request("m", 4, mm=[image("img-m", 0, 4)], base=400))
    assert step() == ["t"]  # text first; m's images would delay t's first token
    assert step() == ["m"]
    sch = Scheduler(cfg)
    sch.vision_cost = lambda req, start, end: seconds.get(req.request_id, 0.0) if start < 6 and end > 2 else 0.0
    sch.add(make_request("a", 12, mm=[image("img-a", 2, 4)]))
    step = _stepper(sch)
    assert step() == ["a"]
    sch.add(make_request("c", 4, mm=[image("img-c", 0, 4)], base=200))
    assert step() == ["c"]  # beside a's last chunk: c's 0.3 s fits the bound


def test_media_that_waited_long_is_held_for_a_prompt_but_lets_no_new_prompt_start() -> None:
    cfg = EngineConfig(
        block_size=4, num_kv_blocks=256, max_num_batched_tokens=8, max_model_len=64, media_max_wait_s=0.5
    )
    sch = Scheduler(cfg)
    sch.vision_cost = lambda req, start, end: 2.0 if req.request_id != "t" and start < 6 and end > 2 else 0.0
    sch.add(make_request("a", 12, mm=[image("img-a", 2, 4)]))
    step = _stepper(sch)
    assert step() == ["a"]
    old = make_request("m", 4, mm=[image("img-m", 0, 4)], base=100)
    old.t_added = time.perf_counter() - 1.0  # waited past media_max_wait_s
    sch.add(old)
    sch.add(make_request("t", 4, base=200))  # arrived after it
    assert step() == []  # a's last chunk: m waits for it, and t waits behind m
    assert step() == ["m", "t"]


def test_a_request_with_an_image_too_large_for_a_step_waits_for_its_slices() -> None:
    """The plan names the first waiting request whose image the runner encodes in slices; it joins
    no step (holds no block) until the image is encoded, while text and smaller media go ahead.
    An image inside a cached prefix is not asked for: the runner is asked from where its KV ends."""
    cfg = EngineConfig(block_size=4, num_kv_blocks=256, max_num_batched_tokens=256, max_model_len=64)
    sch = Scheduler(cfg)
    large = {"big": image("img-big", 0, 4), "big2": image("img-big2", 0, 4)}
    asked: list[tuple[str, int]] = []

    def sliced_item(req: Request, start: int) -> MediaItem | None:
        asked.append((req.request_id, start))
        item = large.get(req.request_id)
        return item if item is not None and start < item.end else None

    sch.sliced_item = sliced_item
    big = make_request("big", 8, mm=[large["big"]])
    sch.add(big)
    sch.add(make_request("big2", 8, mm=[large["big2"]], base=100))
    sch.add(make_request("m", 8, mm=[image("img-m", 2, 4)], base=200))
    sch.add(make_request("t", 8, base=300))
    step = _stepper(sch)
    assert sorted(step()) == ["m", "t"]
    assert sch.schedule().slice == (big, large["big"])  # the first in order
    assert not big.block_ids and big.status is Status.WAITING
    del large["big"]  # its image is encoded
    out = sch.schedule()
    assert [s.request.request_id for s in out.scheduled if s.start == 0] == ["big"]
    assert out.slice is not None and out.slice[0].request_id == "big2"
    # the same prompt again, its KV cached past the image: the runner is asked from the cached end
    for s in out.scheduled:
        s.request.num_computed_tokens += s.num_new_tokens
        sch.blocks.commit(s.request)
    large["again"] = image("img-big", 0, 4)
    asked.clear()
    sch.add(make_request("again", 8, mm=[large["again"]]))
    out = sch.schedule()
    assert ("again", 4) in asked and "again" in [s.request.request_id for s in out.scheduled]
