"""The front end's tokenizer (``tokenizers`` + jinja) renders, encodes and decodes exactly like
transformers' AutoTokenizer on the same checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from epdserve.api.tokenizer import FastTokenizer, TemplateError

CONVERSATIONS = [
    [{"role": "user", "content": "Describe the image."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
    [
        {"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Compare."}]},
        {"role": "assistant", "content": "The first is red."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "And this? 日本語 😀"}]},
    ],
    [{"role": "user", "content": [{"type": "text", "text": "a\n\n  b\t<|im_start|>"}]}],
]


@pytest.fixture(scope="module")
def pair(model_dir: Path) -> tuple[FastTokenizer, object]:
    return FastTokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("i", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [{}, {"add_vision_id": True}])
def test_template_and_encoding_equal_transformers(pair, i: int, kwargs: dict) -> None:
    fast, hf = pair
    messages = CONVERSATIONS[i]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
    got = fast.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    assert got == want
    assert fast.encode(got) == hf(got, add_special_tokens=False)["input_ids"]


def test_decoding_and_special_tokens_equal_transformers(pair) -> None:
    fast, hf = pair
    assert fast.all_special_ids == sorted(hf.all_special_ids)
    assert fast.eos_token_id == hf.eos_token_id
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(len(hf)) for _ in range(rng.randrange(1, 30))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert fast.convert_ids_to_tokens(ids[0]) == hf.convert_ids_to_tokens(ids[0])


def test_template_errors_are_typed(model_dir: Path) -> None:
    fast = FastTokenizer(model_dir)
    fast.chat_template = "{% if messages[0].role != 'system' %}{{ raise_exception('needs a system turn') }}{% endif %}"
    with pytest.raises(TemplateError, match="needs a system turn"):
        fast.apply_chat_template(CONVERSATIONS[0])
    broken = FastTokenizer(model_dir)
    broken.chat_template = "{% for m in messages %}"
    with pytest.raises(TemplateError, match="does not compile"):
        broken.apply_chat_template(CONVERSATIONS[0])
