"""``epdserve bench`` against a real ``epdserve serve`` on loopback: exact output lengths, every kind served."""

from __future__ import annotations

import asyncio

from epdserve.bench.loadgen import run_bench
from epdserve.bench.report import BenchConfig
from epdserve.bench.workload import WorkloadConfig
from tests.server_utils import running


def test_bench_against_the_aggregated_server() -> None:
    workload = WorkloadConfig(images_per_request=2, output_len=6, text_fraction=0.25, video_fraction=0.25)
    with running(["serve", "--max-model-len", "1024", "--num-kv-blocks", "256", "--threads", "1"]) as url:
        config = BenchConfig(url=url, workload=workload, num_requests=4, warmup=1, concurrency=2)
        res = asyncio.run(run_bench(config))
    s = res.summary
    assert res.model == "shapes-qwen2vl"
    assert (s.completed, s.errors) == (4, {})
    assert [r.output_tokens for r in res.results] == [6] * 4  # min_tokens + ignore_eos honoured
    assert {k: v.completed for k, v in res.per_kind.items()} == {"image": 2, "text": 1, "video": 1}
    # media tokens make image and video prompts longer than the text-only one
    assert res.per_kind["text"].input_tokens < min(
        res.per_kind["image"].input_tokens, res.per_kind["video"].input_tokens
    )
    assert all(r.ttft > 0 and len(r.itl) == 5 for r in res.results)
