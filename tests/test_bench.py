"""The load generator: workload knobs, arrivals, SLO/goodput math, and end-to-end runs on loopback."""

from __future__ import annotations

import asyncio
import base64
import io
import itertools
import json
import random
import re
import statistics
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image
from tokenizers import Tokenizer

from epdserve.bench.client import RequestResult, percentile
from epdserve.bench.loadgen import (
    BenchConfig,
    TrivialServer,
    poisson_arrivals,
    run_bench,
    run_self_test,
)
from epdserve.bench.plots import PlottingUnavailable, pyplot
from epdserve.bench.report import SLO, Stats, error_label, parse_duration, summarize, summarize_by_kind
from epdserve.bench.workload import BenchRequest, WorkloadConfig, build_workload
from epdserve.cli import main
from epdserve.launcher import free_port
from epdserve.shapes import SIDES

# ---- helpers -------------------------------------------------------------------------------------------


def media_parts(req: BenchRequest) -> list[dict]:
    return [p for p in req.payload["messages"][0]["content"] if p["type"] != "text"]


def media_urls(reqs: list[BenchRequest]) -> list[str]:
    return [(p.get("image_url") or p["video_url"])["url"] for r in reqs for p in media_parts(r)]


def decode(url: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def text_of(req: BenchRequest) -> str:
    return next(p["text"] for p in req.payload["messages"][0]["content"] if p["type"] == "text")


def result(
    ttft: float = 0.1, e2e: float = 1.0, itl: list[float] | None = None, ok: bool = True, status: int = 200, **kw
) -> RequestResult:
    gaps = itl if itl is not None else [0.01] * 9
    return RequestResult(ok=ok, status=status, ttft=ttft, e2e=e2e, itl=gaps, output_tokens=len(gaps) + 1, **kw)


# ---- workload ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 50])
def test_images_per_request(k: int) -> None:
    reqs = build_workload(WorkloadConfig(images_per_request=k), "m", 6, seed=1)
    assert [r.kind for r in reqs] == ["image"] * 6
    for r in reqs:
        parts = media_parts(r)
        assert len(parts) == r.num_images == k and all(p["type"] == "image_url" for p in parts)
        assert r.payload["model"] == "m" and r.payload["stream"] is True
        assert r.payload["stream_options"] == {"include_usage": True}


def test_zero_images_means_text_only() -> None:
    reqs = build_workload(WorkloadConfig(images_per_request=0), "m", 5, seed=1)
    assert [r.kind for r in reqs] == ["text"] * 5 and not media_urls(reqs)


def test_image_size_resizes_or_keeps_spec_sizes() -> None:
    native = build_workload(WorkloadConfig(images_per_request=4), "m", 5, seed=2)
    assert {s for u in media_urls(native) for s in decode(u).size} <= set(SIDES)
    resized = build_workload(WorkloadConfig(images_per_request=2, image_size=224, video_fraction=0.5), "m", 4, seed=2)
    sizes = {decode(u).size for u in media_urls(resized)}
    assert sizes == {(224, 224)}  # video frames too


def test_repeated_fraction_reuses_a_small_pool() -> None:
    fresh = build_workload(WorkloadConfig(images_per_request=2), "m", 40, seed=3)
    assert len(set(media_urls(fresh))) == 80  # no accidental repeats
    cfg = WorkloadConfig(images_per_request=2, repeated_fraction=0.5, pool_size=4)
    reqs = build_workload(cfg, "m", 40, seed=3)
    urls = media_urls(reqs)
    assert sum(r.num_repeated for r in reqs) == 40
    repeated = [u for u, c in Counter(urls).items() if c > 1]
    assert 1 <= len(repeated) <= 4 and sum(urls.count(u) for u in repeated) >= 40 - 3
    assert 40 < len(set(urls)) <= 44


def test_mix_ratio_and_video_fraction() -> None:
    cfg = WorkloadConfig(images_per_request=2, text_fraction=0.3, video_fraction=0.2)
    reqs = build_workload(cfg, "m", 50, seed=4)
    assert Counter(r.kind for r in reqs) == {"image": 25, "text": 15, "video": 10}
    assert len({tuple(r.kind for r in reqs[i : i + 10]) for i in (0, 10, 20)}) > 1  # shuffled, not blocks
    for r in reqs:
        parts = media_parts(r)
        if r.kind == "text":
            assert parts == []
        elif r.kind == "video":
            assert [p["type"] for p in parts] == ["video_url"] and r.num_videos == 1
            gif = decode(parts[0]["video_url"]["url"])
            assert gif.format == "GIF" and getattr(gif, "n_frames", 1) == 4
        else:
            assert [p["type"] for p in parts] == ["image_url"] * 2


def test_exact_output_fields() -> None:
    exact = build_workload(WorkloadConfig(output_len=17), "m", 3, seed=5)
    for r in exact:
        p = r.payload
        assert (p["max_tokens"], p["min_tokens"], p["ignore_eos"], p["temperature"]) == (17, 17, True, 0)
    loose = build_workload(WorkloadConfig(output_len=17, exact_output=False), "m", 3, seed=5)
    for r in loose:
        assert r.payload["max_tokens"] == 17 and "min_tokens" not in r.payload and "ignore_eos" not in r.payload


@pytest.mark.parametrize("target", [30, 200])
def test_prompt_padding_is_roughly_n_tokens(target: int, model_dir: Path) -> None:
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    reqs = build_workload(WorkloadConfig(prompt_tokens=target, text_fraction=0.5), "m", 10, seed=6)
    for r in reqs:
        n = len(tok.encode(text_of(r), add_special_tokens=False).ids)
        assert abs(n - target) <= 3, (n, text_of(r))
    firsts = {text_of(r)[:40] for r in reqs}
    assert len(firsts) == len(reqs)  # padded prompts do not share a prefix


def test_workload_is_deterministic_and_validated() -> None:
    cfg = WorkloadConfig(images_per_request=2, text_fraction=0.2, video_fraction=0.2, repeated_fraction=0.3)
    assert [r.body for r in build_workload(cfg, "m", 10, 9)] == [r.body for r in build_workload(cfg, "m", 10, 9)]
    assert [r.body for r in build_workload(cfg, "m", 10, 9)] != [r.body for r in build_workload(cfg, "m", 10, 8)]
    for bad in (
        {"images_per_request": 51},
        {"text_fraction": 0.7, "video_fraction": 0.4},
        {"repeated_fraction": 1.5},
        {"output_len": 0},
    ):
        with pytest.raises(ValueError):
            WorkloadConfig(**bad)  # type: ignore[arg-type]


# ---- arrivals ------------------------------------------------------------------------------------------


def test_poisson_arrivals_have_the_mean_rate() -> None:
    arrivals = poisson_arrivals(20_000, 40.0, random.Random(0))
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals)
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert (len(arrivals) - 1) / arrivals[-1] == pytest.approx(40.0, rel=0.05)
    # exponential gaps: standard deviation equals the mean
    assert statistics.stdev(gaps) / statistics.mean(gaps) == pytest.approx(1.0, abs=0.05)


# ---- SLO, goodput, statistics --------------------------------------------------------------------------


def test_slo_parsing() -> None:
    slo = SLO.parse("ttft=500ms,itl=100ms,e2e=2s,tpot=50ms")
    assert (slo.ttft, slo.itl, slo.e2e, slo.tpot) == (0.5, 0.1, 2.0, 0.05)
    assert SLO.parse("TTFT = 250 , e2e=1.5s").given == {"ttft": 0.25, "e2e": 1.5}  # bare number: ms
    assert SLO.parse("").given == {} and parse_duration("150us") == pytest.approx(150e-6)
    for bad in ("ttfb=1s", "ttft", "ttft=fast", "e2e=2h"):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_goodput_counts_requests_meeting_every_bound() -> None:
    results = [
        result(ttft=0.2, e2e=1.0),  # meets everything
        result(ttft=0.6, e2e=1.0),  # TTFT too slow
        result(ttft=0.2, e2e=1.0, itl=[0.01] * 8 + [0.15]),  # one gap over the ITL bound
        result(ttft=0.2, e2e=3.0),  # E2E too slow (and TPOT 0.31 s)
        result(ok=False, status=503),
        result(ok=False, status=0),
    ]
    s = summarize(results, 2.0, SLO.parse("ttft=500ms,itl=100ms,e2e=2s"))
    assert (s.requests, s.completed, s.slo_met) == (6, 4, 1)
    assert s.goodput == pytest.approx(0.5) and s.request_throughput == pytest.approx(2.0)
    assert s.errors == {"503": 1, "connection": 1}
    # the ITL bound is per request's max gap: a mean within the bound does not save request 3
    assert not SLO(itl=0.1).met_by(results[2]) and SLO(itl=0.15).met_by(results[2])
    assert SLO(tpot=0.1).met_by(results[0]) and not SLO(tpot=0.1).met_by(results[3])
    assert summarize(results, 2.0).goodput is None and summarize(results, 2.0, SLO()).slo_met is None


def test_summary_throughput_and_latency_stats() -> None:
    results = [result(ttft=0.1 * i, e2e=1.0 + i, kind="image" if i % 2 else "text") for i in range(1, 5)]
    for r in results:
        r.prompt_tokens = 100
    s = summarize(results, 4.0)
    assert s.output_tokens == 40 and s.input_tokens == 400
    assert s.output_token_throughput == pytest.approx(10.0) and s.input_token_throughput == pytest.approx(100.0)
    assert s.ttft.mean == pytest.approx(0.25) and s.ttft.max == pytest.approx(0.4)
    assert s.e2e.p50 == pytest.approx(3.5) and s.itl.count == 36 and s.itl.p99 == pytest.approx(0.01)
    assert s.tpot.p50 == pytest.approx((3.5 - 0.25) / 9)
    kinds = summarize_by_kind(results, 4.0)
    assert set(kinds) == {"image", "text"} and kinds["text"].completed == 2
    assert summarize_by_kind(results[:1], 4.0) == {}
    assert error_label(RequestResult(ok=False, status=200)) == "stream"


def test_percentiles() -> None:
    values = [float(v) for v in range(1, 101)]
    random.Random(0).shuffle(values)
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 90) == pytest.approx(90.1)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert (percentile(values, 0), percentile(values, 100)) == (1.0, 100.0)
    assert percentile([], 50) == 0.0 and percentile([3.0], 99) == 3.0
    st = Stats.of([1.0, 2.0, 3.0, 10.0])
    assert (st.count, st.mean, st.p50, st.max) == (4, 4.0, 2.5, 10.0)


# ---- end to end on loopback ----------------------------------------------------------------------------


def test_closed_loop_against_trivial_server() -> None:
    workload = WorkloadConfig(images_per_request=2, output_len=12, text_fraction=0.25, video_fraction=0.25)

    async def go():
        async with TrivialServer(tokens=12) as url:
            assert url.startswith("http://127.0.0.1:")
            config = BenchConfig(url=url, workload=workload, num_requests=24, warmup=3, concurrency=4)
            return await run_bench(config, progress)

    progress = io.StringIO()

    res = asyncio.run(go())
    s = res.summary
    assert res.model == "trivial"  # read from /v1/models
    assert (s.requests, s.completed, s.errors) == (24, 24, {})
    assert s.output_tokens == 24 * 12 and s.input_tokens > 0
    assert all(len(r.itl) == 11 and r.ttft <= r.e2e for r in res.results)
    assert {k: v.requests for k, v in res.per_kind.items()} == {"image": 12, "text": 6, "video": 6}
    assert res.duration_s > 0 and res.cpu_s > 0 and res.max_send_lag_s == 0.0
    assert "[warm-up] 3/3 done, 0 failed" in progress.getvalue()
    assert "[bench] 24/24 done, 0 failed" in progress.getvalue()


def test_side_by_side_loop_sends_every_payload_and_gives_one_row() -> None:
    from epdserve.bench import closed_loop

    body = {"model": "trivial", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    payloads = [("text", body)] * 5 + [("image", body)] * 2

    async def go():
        async with TrivialServer(tokens=5) as url:
            return await closed_loop.closed_loop(url, payloads, 3)

    results, wall = asyncio.run(go())
    assert [r.kind for r in results] == ["text"] * 5 + ["image"] * 2  # send order
    assert all(r.ok and r.output_tokens == 5 for r in results)
    row = closed_loop.summarize(results, wall)
    assert (row["ok"], row["errors"]) == (7, 0)
    assert row["req_per_s"] == pytest.approx(7 / wall) and row["out_tok_per_s"] == pytest.approx(35 / wall)
    assert 0 < row["ttft_p50_ms"] <= row["e2e_p50_ms"] and row["tpot_p50_ms"] > 0


def test_open_loop_follows_the_poisson_schedule() -> None:
    async def go():
        async with TrivialServer(tokens=4) as url:
            workload = WorkloadConfig(images_per_request=0, output_len=4)
            return await run_bench(BenchConfig(url=url, workload=workload, num_requests=40, warmup=0, request_rate=200))

    res = asyncio.run(go())
    expected = poisson_arrivals(40, 200.0, random.Random(0))
    starts = [r.start - res.started for r in res.results]
    assert res.summary.completed == 40
    assert max(abs(s - e) for s, e in zip(starts, expected, strict=True)) < 0.25  # loose: a busy CI core
    assert res.duration_s >= expected[-1]


def test_unreachable_server_counts_connection_errors() -> None:
    config = BenchConfig(url=f"http://127.0.0.1:{free_port()}", model="m", num_requests=3, warmup=0)
    s = asyncio.run(run_bench(config)).summary
    assert (s.completed, s.errors, s.request_throughput) == (0, {"connection": 3}, 0.0)


def test_self_test_measures_client_overhead() -> None:
    config = BenchConfig(workload=WorkloadConfig(output_len=16), num_requests=30, warmup=2, concurrency=4)
    st = asyncio.run(run_self_test(config))
    assert st.full.summary.output_tokens == 30 * 16 and st.one_token.summary.output_tokens == 30
    assert 0 < st.cpu_per_request_s < 0.1 and 0 <= st.cpu_per_token_s < 0.01


def test_cli_writes_json_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    argv = ["bench", "--self-test", "-n", "12", "--warmup", "1", "--concurrency", "3", "--output-len", "5"]
    argv += ["--text-fraction", "0.5", "--slo", "ttft=10s,itl=10s", "--out", str(out), "--plots", str(plots)]
    assert main([*argv, "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "client ceiling" in text and "us per output token" in text
    data = json.loads(out.read_text())
    assert data["summary"]["completed"] == 12 and data["summary"]["slo_met"] == 12
    assert set(data["per_kind"]) == {"image", "text"} and data["per_kind"]["text"]["requests"] == 6
    assert data["config"]["workload"]["text_fraction"] == 0.5 and data["config"]["slo"]["itl"] == 10.0
    assert len(data["requests"]) == 12 and all(len(r["itl_s"]) == 4 for r in data["requests"])
    # the per-token figure is a difference of two CPU totals: with 5 tokens it may round to 0
    assert data["self_test"]["cpu_per_request_s"] > 0 and data["self_test"]["cpu_per_token_s"] >= 0
    for name in ("ttft", "tpot", "itl", "e2e"):
        assert (plots / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    down = f"http://127.0.0.1:{free_port()}"  # nothing listens: one line naming the URL, no traceback
    assert main(["bench", "--url", down]) == 1
    assert down in capsys.readouterr().err
    assert main(["bench", "--self-test", "--slo", "ttfb=1s"]) == 2
    assert main(["bench", "--self-test", "--images-per-request", "51"]) == 2
    assert "ttfb" in capsys.readouterr().err


def test_plots_without_matplotlib_are_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra has
    with pytest.raises(PlottingUnavailable, match=re.escape("pip install 'epdserve[plot]'")):
        pyplot()
    argv = ["bench", "--self-test", "-n", "2", "--warmup", "0", "--output-len", "2", "--no-progress"]
    assert main([*argv, "--plots", str(tmp_path / "plots")]) == 2
    assert "pip install 'epdserve[plot]'" in capsys.readouterr().err
    assert not (tmp_path / "plots").exists()
    assert main(argv) == 0  # the benchmark itself needs no matplotlib
