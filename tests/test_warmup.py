"""Warm-ups: a language-model worker runs one request of its own through every stage, and an
encoder encodes one image, before /health answers; a warm-up that fails leaves a role that serves."""

from __future__ import annotations

from tests.server_utils import counter, device_args, openai_client, running


def test_a_worker_runs_its_warm_up_before_it_is_healthy_and_not_with_no_warmup() -> None:
    args = [*device_args(), "--max-model-len", "512", "--num-kv-blocks", "64"]
    with running(["serve", *args]) as url:
        # before any client request the engine has looked a prompt up and encoded an image
        assert counter(url, "prefix_cache_queries_total") > 0
        assert counter(url, "encoder_cache_bytes") > 0
        reply = openai_client(url).chat.completions.create(
            model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 3
    with running(["serve", *args, "--no-warmup"]) as url:
        assert counter(url, "prefix_cache_queries_total") == 0
        assert counter(url, "encoder_cache_bytes") == 0


def test_a_warm_up_that_cannot_run_leaves_a_worker_that_serves() -> None:
    # a context this short does not hold the warm-up's prompt (template, text and image)
    args = [*device_args(), "--max-model-len", "32", "--num-kv-blocks", "16"]
    with running(["serve", *args]) as url:
        assert counter(url, "prefix_cache_queries_total") == 0
        reply = openai_client(url).chat.completions.create(
            model="", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 2


def test_an_encoder_encodes_its_warm_up_image_before_it_is_healthy_and_not_with_no_warmup() -> None:
    args = ["encoder", *device_args(), "--threads", "1", "--ec-shm-bytes", str(16 << 20)]
    with running(args) as url:
        # one forward of its own; nothing a client sent is counted as encoded
        assert counter(url, "encoder_batches_total") == 1 and counter(url, "encoder_cache_items") == 1
        assert counter(url, "encode_requests_total") == 0
    with running([*args, "--no-warmup"]) as url:
        assert counter(url, "encoder_batches_total") == 0 and counter(url, "encoder_cache_items") == 0
