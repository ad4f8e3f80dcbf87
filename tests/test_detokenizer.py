"""Incremental detokenization: the windowed ``Detokenizer`` gives exactly the text of a full decode
at every step (``IncrementalText``), with stop strings, special tokens and split UTF-8 characters,
in work per token that does not grow with the output; and each token's text and bytes."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
from transformers import AutoTokenizer

from epdserve.assets import default_model_dir
from epdserve.engine.detokenizer import BYTE_OF_CHAR, Detokenizer, token_text_and_bytes
from tests.reference_detokenizer import IncrementalText

MULTIBYTE = "日本語テキスト 😀🎉 naïve"


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(default_model_dir())


def byte_token(tok: Any, b: int) -> int:
    """The id of the token that is the single byte ``b``."""
    char = next(c for c, v in BYTE_OF_CHAR.items() if v == b)
    return int(tok.convert_tokens_to_ids(char))


def reference(
    tok: Any, pushes: Sequence[Sequence[int]], stop: tuple[str, ...], skip_special_tokens: bool = True
) -> tuple[list[str], str]:
    """Today's approach: IncrementalText fed the full decode after every push (the last is final)."""
    inc, ids, deltas = IncrementalText(stop), [], []
    for i, push in enumerate(pushes):
        ids += push
        decoded = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        deltas.append(inc.update(decoded, final=i == len(pushes) - 1))
    return deltas, inc.text


def detokenize(detok: Detokenizer, pushes: Sequence[Sequence[int]]) -> list[str]:
    return [detok.push(list(push), final=i == len(pushes) - 1) for i, push in enumerate(pushes)]


def split(ids: list[int], rng: random.Random, max_push: int = 3) -> list[list[int]]:
    """Pushes of 1..max_push ids, then sometimes an empty final push (a finish without a token)."""
    pushes, i = [], 0
    while i < len(ids):
        n = rng.randint(1, max_push)
        pushes.append(ids[i : i + n])
        i += n
    if rng.random() < 0.3:
        pushes.append([])
    return pushes


def random_ids(tok: Any, rng: random.Random, n: int) -> list[int]:
    """Runs of real multi-byte text (cut anywhere), arbitrary vocabulary ids (often stray or
    incomplete UTF-8 bytes) and special tokens, mixed."""
    text_ids = tok.encode(MULTIBYTE + " the shape is a circle")
    special = sorted(tok.all_special_ids)
    vocab = len(tok)
    ids: list[int] = []
    while len(ids) < n:
        kind = rng.random()
        if kind < 0.5:
            start = rng.randrange(len(text_ids))
            ids += text_ids[start : start + rng.randint(1, 8)]
        elif kind < 0.85:
            ids.append(rng.randrange(vocab))
        else:
            ids.append(rng.choice(special))
    return ids[:n]


# --------------------------------------------------------------------------- same text as a full decode


def test_same_text_as_full_decode_on_random_ids(tok: Any) -> None:
    rng = random.Random(1234)
    for _ in range(300):
        ids = random_ids(tok, rng, rng.randint(1, 60))
        pushes = split(ids, rng)
        deltas = detokenize(Detokenizer(tok), pushes)
        ref_deltas, ref_text = reference(tok, pushes, ())
        assert "".join(deltas) == "".join(ref_deltas) == ref_text == tok.decode(ids, skip_special_tokens=True)


def test_same_text_as_full_decode_keeping_special_tokens(tok: Any) -> None:
    rng = random.Random(7)
    for _ in range(100):
        ids = random_ids(tok, rng, rng.randint(1, 60))
        pushes = split(ids, rng)
        stop = ("<|im_end|>",) if rng.random() < 0.5 else ()
        detok = Detokenizer(tok, stop, skip_special_tokens=False)
        ref_deltas, ref_text = reference(tok, pushes, stop, skip_special_tokens=False)
        assert "".join(detokenize(detok, pushes)) == "".join(ref_deltas) == ref_text == detok.text


def test_same_text_as_full_decode_with_stop_strings(tok: Any) -> None:
    rng = random.Random(99)
    stopped = 0
    for _ in range(400):
        ids = random_ids(tok, rng, rng.randint(1, 60))
        full = tok.decode(ids, skip_special_tokens=True)
        stop: list[str] = []
        for _ in range(rng.randint(1, 3)):
            if full and rng.random() < 0.7:  # a piece of the text: straddles token boundaries
                start = rng.randrange(len(full))
                piece = full[start : start + rng.randint(1, 4)]
                if "\ufffd" not in piece:
                    stop.append(piece)
            else:
                stop.append(rng.choice(["日本", "😀", "e", "cle", "語テ", "zz", " a", "é", "ïv"]))
        pushes = split(ids, rng)
        detok = Detokenizer(tok, tuple(stop))
        deltas = detokenize(detok, pushes)
        ref_deltas, ref_text = reference(tok, pushes, tuple(stop))
        assert "".join(deltas) == "".join(ref_deltas) == ref_text == detok.text
        assert not any(s in detok.text for s in stop)
        stopped += detok.stopped
    assert stopped > 100  # the stop paths were exercised


def test_special_tokens_are_skipped_or_kept(tok: Any) -> None:
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    ids = tok.encode("日本")
    with_special = [ids[0], im_end, *ids[1:], im_end]  # a special token inside a split character
    detok = Detokenizer(tok)
    assert "".join(detokenize(detok, [[t] for t in with_special])) == "日本"
    kept = Detokenizer(tok, skip_special_tokens=False)
    text = "".join(detokenize(kept, [[t] for t in with_special]))
    assert text == tok.decode(with_special, skip_special_tokens=False) and text.endswith("<|im_end|>")


def test_incomplete_character_is_held_until_complete_or_final(tok: Any) -> None:
    ids = tok.encode("a😀")
    assert len(ids) > 2  # the emoji is split over several tokens
    detok = Detokenizer(tok)
    assert detok.push(ids[:1]) == "a"
    for t in ids[1:-1]:
        assert detok.push([t]) == ""
    assert detok.push(ids[-1:]) == "😀"
    cut = Detokenizer(tok)
    assert cut.push(ids[:-1]) == "a"
    assert (
        cut.push([], final=True) == "\ufffd"
    )  # a final flush gives what a full decode gives  # a final flush gives what a full decode gives
    assert cut.push(ids[-1:]) == ""  # nothing after the end


def test_stop_string_split_across_tokens_and_held_back(tok: Any) -> None:
    ids = tok.encode("hello STOP and more")
    detok = Detokenizer(tok, ("STOP",))
    out = [detok.push([t]) for t in ids]
    assert "".join(out) == "hello " and detok.stopped and detok.text == "hello "
    assert not any("S" in d for d in out)  # the possible beginning was never released
    assert detok.push(tok.encode(" more")) == "" and detok.push([], final=True) == ""


def test_stop_string_hit_exactly_at_the_end(tok: Any) -> None:
    for final in (False, True):
        detok = Detokenizer(tok, ("日本",))
        ids = tok.encode("a 日本")
        text = "".join(detok.push([t], final=final and i == len(ids) - 1) for i, t in enumerate(ids))
        assert text == "a " and detok.stopped


def test_earliest_stop_string_wins(tok: Any) -> None:
    detok = Detokenizer(tok, ("b", "a"))
    assert detok.push(tok.encode("xxab"), final=True) == "xx"


def test_stop_ending_in_a_split_character_never_releases_what_it_cuts(tok: Any) -> None:
    """Regression: a stop string whose last character was still U+FFFD had its first character
    released already, so the streamed text held one character the final text did not."""
    ids = tok.encode("xa日")
    pushes = [[t] for t in ids]
    ref_deltas, ref_text = reference(tok, pushes, ("a日",))
    assert "".join(ref_deltas) == ref_text == "x"
    assert "".join(detokenize(Detokenizer(tok, ("a日",)), pushes)) == "x"


def test_reference_holds_back_possible_stop_prefix() -> None:
    inc = IncrementalText(("STOP",))
    assert inc.update("hello S") == "hell"
    assert inc.update("hello ST") == "o"
    assert inc.update("hello STOP and more") == " "
    assert inc.stopped and inc.text == "hello "
    plain = IncrementalText()
    assert plain.update("ab") == "ab" and plain.update("abc\ufffd") == "c"
    assert plain.update("abcé", final=True) == "é"


def test_reference_earliest_stop_string_wins() -> None:
    inc = IncrementalText(("b", "a"))
    inc.update("xxab", final=True)
    assert inc.text == "xx"


# --------------------------------------------------------------------------- bounded work


class CountingTokenizer:
    """Records how many ids every decode call is given."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.all_special_ids = tok.all_special_ids
        self.calls: list[int] = []

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.calls.append(len(ids))
        return str(self.tok.decode(ids, **kwargs))


@pytest.mark.parametrize("kind", ["text", "stray_bytes", "replacement_chars"])
def test_work_per_push_does_not_grow_with_output(tok: Any, kind: str) -> None:
    if kind == "text":
        ids = tok.encode(" ".join([MULTIBYTE, "the shape is a circle"] * 200))[:2000]
    elif kind == "stray_bytes":  # continuation bytes without a start: U+FFFD each, forever
        ids = [byte_token(tok, 0x80)] * 2000
    else:  # the character U+FFFD itself, spelled in three byte tokens
        ids = [byte_token(tok, b) for b in "\ufffd".encode()] * 700
    assert len(ids) >= 2000
    counting = CountingTokenizer(tok)
    detok = Detokenizer(counting, ("never appears",))
    out, per_push = [], []
    for t in ids:
        before = len(counting.calls)
        out.append(detok.push([t]))
        per_push.append(len(counting.calls) - before)
    out.append(detok.push([], final=True))
    assert "".join(out) == tok.decode(ids, skip_special_tokens=True)
    assert max(per_push) <= 4
    assert max(counting.calls) <= 12  # ids per decode: a short window, whatever the output length


# --------------------------------------------------------------------------- token text and bytes


def test_token_bytes_join_into_split_characters(tok: Any) -> None:
    ids = tok.encode(MULTIBYTE)
    pieces = [token_text_and_bytes(tok, t) for t in ids]
    assert bytes(b for _, raw in pieces for b in raw) == MULTIBYTE.encode()
    assert any(text == "\ufffd" for text, _ in pieces)  # half a character shows as U+FFFD
    for t, (text, raw) in zip(ids, pieces, strict=True):
        assert text == tok.decode([t])
        assert 1 <= len(raw) <= 4


def test_token_text_and_bytes_for_whole_vocabulary(tok: Any) -> None:
    for t in range(len(tok)):
        text, raw = token_text_and_bytes(tok, t)
        assert text == tok.decode([t]) and bytes(raw).decode("utf-8", errors="replace") == text
    assert token_text_and_bytes(tok, tok.convert_tokens_to_ids("Ġthe")) == (" the", list(b" the"))
    assert token_text_and_bytes(tok, byte_token(tok, 0xE6)) == ("\ufffd", [0xE6])
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert token_text_and_bytes(tok, im_end) == ("<|im_end|>", list(b"<|im_end|>"))


def test_byte_alphabet_is_gpt2s() -> None:
    assert sorted(BYTE_OF_CHAR.values()) == list(range(256))
    assert BYTE_OF_CHAR["Ġ"] == 0x20 and BYTE_OF_CHAR["A"] == 0x41 and BYTE_OF_CHAR["Ā"] == 0x00
