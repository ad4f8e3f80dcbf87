"""logprobs / top_logprobs in chat completions, streamed and not, checked against transformers'
own scores for the same greedy generation (the raw next-token distribution at each step)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from epdserve.bench.workload import image_data_url
from epdserve.hf_reference import HFReference
from epdserve.shapes import ShapesWorld, render_images
from tests.server_utils import post_json, running

MAX_NEW = 8
TOP = 4
ABS = 2e-3  # logprobs of the same logits through different batch shapes: far below a real bug


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with running(["serve", "--max-model-len", "1024", "--num-kv-blocks", "256"]) as url:
        yield url


def hf_scores(hf: HFReference, messages: list[dict], images) -> tuple[list[int], list[torch.Tensor]]:
    inputs = hf.inputs(messages, images=images)
    with torch.inference_mode():
        out = hf.model.generate(
            **inputs,
            max_new_tokens=MAX_NEW,
            min_new_tokens=MAX_NEW,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ids = out.sequences[0, inputs["input_ids"].shape[1] :].tolist()
    return ids, [torch.log_softmax(step[0].float(), -1) for step in out.logits]


def test_logprobs_match_transformers_streamed_and_not(server: str, hf: HFReference) -> None:
    sample = ShapesWorld(5).sample("describe")
    image = render_images(sample)[0]
    hf_msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": sample.question}]}]
    want_ids, want_lp = hf_scores(hf, hf_msgs, [image])
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none")
    model = client.models.list().data[0].id
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": image_data_url(image)}},
                {"type": "text", "text": sample.question},
            ],
        }
    ]
    kw = {"model": model, "messages": messages, "max_tokens": MAX_NEW, "temperature": 0}
    kw |= {"logprobs": True, "top_logprobs": TOP, "extra_body": {"min_tokens": MAX_NEW, "ignore_eos": True}}
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            streamed += chunk.choices[0].logprobs.content or []
    assert len(content) == len(streamed) == MAX_NEW
    for i, (entry, s_entry) in enumerate(zip(content, streamed, strict=True)):
        assert entry.token == s_entry.token and abs(entry.logprob - s_entry.logprob) <= ABS
        want_tok = want_ids[i]
        assert entry.logprob == pytest.approx(float(want_lp[i][want_tok]), abs=ABS), i
        top = torch.topk(want_lp[i], TOP)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(top.values.tolist(), abs=ABS)
        # greedy picks the best token, or one below it where min_tokens masked end-of-sequence
        assert entry.logprob <= entry.top_logprobs[0].logprob + ABS
    text = full.choices[0].message.content
    assert b"".join(bytes(e.bytes) for e in content).decode() == text  # each token's true bytes


def test_without_logprobs_none_are_sent_and_bad_values_are_refused(server: str, model_dir: Path) -> None:
    model = model_dir.name
    base = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    status, body = post_json(f"{server}/v1/chat/completions", base)
    assert status == 200 and body["choices"][0]["logprobs"] is None
    status, body = post_json(f"{server}/v1/chat/completions", {**base, "top_logprobs": 3})
    assert status == 400 and body["error"]["param"] == "top_logprobs"
    status, body = post_json(f"{server}/v1/chat/completions", {**base, "logprobs": True, "top_logprobs": 21})
    assert status == 400
