"""``epdserve plan``: the fit recovers known costs, the model behaves as queues do, the planner's
choice follows the workload, profiles are versioned, and a calibration against a real deployment."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from pathlib import Path

import pytest

from epdserve.bench.client import percentile
from epdserve.bench.report import SLO
from epdserve.bench.workload import WorkloadConfig
from epdserve.cli import main
from epdserve.kernels.lending import YIELD_SHARE
from epdserve.plan.burst import WaveJob, first_wave, run_percentile, run_time, wave_order
from epdserve.plan.cores import Urgent, layout, speeds
from epdserve.plan.model import Load, _media, others_busy, predict, state_at
from epdserve.plan.planner import PlanConfig, candidates, plan
from epdserve.plan.profile import (
    PROFILE_VERSION,
    PathCosts,
    Profile,
    ProfileError,
    Sample,
    fit_path,
    fit_token_counts,
    lending_speedups,
    load_profile,
    save_profile,
)
from epdserve.plan.queues import encoder_station, erlang_c
from epdserve.plan.record import SampleRecord, load_samples, save_samples
from epdserve.topology import Topology

# ---- factories -------------------------------------------------------------------------------------


def costs(**kw: float) -> PathCosts:
    base = dict(
        encode_call_s=0.004,
        encode_image_s=0.006,
        encode_mpx_s=0.05,
        prefill_s=0.003,
        prefill_token_s=0.0002,
        prefill_media_s=0.004,
        prefill_image_s=0.0005,
        prefill_mpx_s=0.02,
        overhead_s=0.003,
        overhead_image_s=0.0004,
        decode_step_s=0.004,
        decode_seq_s=0.0005,
        samples=0,
        ttft_rms_s=0.0,
    )
    return PathCosts(**{**base, **kw})  # type: ignore[arg-type]


def profile(**paths: PathCosts) -> Profile:
    """An aggregated engine that runs the vision forward inside prefill (6 ms an image) and an E+PD
    path that moves it to encoders at the price of a router hop (8 ms more latency)."""
    default = {
        "aggregated": costs(encode_call_s=0, encode_image_s=0, encode_mpx_s=0, prefill_image_s=0.0065),
        "epd": costs(overhead_s=0.011),
    }
    return Profile(
        paths={**default, **paths},
        text_tokens=30,
        padded_extra_tokens=20,
        image_tokens={0: 17.0, 224: 20.0},
        native_pixels=16000,
        nproc=2,
        cpu_model="test",
        source="synthetic",
    )


def samples_of(c: PathCosts, path: str = "epd") -> list[Sample]:
    """Exact samples of ``c``: unloaded runs of several shapes, then decode runs at batches 1, 2, 4."""
    out = []
    for images, side, padding in [(0, 0, 0), (0, 0, 96), (1, 0, 0), (4, 0, 0), (8, 0, 0), (1, 224, 0), (4, 224, 0)]:
        pixels = float(side * side) if side else 16000.0
        tokens = 30 + padding + images * (17 if side == 0 else 20)
        ttft = c.overhead(images) + c.encode(images, pixels) + c.prefill(tokens, images, pixels)
        stages = {"pd_queue": 0.0, "pd_prefill": c.prefill(tokens, images, pixels)}
        if images:
            stages["router_encode"] = c.encode(images, pixels)
        for _ in range(3):
            out.append(Sample(path, images, side, pixels, padding, tokens, 8, 1, ttft, c.step(0.9), 0.9, stages))
    for batch in (1.0, 2.0, 4.0):
        conc = int(batch)
        out += [Sample(path, 0, 0, 16000.0, 0, 30, 48, conc, 0.02, c.step(batch), batch, {}) for _ in range(3)]
    return out


def image_load(rate: float, images: int = 10, out: int = 16, **kw: object) -> Load:
    return Load(WorkloadConfig(images_per_request=images, output_len=out), request_rate=rate, **kw)  # type: ignore[arg-type]


# ---- fitting ---------------------------------------------------------------------------------------


def test_fit_recovers_known_costs() -> None:
    truth = costs()
    fitted = fit_path(samples_of(truth))
    for f in dataclasses.fields(PathCosts):
        if f.name in ("samples", "ttft_rms_s"):
            continue
        assert getattr(fitted, f.name) == pytest.approx(getattr(truth, f.name), rel=1e-6, abs=1e-9), f.name
    assert fitted.ttft_rms_s == pytest.approx(0.0, abs=1e-9)


def test_fit_tells_a_vision_forward_in_prefill_from_the_prompt_tokens() -> None:
    """An aggregated engine runs the vision tower inside prefill, and a real processor gives an
    image visual tokens in proportion to its pixels (one per 28 × 28 px), so among image requests
    tokens and pixels rise together. Text requests of two lengths price a token; the images'
    pixels then carry the vision forward, and a text prompt is not charged for it."""
    truth = costs(encode_call_s=0, encode_image_s=0, encode_mpx_s=0, prefill_image_s=0.01, prefill_mpx_s=4.0)
    samples = []
    for images, side, padding in [(0, 0, 0), (0, 0, 96), (1, 224, 0), (4, 224, 0), (1, 448, 0), (4, 448, 0)]:
        pixels = float(side * side)
        tokens = 30 + padding + images * side * side // 784
        prefill = truth.prefill(tokens, images, pixels)
        ttft = truth.overhead(images) + prefill
        stages = {"pd_queue": 0.0, "pd_prefill": prefill}
        samples += [Sample("aggregated", images, side, pixels, padding, tokens, 8, 1, ttft, 0.01, 0.9, stages)] * 3
    samples += [Sample("aggregated", 0, 0, 0.0, 0, 30, 48, 1, 0.02, truth.step(1), 1.0, {})] * 3
    fitted = fit_path(samples)
    for name in ("prefill_token_s", "prefill_image_s", "prefill_mpx_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-6), name
    assert fitted.prefill(126, 0, 0.0) == pytest.approx(truth.prefill(126, 0, 0.0), rel=1e-6)


def test_fit_weighs_short_runs_like_long_ones() -> None:
    """Prefill times of a 2B model on a 2-core CPU (aggregated, seconds): text prompts take 0.17
    and 0.87 s, eight 448-px images 55 s, and the vision forward grows faster than the pixels.
    A fit of absolute errors lets the longest runs decide and prices a text token at nothing;
    each run counts alike in the fit, so text prompts keep their price and every run is near."""
    tokens = {0: 27.0, 224: 70.6, 448: 262.6}
    runs = [(0, 0, 0, 0.166), (0, 0, 96, 0.869)]
    runs += [
        (n, side, 0, t)
        for (side, n), t in {
            (224, 1): 1.54,
            (224, 4): 6.08,
            (224, 8): 12.17,
            (448, 1): 6.61,
            (448, 4): 27.39,
            (448, 8): 55.31,
        }.items()
    ]
    samples = []
    for images, side, padding, prefill in runs:
        prompt = 27 + (padding + 21 if padding else 0) + images * tokens[side]
        stages = {"pd_queue": 0.0, "pd_prefill": prefill}
        sample = Sample("aggregated", images, side, side * side, padding, prompt, 8, 1, prefill, 0.1, 0.9, stages)
        samples += [sample] * 3
    samples += [Sample("aggregated", 0, 0, 0.0, 0, 27, 48, 1, 0.2, 0.1, 1.0, {})] * 3
    fitted = fit_path(samples)
    assert 0.004 < fitted.prefill_token_s < 0.009  # the padded prompt's 96 more tokens: 0.7 s
    for s in samples[:-3]:
        assert fitted.prefill(s.prompt_tokens, s.images, s.pixels) == pytest.approx(s.prefill_s, rel=0.2)


def test_fit_ignores_one_stalled_request_per_run() -> None:
    """A run counts by its median request: one request stalled by a busy machine does not move the fit."""
    truth = costs()
    samples = samples_of(truth)
    stalled = next(i for i, s in enumerate(samples) if s.images == 4 and s.image_side == 0)
    s = samples[stalled]
    samples[stalled] = dataclasses.replace(s, stages={k: 10 * v for k, v in s.stages.items()}, ttft_s=10 * s.ttft_s)
    fitted = fit_path(samples)
    assert fitted.encode_image_s == pytest.approx(truth.encode_image_s, rel=1e-6)
    assert fitted.prefill_token_s == pytest.approx(truth.prefill_token_s, rel=1e-6)


def test_fit_never_returns_a_negative_cost() -> None:
    """Prefill that does not grow with the prompt (noise makes the slope negative) is fitted as 0, not < 0."""
    samples = [
        dataclasses.replace(s, stages={**s.stages, "pd_prefill": 0.01 - 1e-5 * s.prompt_tokens})
        for s in samples_of(costs())
    ]
    fitted = fit_path(samples)
    assert all(getattr(fitted, f.name) >= 0 for f in dataclasses.fields(PathCosts))
    assert fitted.prefill_token_s == 0


def test_fit_needs_unloaded_requests() -> None:
    loaded = [s for s in samples_of(costs()) if s.concurrency > 1]
    with pytest.raises(ProfileError, match="unloaded"):
        fit_path(loaded)


def test_token_counts_without_text_requests() -> None:
    """Image runs at two counts tell the text's tokens from the images'; at one count they cannot."""
    samples = [s for s in samples_of(costs()) if s.images and s.image_side == 0]
    text, _, per_image = fit_token_counts(samples)
    assert text == pytest.approx(30) and per_image[0] == pytest.approx(17)
    with pytest.raises(ProfileError, match="cannot tell"):
        fit_token_counts([s for s in samples if s.images == 4])


def test_token_counts_from_usage() -> None:
    text, extra, per_image = fit_token_counts(samples_of(costs()))
    assert (text, extra) == (pytest.approx(30), pytest.approx(30))  # padded: 96 padding + 30 of template and question
    assert per_image == {0: pytest.approx(17.0), 224: pytest.approx(20.0)}


def lent_samples(own: list[Sample], encode: float, prefill: float, decode: float) -> list[Sample]:
    """``own`` as measured on lent cores: every encode, prefill and decode step so many times faster."""
    out = []
    for s in own:
        stages = dict(s.stages)
        if "router_encode" in stages:
            stages["router_encode"] /= encode
        if "pd_prefill" in stages:
            stages["pd_prefill"] /= prefill
        out.append(dataclasses.replace(s, stages=stages, tpot_s=s.tpot_s / decode))
    return out


def test_lending_speedups_from_the_same_runs_on_lent_cores() -> None:
    own = samples_of(costs())
    got = lending_speedups(own, lent_samples(own, 1.6, 1.8, 1.4))
    assert got == {
        "lend_encode_x": pytest.approx(1.6),
        "lend_prefill_x": pytest.approx(1.8),
        "lend_decode_x": pytest.approx(1.4),
    }
    # only the runs both measured count: the lent calibration repeats a subset
    subset = [s for s in lent_samples(own, 1.6, 1.8, 1.4) if s.images in (0, 4) and s.concurrency == 1]
    assert lending_speedups(own, subset)["lend_encode_x"] == pytest.approx(1.6)
    # roles too small to borrow (or noise): no speed-up, not a spurious few per cent
    assert set(lending_speedups(own, lent_samples(own, 1.05, 0.97, 1.0)).values()) == {1.0}
    assert set(lending_speedups(own, []).values()) == {1.0}


# ---- the model -------------------------------------------------------------------------------------


def test_erlang_c_of_one_server_is_its_utilization() -> None:
    assert erlang_c(1, 0.3) == pytest.approx(0.3)
    assert erlang_c(4, 2.0) < erlang_c(2, 1.8)  # more servers at similar per-server load wait less


def test_saturated_encoders_wait_without_bound() -> None:
    """At or past full utilisation (capacity's bisection probes such rates) the wait is unbounded."""
    for rate in (2.0, 3.0):
        station = encoder_station(rate, 0.5, 1)
        assert station.utilization == rate * 0.5 and station.wait_s == math.inf and station.wait_prob == 1.0


def test_more_encoders_never_predict_a_worse_encode_wait() -> None:
    p = profile()
    load = image_load(12.0, images=10, out=16)
    waits = []
    for cores in (2, 8):
        for e in (1, 2, 3, 4):
            pred = predict(p, f"{e}e+1pd", cores, load)
            assert pred.stable
            waits.append((cores, e, pred.utilization["encoders"], pred.ttft_by_kind_s["image"]))
    for (c1, _, u1, t1), (c2, _, u2, t2) in itertools.pairwise(waits):
        if c1 == c2:
            assert u2 <= u1 + 1e-12 and t2 <= t1 + 1e-12
    # on 2 cores the encoders share one core: a second adds nothing; on 8 it halves their load
    assert waits[1][2] == pytest.approx(waits[0][2])
    assert waits[5][2] == pytest.approx(waits[4][2] / 2)


def test_engines_sharing_a_core_share_its_capacity() -> None:
    """Two PD workers pinned to one core sustain what one does; given a core each, about twice.
    A decode worker sharing its core with a prefill worker that is mostly idle runs near full
    speed, and slows as the prefills grow."""
    p = profile(split=costs())
    load = image_load(1.0, images=4, out=64)
    one = predict(p, "1e+1pd", 2, load).capacity_rps
    assert predict(p, "1e+2pd", 2, load).capacity_rps == pytest.approx(one, rel=1e-6)
    assert predict(p, "1e+2pd", 4, load).capacity_rps == pytest.approx(2 * one, rel=0.05)
    quiet = predict(p, "1e+1p+1d", 2, load)
    busy = predict(p, "1e+1p+1d", 2, image_load(0.6 * quiet.capacity_rps, images=4, out=64))
    alone = costs().step(1)  # one sequence's step
    assert quiet.itl_s is not None and busy.itl_s is not None
    assert alone < quiet.itl_s < 1.1 * alone < busy.itl_s


def lending_profile() -> Profile:
    return profile(epd=costs(overhead_s=0.011, lend_encode_x=1.6, lend_prefill_x=1.8, lend_decode_x=1.4))


def test_lending_speeds_a_role_up_while_the_others_idle() -> None:
    """Nearly unloaded, each stage runs at its lent speed-up (the other role idles); the more the
    other role computes, the less it lends, and a deployment that does not lend is predicted as
    before. A text-only load never wakes the encoder: the engine always has the encoder's core."""
    p = lending_profile()
    c = p.paths["epd"]
    quiet = image_load(0.01, images=4, out=16)
    lent, own = predict(p, "1e+1pd", 2, quiet), predict(p, "1e+1pd", 2, quiet, lend=False)
    tokens = p.text_tokens + 4 * p.image_tokens[0]
    alone = c.overhead(4) + c.encode(4, p.native_pixels) + c.prefill(tokens, 4, p.native_pixels)
    fast = c.overhead(4) + c.encode(4, p.native_pixels) / 1.6 + c.prefill(tokens, 4, p.native_pixels) / 1.8
    assert own.ttft_by_kind_s["image"] == pytest.approx(alone, rel=0.01)
    assert lent.ttft_by_kind_s["image"] == pytest.approx(fast, rel=0.01)
    assert predict(p, "1e+1pd", 2, quiet, yields=False).capacity_rps > own.capacity_rps
    # under load the engine idles less: the speed of encoders that compute through (their busy share
    # without lending over that with it) shrinks from the full speed-up toward none
    encode_speed = [
        predict(p, "1e+1pd", 2, image_load(f * own.capacity_rps, images=4), lend=False).utilization["encoders"]
        / predict(p, "1e+1pd", 2, image_load(f * own.capacity_rps, images=4), yields=False).utilization["encoders"]
        for f in (0.01, 0.5, 0.9)
    ]
    assert 1.6 > encode_speed[0] > encode_speed[1] > encode_speed[2] > 1
    assert encode_speed[0] == pytest.approx(1.6, rel=0.02)
    text = Load(WorkloadConfig(images_per_request=0, output_len=64), request_rate=1.0)
    per_request = c.prefill(p.text_tokens, 0, 0.0) / 1.8 + 64 * c.decode_seq_s / 1.4
    assert predict(p, "1e+1pd", 2, text).utilization["engines"] == pytest.approx(per_request)
    # image-heavy: the encoders bound the capacity, lent a core while the engine idles
    heavy = predict(p, "1e+1pd", 2, image_load(1.0, images=10, out=4), yields=False)
    assert heavy.bottleneck == "encoders"
    assert heavy.capacity_rps > predict(p, "1e+1pd", 2, image_load(1.0, images=10, out=4), lend=False).capacity_rps
    # nothing to lend in one process, and nothing measured: the same predictions either way
    assert predict(p, "aggregated", 2, quiet) == predict(p, "aggregated", 2, quiet, lend=False)
    assert predict(profile(), "1e+1pd", 2, quiet) == predict(profile(), "1e+1pd", 2, quiet, lend=False)


def test_a_closed_loops_request_meets_the_others_busy_while_it_is_elsewhere() -> None:
    """In a closed loop the other clients' busy time falls in the time this request spends away
    from a role: a loop of two whose encoder the others keep busy 46 % of the time finds it busy
    85 % of the time while it prefills. So the encoder lends its core to that prefill less often
    than the others' load alone says; open arrivals and a single client are as they were."""
    assert others_busy({"encoders": 0.46}, 2)["encoders"] == pytest.approx(0.46 / 0.54)
    assert others_busy({"encoders": 0.4, "engines": 0.2}, 5) == pytest.approx(
        {"encoders": 0.4 / 0.9, "engines": 0.2 / 0.95}
    )
    assert others_busy({"encoders": 0.7}, 2)["encoders"] == 1.0  # busy whenever this request is away
    assert others_busy({"encoders": 0.46}, 1) == others_busy({"encoders": 0.46}, 0) == {"encoders": 0.46}
    p = lending_profile()
    c = p.paths["epd"]
    load = Load(WorkloadConfig(images_per_request=10, output_len=16), concurrency=2)
    kinds, share, work = _media(p, load, c)
    lay = layout(Topology.parse("1e+1pd"), 2, lend=True)
    seen = 0.4 * predict(p, "1e+1pd", 2, load).throughput_rps
    arrivals, loop = state_at(c, kinds, 16, lay, seen, share, work), state_at(c, kinds, 16, lay, seen, share, work, 2)
    assert loop.engines["engines"].speed.prefill < arrivals.engines["engines"].speed.prefill
    assert loop.encode_speed < arrivals.encode_speed
    assert state_at(c, kinds, 16, lay, seen, share, work, 1) == arrivals


def test_over_capacity_is_unstable_not_a_number(capsys: pytest.CaptureFixture[str]) -> None:
    p = profile()
    capacity = predict(p, "aggregated", 2, image_load(1.0)).capacity_rps
    over = predict(p, "aggregated", 2, image_load(1.5 * capacity, slo=SLO(ttft=0.5)))
    assert not over.stable
    assert over.ttft_p50_s is None and over.ttft_mean_s is None and over.goodput_rps is None
    assert over.throughput_rps == pytest.approx(capacity)
    under = predict(p, "aggregated", 2, image_load(0.5 * capacity))
    assert under.stable and under.ttft_p50_s is not None and math.isfinite(under.ttft_p50_s)


def test_latency_grows_with_the_arrival_rate() -> None:
    p = profile()
    capacity = predict(p, "1e+1pd", 2, image_load(1.0)).capacity_rps
    ttfts = [predict(p, "1e+1pd", 2, image_load(f * capacity)).ttft_p90_s for f in (0.1, 0.4, 0.7, 0.95)]
    assert all(t is not None for t in ttfts)
    assert ttfts == sorted(ttfts)  # type: ignore[type-var]


def test_closed_loop_obeys_littles_law() -> None:
    p = profile()
    pred = predict(p, "1e+1pd", 2, Load(WorkloadConfig(images_per_request=4, output_len=64), concurrency=4))
    assert pred.stable and pred.e2e_mean_s is not None
    assert pred.request_rate * pred.e2e_mean_s == pytest.approx(4, rel=1e-3)


def test_one_client_never_waits_and_borrows_every_idle_core() -> None:
    """A closed loop of one client: its request meets no other, so its TTFT is the stages' work
    alone (each at the full lending speed-up: the other role is idle while it computes), its
    tokens come one decode step of one sequence apart, and it sends again when it is answered."""
    p = lending_profile()
    c = p.paths["epd"]
    one = predict(p, "1e+1pd", 2, Load(WorkloadConfig(images_per_request=4, output_len=64), concurrency=1))
    tokens = p.text_tokens + 4 * p.image_tokens[0]
    alone = c.overhead(4) + c.encode(4, p.native_pixels) / 1.6 + c.prefill(tokens, 4, p.native_pixels) / 1.8
    assert one.ttft_p50_s == pytest.approx(alone, rel=1e-6)
    assert one.itl_s == pytest.approx(c.step(1) / 1.4, rel=1e-6)
    assert one.e2e_mean_s is not None
    assert one.request_rate == pytest.approx(1 / one.e2e_mean_s, rel=1e-3)


def test_a_closed_loop_meets_the_other_clients_load() -> None:
    """A request of a closed loop of N clients meets the other N − 1 clients' requests (the
    arrival theorem): it waits as a Poisson arrival at N − 1 clients' rate would, less than one
    at the whole rate, and more than a lone client."""
    p = profile()
    w = WorkloadConfig(images_per_request=4, output_len=64)
    lone = predict(p, "1e+1pd", 2, Load(w, concurrency=1)).ttft_mean_s
    for n in (2, 4, 16):
        closed = predict(p, "1e+1pd", 2, Load(w, concurrency=n))
        others = predict(p, "1e+1pd", 2, Load(w, request_rate=closed.request_rate * (n - 1) / n))
        whole = predict(p, "1e+1pd", 2, Load(w, request_rate=closed.request_rate))
        assert closed.ttft_mean_s == pytest.approx(others.ttft_mean_s, rel=1e-9)
        assert closed.itl_s == pytest.approx(others.itl_s, rel=1e-9)
        assert whole.ttft_mean_s is not None and lone is not None
        assert lone < closed.ttft_mean_s < whole.ttft_mean_s
        # its utilisation is the whole loop's
        assert closed.utilization == whole.utilization


def test_a_first_wave_queues_at_the_encoders_then_at_the_engines() -> None:
    """Requests sent at once go through the encoders one after another, then through their
    engine's prefills one after another: the slower stage sets the pace, and a request whose
    embeddings arrive while its engine only decodes waits half a decode step."""
    enc_bound = [WaveJob("image", True, 1.0, 0.5, 0.1)] * 3
    assert first_wave(enc_bound, engines=1, step_s=0.2) == pytest.approx([1.6, 2.7, 3.7])
    pf_bound = [WaveJob("image", True, 0.2, 1.0, 0.0)] * 3
    assert first_wave(pf_bound, engines=1, step_s=0.2) == pytest.approx([1.2, 2.2, 3.2])
    assert first_wave(pf_bound, engines=2, step_s=0.2) == pytest.approx([1.2, 1.4, 2.2])  # round-robin
    text = [WaveJob("text", False, 0.0, 0.3, 0.0)] * 2  # no encoder: straight to the engine
    assert first_wave(text, engines=1, step_s=0.2) == pytest.approx([0.3, 0.6])
    with pytest.raises(ValueError):
        first_wave(text, engines=0, step_s=0.2)


def test_a_wave_prefills_held_media_after_the_other_prompts() -> None:
    """An engine holds a request whose vision forward is past the step's bound while another
    prompt is in progress, whatever their order: the text's first token comes before the held
    images' prefill; the text goes on while another request's images are encoded; requests not
    held go in their order."""
    image, text = WaveJob("image", True, 0.0, 1.0, 0.0), WaveJob("text", False, 0.0, 0.3, 0.0)
    assert first_wave([image, text], engines=1, step_s=0.2) == pytest.approx([1.3, 0.3])
    encoded = WaveJob("image", True, 1.0, 0.5, 0.0)
    assert first_wave([encoded, text], engines=1, step_s=0.2) == pytest.approx([1.6, 0.3])
    assert first_wave([image, image, text], engines=1, step_s=0.2) == pytest.approx([1.3, 2.3, 0.3])
    light = WaveJob("image", False, 0.0, 1.0, 0.0)
    assert first_wave([light, text], engines=1, step_s=0.2) == pytest.approx([1.0, 1.3])
    # a text request ready only after a held prefill began waits for it (no preemption)
    late = WaveJob("text", False, 0.5, 0.3, 0.0)
    assert first_wave([image, late], engines=1, step_s=0.2) == pytest.approx([1.0, 1.3])


def test_encoders_stand_aside_for_a_wave_prefill_beside_decodes() -> None:
    """A prefill that starts while its engine decodes the requests it prefilled before runs at its
    speed on the encoders' cores, and the encode in progress waits for it; the first prefill meets
    no decodes, and without such a speed nothing changes."""
    job = WaveJob("image", False, 1.0, 1.0, 0.0, 0.5)
    assert first_wave([job] * 3, engines=1, step_s=0.2) == pytest.approx([2.0, 2.5, 4.1])
    plain = job._replace(urgent_prefill_s=None)
    assert first_wave([plain] * 3, engines=1, step_s=0.2) == pytest.approx([2.0, 3.0, 4.0])


def test_a_prefill_beside_decodes_borrows_the_cores_of_encoders_that_stand_aside() -> None:
    """Encoders that yield (``up``'s default where roles lend) lend their cores to the prompts that
    hold running decodes even while they encode, and lose that time, half of it at most; where
    roles keep their own cores nothing changes."""
    c = lending_profile().paths["epd"]
    lay = layout(Topology.parse("1e+1pd"), 2, lend=True, yields=True)
    busy = {"encoders": 1.0, "engines": 0.5}  # the encoder never idles: it lends nothing of itself
    plain, enc = speeds(c, lay, busy)
    held, enc_held = speeds(c, lay, busy, {"engines": Urgent(0.5, 0.2)})
    assert plain["engines"].prefill == pytest.approx(1.0)
    assert held["engines"].prefill == pytest.approx(1 + 0.8 * 0.5)  # half its prefills at 1.8x
    assert held["engines"].decode == plain["engines"].decode
    assert enc == pytest.approx(1 + 0.6 * 0.5) and enc_held == pytest.approx(enc * 0.8)
    assert speeds(c, lay, busy, {"engines": Urgent(1.0, 0.9)})[1] == pytest.approx(enc * (1 - YIELD_SHARE))
    for keeps in (layout(Topology.parse("1e+1pd"), 2, lend=True), layout(Topology.parse("1e+1pd"), 2, yields=True)):
        assert speeds(c, keeps, busy, {"engines": Urgent(0.5, 0.2)}) == speeds(c, keeps, busy)
    assert speeds(profile().paths["epd"], lay, busy, {"engines": Urgent(0.5, 0.2)})[1] == 1.0  # nothing lent


def test_encoders_that_stand_aside_trade_their_capacity_for_the_prompts() -> None:
    """Image-heavy load bounded by the encoders: standing aside for the prompts that hold decodes
    costs the encoders time, so the deployment sustains less than one whose encoders compute
    through, but never less than half its encoders' own speed; its prompts run faster."""
    p = lending_profile()
    heavy = image_load(1.0, images=10, out=16)
    aside, through = predict(p, "1e+1pd", 2, heavy), predict(p, "1e+1pd", 2, heavy, yields=False)
    own = predict(p, "1e+1pd", 2, heavy, lend=False)
    assert aside.bottleneck == through.bottleneck == "encoders"
    assert 0.5 * own.capacity_rps < aside.capacity_rps < through.capacity_rps
    busy = predict(p, "1e+1pd", 2, image_load(0.8 * aside.capacity_rps, images=10, out=16))
    busy_through = predict(p, "1e+1pd", 2, image_load(0.8 * aside.capacity_rps, images=10, out=16), yields=False)
    assert busy.itl_s is not None and busy_through.itl_s is not None and busy.itl_s < busy_through.itl_s


def test_a_runs_percentiles_are_interpolated_as_the_benchmark_does() -> None:
    """Over a run's few TTFTs, the first wave's and the rest at the steady distribution's evenly
    spaced quantiles, a percentile is the benchmark's own (linear interpolation)."""

    def uniform(t: float) -> float:  # the steady TTFT: uniform over [0, 10] s
        return min(1.0, max(0.0, t / 10))

    assert run_percentile([4.0, 1.0, 3.0, 2.0], 0, uniform, 50) == pytest.approx(percentile([1, 2, 3, 4], 50))
    assert run_percentile([], 5, uniform, 50) == pytest.approx(5.0)  # 1, 3, 5, 7, 9
    run = [20.0, 30.0, 10 / 6, 5.0, 50 / 6]  # the wave, then the steady quantiles at 1/6, 3/6, 5/6
    for p in (0, 30, 50, 90, 100):
        assert run_percentile([20.0, 30.0], 3, uniform, p) == pytest.approx(percentile(run, p), rel=1e-6)


def test_media_past_the_vision_bound_wait_behind_text_and_the_work_weighted_wait_is_kept() -> None:
    """The scheduler holds a request whose vision forward is past the step's bound while a prompt
    is in progress (a non-preemptive priority): in mixed traffic a text request then waits less
    than one with images, and more with more load; images within the bound, or encoded before
    the engine, share the text's steps and wait as long. As in any work-conserving order, the
    prefill-weighted mean wait is first-come-first-served's (Pollaczek-Khinchine) either way."""
    from epdserve.plan.cores import Pool, Speeds
    from epdserve.plan.model import VISION_STEP_S, engine, request_kinds

    pool, speed = Pool("engines", "pd", 1, True, True), Speeds(1.0, 1.0)
    kinds = request_kinds(profile(), WorkloadConfig(images_per_request=10, output_len=16, text_fraction=0.5))
    heavy = costs(encode_call_s=0, encode_image_s=0, encode_mpx_s=0, prefill_image_s=VISION_STEP_S / 5)
    light = costs(encode_call_s=0, encode_image_s=0, encode_mpx_s=0, prefill_image_s=VISION_STEP_S / 20)
    for c, rate in ((heavy, 0.3), (light, 1.0)):
        for encodes in (True, False):
            e = engine(c, rate, kinds, 16, speed, pool, encodes)
            text, image = e.prefill_wait_s["text"], e.prefill_wait_s["image"]
            if c is heavy and encodes:
                assert 0 < text < image
                assert engine(c, rate * 1.5, kinds, 16, speed, pool).prefill_wait_s["text"] > text
            else:
                assert 0 < text == pytest.approx(image, rel=1e-12)
            work = {k.name: c.prefill(k.prompt_tokens, k.images, k.pixels) for k in kinds}
            mean = sum(k.share * work[k.name] for k in kinds)
            residual = rate * sum(k.share * work[k.name] ** 2 for k in kinds) / 2
            step = (1 - math.exp(-e.batch)) * c.step(e.batch) / 2
            weighted = sum(k.share * work[k.name] * (e.prefill_wait_s[k.name] - step) for k in kinds)
            assert weighted == pytest.approx(mean * residual / (1 - e.load), rel=1e-9)


def test_held_media_wait_at_most_their_aging_longer_than_in_arrival_order() -> None:
    """A held request that has waited ``media_max_wait_s`` joins the first class: the held class
    waits at most that much longer than in arrival order, the first class gains only what it
    gives up (the work-weighted mean kept), and with no aging allowed both wait as in arrival
    order."""
    from epdserve.plan.queues import priority_waits

    residual, growth, first, load = 0.4, 0.1, 0.2, 0.8
    fifo = residual / (1 - load)
    free_first, free_held = priority_waits(residual, growth, first, load)
    assert free_first < fifo < free_held
    for cap in (0.0, 0.25 * (free_held - fifo)):
        got_first, got_held = priority_waits(residual, growth, first, load, max_defer=cap)
        assert got_held == pytest.approx(fifo + cap, rel=1e-12)
        assert free_first <= got_first <= fifo
        assert first * got_first + (load - growth - first) * got_held == pytest.approx(
            (load - growth) * fifo, rel=1e-12
        )
    assert priority_waits(residual, growth, first, load, max_defer=10 * free_held) == (free_first, free_held)
    assert priority_waits(residual, growth, load - growth, load) == (fifo, fifo)  # no held class


def test_a_wave_interleaves_request_kinds_by_their_shares() -> None:
    assert wave_order({"text": 0.5, "image": 0.5}, 4) in (["text", "image"] * 2, ["image", "text"] * 2)
    assert wave_order({"image": 1.0}, 3) == ["image"] * 3
    assert sorted(wave_order({"text": 0.25, "image": 0.75}, 4)) == ["image", "image", "image", "text"]


def test_a_short_closed_loop_adds_its_first_wave() -> None:
    """A closed loop of a few requests per client starts with every client sending at once: its
    TTFT is above the steady loop's, most for a run that is one wave, and a long run comes back
    to the steady loop. A run of one client has no wave to queue in."""
    p = profile()
    w = WorkloadConfig(images_per_request=4, output_len=64)
    steady = predict(p, "1e+1pd", 2, Load(w, concurrency=4))
    burst = predict(p, "1e+1pd", 2, Load(w, concurrency=4, requests=4))
    short = predict(p, "1e+1pd", 2, Load(w, concurrency=4, requests=8))
    long = predict(p, "1e+1pd", 2, Load(w, concurrency=4, requests=4000))
    assert steady.ttft_mean_s is not None and burst.ttft_mean_s is not None and short.ttft_mean_s is not None
    assert steady.ttft_mean_s < short.ttft_mean_s < burst.ttft_mean_s
    assert long.ttft_mean_s == pytest.approx(steady.ttft_mean_s, rel=0.01)
    for a in ("aggregated", "1e+1pd"):
        one = Load(w, concurrency=1)
        assert predict(p, a, 2, dataclasses.replace(one, requests=5)).ttft_p50_s == pytest.approx(
            predict(p, a, 2, one).ttft_p50_s, rel=1e-6
        )
    with pytest.raises(ValueError):
        Load(w, concurrency=4, requests=-1)


def test_a_run_ends_with_its_last_answer() -> None:
    """A closed loop's clients send again as their answers end, until every request is sent;
    the run takes until the last answer, a partial last round included."""
    assert run_time([10.0] * 4, 6, 10.0) == pytest.approx(20.0)  # two clients of four go again
    assert run_time([10.0] * 4, 8, 10.0) == pytest.approx(20.0)  # all four go again
    assert run_time([1.0, 2.0], 2, 5.0) == pytest.approx(2.0)  # one round
    assert run_time([1.0, 3.0], 4, 2.0) == pytest.approx(5.0)  # the earlier client takes both
    assert run_time([], 0, 1.0) == 0.0


def test_a_short_closed_loops_rate_is_its_requests_over_its_length() -> None:
    """The benchmark's rate is the requests over the run's length: a run whose last round is
    partial (6 requests from 4 clients) idles clients at its end and completes fewer requests a
    second than the steady loop, a run of whole rounds fewer than that only by its first wave,
    and a long run the steady loop's."""
    p = profile()
    w = WorkloadConfig(images_per_request=1, output_len=64)
    steady = predict(p, "aggregated", 2, Load(w, concurrency=4)).throughput_rps
    partial = predict(p, "aggregated", 2, Load(w, concurrency=4, requests=6)).throughput_rps
    whole = predict(p, "aggregated", 2, Load(w, concurrency=4, requests=8)).throughput_rps
    long = predict(p, "aggregated", 2, Load(w, concurrency=4, requests=4000)).throughput_rps
    assert partial < whole < steady
    assert partial < 0.85 * steady
    assert long == pytest.approx(steady, rel=0.01)


def test_goodput_falls_when_the_slo_tightens() -> None:
    """At the predicted TTFT p50 as the bound, half the requests meet it; looser, all; below the
    latency without any wait, none."""
    p = profile()
    p50 = predict(p, "aggregated", 2, image_load(4.0)).ttft_p50_s
    assert p50 is not None
    loose = predict(p, "aggregated", 2, image_load(4.0, slo=SLO(ttft=20 * p50)))
    median = predict(p, "aggregated", 2, image_load(4.0, slo=SLO(ttft=p50)))
    impossible = predict(p, "aggregated", 2, image_load(4.0, slo=SLO(ttft=0.001)))
    assert loose.goodput_rps == pytest.approx(4.0, rel=0.01)
    assert median.slo_fraction == pytest.approx(0.5, abs=1e-6)
    assert impossible.goodput_rps == 0


# ---- the planner -----------------------------------------------------------------------------------


def test_candidates_stay_within_the_replica_budget() -> None:
    names = candidates(3, split=True)
    assert names[0] == "aggregated"
    assert {"1e+1pd", "2e+1pd", "1e+2pd", "1e+1p+1d"} <= set(names)
    assert "2e+2pd" not in names and "1e+1p+2d" not in names
    assert not any("p+" in n for n in candidates(3, split=False))


def test_recommendation_follows_the_workload() -> None:
    """Image-heavy short answers: the encode moves off the engine, E+PD wins. Text with long
    answers: nothing to encode, the router's hop only adds latency, aggregated wins."""
    p = profile()
    images = plan(p, PlanConfig(image_load(10.0, images=10, out=16, slo=SLO(ttft=0.3)), cores=2))
    text = plan(p, PlanConfig(Load(WorkloadConfig(images_per_request=0, output_len=256), request_rate=2.0), cores=2))
    assert images.best is not None and text.best is not None
    assert images.best.path == "epd", images.ranked[:3]
    assert text.best.topology == "aggregated", text.ranked[:3]
    # the fewest processes among equals: 1e+1pd, not 2e+1pd, on 2 cores
    assert images.best.topology == "1e+1pd"


def test_no_stable_candidate_is_no_recommendation() -> None:
    result = plan(profile(), PlanConfig(image_load(1000.0), cores=2))
    assert result.best is None and result.ranked and not any(p.stable for p in result.ranked)


# ---- profiles --------------------------------------------------------------------------------------


def test_profile_round_trip(tmp_path: Path) -> None:
    p = profile()
    assert load_profile(save_profile(p, tmp_path / "p.json")) == p


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(version=PROFILE_VERSION + 1), "version"),
        (lambda d: d.pop("version"), "version"),
        (lambda d: d.pop("text_tokens"), "missing text_tokens"),
        (lambda d: d["paths"]["epd"].pop("decode_step_s"), "lacks decode_step_s"),
        (lambda d: d["paths"]["epd"].update(prefill_s=-1), "negative"),
        (lambda d: d["paths"].update(gpu={}), "unknown path"),
        (lambda d: d["paths"]["epd"].update(lend_decode_x=0.5), "lending speed-up below 1"),
    ],
)
def test_a_bad_profile_is_refused_clearly(tmp_path: Path, edit, message: str) -> None:  # type: ignore[no-untyped-def]
    data = profile().to_json()
    edit(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_a_profile_without_lending_reads_as_none(tmp_path: Path) -> None:
    """Lending speed-ups are optional: a profile calibrated without them has none, not an error."""
    data = lending_profile().to_json()
    for c in data["paths"].values():
        for name in ("lend_encode_x", "lend_prefill_x", "lend_decode_x"):
            c.pop(name)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    assert load_profile(path) == profile()
    assert load_profile(save_profile(lending_profile(), tmp_path / "l.json")) == lending_profile()


def test_not_json_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        load_profile(path)


def synthetic_sweep(c: PathCosts, queue_s: float = 0.005) -> dict:
    """A sweep.json of 1e+1pd cells whose stage means follow ``c``, each with ``queue_s`` of encoder
    and prefill queueing (closed loop, concurrency 2)."""
    cells = []
    for images in (0, 1, 4, 10):
        for out in (8, 32):
            tokens = 30 + 17 * images
            encode, prefill = c.encode(images, 16000.0), c.prefill(tokens, images, 16000.0)
            stages = {"pd_queue": queue_s, "pd_prefill": prefill}
            if images:
                stages |= {"router_encode": encode + queue_s, "encoder_queue": queue_s}
            ttft = c.overhead(images) + encode + prefill + (2 if images else 1) * queue_s
            e2e = ttft + 0.1 * out
            tpot = c.step(2 * (e2e - ttft) / e2e)
            stat = lambda v: {"count": 4, "mean": v, "p50": v, "p90": v, "p99": v, "max": v}  # noqa: E731
            summary = {
                "completed": 4,
                "input_tokens": 4 * tokens,
                "output_tokens": 4 * out,
                "ttft": stat(ttft),
                "e2e": stat(e2e),
                "tpot": stat(tpot),
                "stages": {k: stat(v) for k, v in stages.items()},
            }
            cells.append(
                {"topology": "1e+1pd", "cell": {"images": images, "output_len": out, "mixed": False}, "clean": True}
                | {"summary": summary}
            )
    config = {"request_rate": 0.0, "concurrency": 2, "image_size": 0, "prompt_tokens": 0, "seed": 0}
    env = {"nproc": 2, "cpu_model": "test", "date": "today", "commit": "abc"}
    return {"config": config, "environment": env, "cells": cells}


def test_profile_from_a_sweep(tmp_path: Path) -> None:
    """A sweep's cells, their queues taken out, give back the costs they were made of."""
    from epdserve.plan.calibrate import native_pixels, profile_from_sweep

    truth = costs(encode_mpx_s=0.0)  # one image size in the sweep: pixels cannot be told from images
    path = tmp_path / "sweep.json"
    path.write_text(json.dumps(synthetic_sweep(truth)))
    p = profile_from_sweep(path)
    assert set(p.paths) == {"epd"} and p.image_tokens == {0: pytest.approx(17)}
    fitted = p.paths["epd"]
    for name in ("encode_call_s", "encode_image_s", "overhead_s", "overhead_image_s", "decode_step_s", "decode_seq_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3, abs=1e-8), name
    # with one image size, a prompt's tokens grow with its images: only their sum is identified
    for images in (0, 1, 4, 10):
        tokens = 30 + 17 * images
        assert fitted.prefill(tokens, images, 16000.0) == pytest.approx(
            truth.prefill(tokens, images, 16000.0), rel=1e-6
        )
    assert native_pixels() == p.native_pixels


def test_a_sweep_without_stage_timing_is_refused_clearly() -> None:
    """The sweeps in docs/results ran before the client recorded Server-Timing."""
    from epdserve.plan.calibrate import profile_from_sweep

    with pytest.raises(ProfileError, match="no clean cell with stage timing"):
        profile_from_sweep(Path(__file__).parent.parent / "docs" / "results" / "sweep" / "sweep.json")


def record_of(own: list[Sample], lent: list[Sample]) -> SampleRecord:
    return SampleRecord("calibration of 1e+1pd, today", 2, "test", 16000.0, own, lent)


def test_saved_samples_fit_again_to_the_same_profile(tmp_path: Path) -> None:
    """A calibration's samples, saved and read back, fit the profile the calibration fitted:
    the costs and the lending speed-ups, with nothing measured again."""
    from epdserve.plan.calibrate import fit_profile, refit

    own = samples_of(costs())
    lent = lent_samples(own, 1.6, 1.8, 1.4)
    path = save_samples(record_of(own, lent), tmp_path / "samples.json")
    again = refit(load_samples(path), str(path))
    fitted = fit_profile(own, 16000.0, 2, "test", "x")
    assert (
        dataclasses.replace(again.paths["epd"], lend_encode_x=1.0, lend_prefill_x=1.0, lend_decode_x=1.0)
        == (fitted.paths["epd"])
    )
    assert again.paths["epd"].lend_prefill_x == pytest.approx(1.8)
    assert again.image_tokens == fitted.image_tokens and again.nproc == 2
    assert again.source == f"calibration of 1e+1pd, today, fitted again from {path}"


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d.update(version=0), "samples of version 0"),
        (lambda d: d.pop("own"), "not a record of calibration samples"),
        (lambda d: d.update(own=[]), "no samples"),
        (lambda d: d["own"][0].update(ttft_s="fast"), "not a record of calibration samples"),
        (lambda d: d["own"][0].update(ttft_s=-1.0), "negative or non-finite"),
        (lambda d: d["own"][0]["stages"].update(pd_prefill=-0.5), "negative or non-finite"),
        (lambda d: d["own"][0]["stages"].update(pd_prefill=float("inf")), "JSON is malformed"),
        (lambda d: d["lent"][0].update(concurrency=0), "negative or non-finite"),
    ],
)
def test_damaged_samples_are_refused_with_what_is_wrong(tmp_path: Path, damage: object, message: str) -> None:
    own = samples_of(costs())
    path = save_samples(record_of(own, own), tmp_path / "samples.json")
    data = json.loads(path.read_text())
    damage(data)  # type: ignore[operator]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=message):
        load_samples(path)
    path.write_text("{")
    with pytest.raises(ProfileError, match="not a JSON object"):
        load_samples(path)


def test_cli_plans_from_saved_samples(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_samples(record_of(samples_of(costs()), []), tmp_path / "samples.json")
    flags = ["--images-per-request", "4", "--request-rate", "5", "--topologies", "1e+1pd", "--json"]
    out = tmp_path / "p.json"
    assert main(["plan", "--samples", str(path), "--save-profile", str(out), *flags]) == 0
    assert json.loads(capsys.readouterr().out)["ranked"][0]["topology"] == "1e+1pd"
    assert load_profile(out).paths["epd"].prefill_token_s == pytest.approx(costs().prefill_token_s)
    assert main(["plan", "--profile", str(out), "--save-samples", str(tmp_path / "s.json"), *flags]) == 2
    assert "--save-samples keeps what a calibration measures" in capsys.readouterr().err


# ---- command line ----------------------------------------------------------------------------------


def test_cli_prints_the_ranking(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_profile(profile(), tmp_path / "p.json")
    flags = ["--images-per-request", "10", "--output-len", "16", "--request-rate", "10", "--slo", "ttft=300ms"]
    assert main(["plan", "--profile", str(path), *flags]) == 0
    out = capsys.readouterr().out
    assert "recommendation: 1e+1pd" in out and "epdserve up --topology 1e+1pd --pin-cores" in out
    assert "aggregated" in out.split("recommendation")[0]
    assert main(["plan", "--profile", str(path), *flags, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommendation"] == "1e+1pd"
    assert data["ranked"][0]["topology"] == "1e+1pd" and data["ranked"][0]["stable"] is True
    assert data["lend_cores"] is True


def test_cli_says_what_it_assumes_of_lending(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--images-per-request", "4", "--request-rate", "5", "--topologies", "1e+1pd", "--json"]

    def ttft(path: Path, *extra: str) -> float:
        assert main(["plan", "--profile", str(path), *flags, *extra]) == 0
        data = json.loads(capsys.readouterr().out)
        return float(data["ranked"][0]["ttft_mean_s"])

    lent = save_profile(lending_profile(), tmp_path / "lent.json")
    assert ttft(lent) < ttft(lent, "--no-lend-cores")
    assert main(["plan", "--profile", str(lent), *flags[:-1]]) == 0
    out = capsys.readouterr().out
    assert (
        "epd encode 1.60x, prefill 1.80x, decode 1.40x" in out
        and "prompts that hold decodes, encoders stand aside for them" in out
    )
    # encoders that compute through: their own capacity, and the flag in the command it recommends
    heavy = ["--images-per-request", "10", "--output-len", "16", "--request-rate", "1", "--topologies", "1e+1pd"]
    capacity = {}
    for extra in ((), ("--no-yield-to-decodes",)):
        assert main(["plan", "--profile", str(lent), *heavy, *extra, "--json"]) == 0
        capacity[extra] = json.loads(capsys.readouterr().out)["ranked"][0]["capacity_rps"]
    assert capacity[()] < capacity[("--no-yield-to-decodes",)]
    assert main(["plan", "--profile", str(lent), *heavy, "--no-yield-to-decodes"]) == 0
    out = capsys.readouterr().out
    assert "encoders compute through them" in out and "--pin-cores --no-yield-to-decodes" in out
    assert main(["plan", "--profile", str(lent), *flags[:-1], "--no-lend-cores"]) == 0
    out = capsys.readouterr().out
    assert "own cores only" in out and "--pin-cores --no-lend-cores" in out
    plain = save_profile(profile(), tmp_path / "plain.json")
    assert main(["plan", "--profile", str(plain), *flags[:-1]]) == 0
    assert "measured no speed-up" in capsys.readouterr().out


def test_cli_over_capacity_says_unstable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_profile(profile(), tmp_path / "p.json")
    assert main(["plan", "--profile", str(path), "--request-rate", "1000", "--topologies", "aggregated"]) == 1
    out = capsys.readouterr().out
    assert "unstable" in out and "no candidate keeps up" in out


def test_cli_refuses_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = save_profile(profile(), tmp_path / "p.json")
    assert main(["plan", "--profile", str(path)]) == 2  # no arrivals
    assert "--request-rate" in capsys.readouterr().err
    bad = tmp_path / "old.json"
    bad.write_text(json.dumps({**profile().to_json(), "version": 0}))
    assert main(["plan", "--profile", str(bad), "--request-rate", "1"]) == 2
    assert "profile version 0" in capsys.readouterr().err


def test_cli_calibrating_a_server_without_stage_timing_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """An OpenAI endpoint that is not epdserve (no Server-Timing) cannot be profiled: a clear error."""
    import asyncio
    import threading

    from epdserve.bench.loadgen import TrivialServer

    loop = asyncio.new_event_loop()
    server = TrivialServer(tokens=4)
    threading.Thread(target=loop.run_forever, daemon=True).start()
    url = asyncio.run_coroutine_threadsafe(server.__aenter__(), loop).result(10)
    try:
        rc = main(["plan", "--calibrate", url, "--calibration-requests", "1", "--request-rate", "1"])
    finally:
        asyncio.run_coroutine_threadsafe(server.__aexit__(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
    assert rc == 2
    assert "no stage timing" in capsys.readouterr().err


# ---- calibration against a real deployment ---------------------------------------------------------


def test_lending_calibration_repeats_the_unloaded_runs_lending_changes() -> None:
    from epdserve.plan.calibrate import CalibrationConfig

    config = CalibrationConfig(images=(1, 4), image_sides=(0, 224), concurrencies=(1, 2, 4))
    cells = config.lending_cells()
    assert set(cells) < set(config.cells()) and all(c == 1 for _, c in cells)
    assert {(w.images_per_request, w.image_size) for w, _ in cells if w.images_per_request} == {(1, 224), (4, 224)}
    assert any(w.prompt_tokens for w, _ in cells)  # prefill of text
    assert any(w.output_len == config.decode_output_len for w, _ in cells)  # decode steps


def test_calibration_against_a_started_deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """1e+1pd started pinned, a few requests of each shape: the E+PD path is recognised from its
    stage timing (the router tells it to the calibrating process, which proves the credential the
    deployment made for itself), and its costs come out positive where the work is."""
    from epdserve.plan.calibrate import CalibrationConfig, calibrate_topologies

    monkeypatch.delenv("EPD_CLUSTER_SECRET")  # the deployment makes its own, as under a bare shell
    config = CalibrationConfig(images=(1, 4), image_sides=(0,), concurrencies=(1, 2), requests=2, decode_output_len=16)
    p = calibrate_topologies(config, ["1e+1pd"], log_dir=tmp_path / "logs")
    assert set(p.paths) == {"epd"}
    assert (tmp_path / "logs" / "1e_1pd-lent").is_dir()  # started again, lending, for the speed-ups
    c = p.paths["epd"]
    assert c.encode_call_s + c.encode_image_s > 0
    assert c.decode_step_s > 0 and c.prefill_s + c.prefill_token_s > 0
    assert 0 < p.image_tokens[0] < 100 and p.text_tokens > 0
    pred = predict(p, "1e+1pd", 2, image_load(1.0, images=4))
    assert pred.stable and pred.ttft_p50_s is not None and 0 < pred.ttft_p50_s < 5
    assert load_profile(save_profile(p, tmp_path / "p.json")) == p
    assert "EPD_CLUSTER_SECRET" not in os.environ  # lent for the calibration only
