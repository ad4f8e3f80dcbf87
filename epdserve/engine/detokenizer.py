"""Incremental detokenization with stop strings, and each token's text and bytes for logprobs.

``Detokenizer`` turns a request's output token ids into text deltas with work per token that does
not grow with the output: it decodes only a short window of recent ids (vLLM's prefix/read
offsets) and searches for stop strings only in the tail that could hold a new match.
``tests/reference_detokenizer.IncrementalText`` states the same semantics over a full decode of every step; it is the
reference the detokenizer is tested against.

Semantics, for both: the text is the decode of all output ids; once a stop string appears in it,
the text ends where the earliest one begins and nothing after it is ever released. Text is
released once it can no longer change: held back are an incomplete UTF-8 character at the end
(decoded as U+FFFD) and the last ``max(len(stop)) - 1`` characters before whatever may still
change, where a stop string could begin. ``final`` releases everything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, Final

REPLACEMENT: Final = "\ufffd"  # what decoding gives for an incomplete or invalid UTF-8 sequence
# An incomplete UTF-8 character has at most 3 bytes, so it lies within the last 3 tokens (each has
# at least one byte); a boundary further back is decided for good.
_MAX_INCOMPLETE_TOKENS: Final = 3


def stop_hold(stop: tuple[str, ...]) -> int:
    """Characters that may begin a stop string not yet complete."""
    return max((len(s) for s in stop), default=1) - 1


class Detokenizer:
    """One request's output ids to text deltas, in bounded work per token.

    Token layer: the ids decode to *settled* text ``S`` (it can no longer change) followed by
    *pending* text ``P`` (``S + P`` is the decode of all ids). Only a window is ever decoded::

        ids   ....... settled ....... | prefix ..... read | ..... pending ..... |
                                      └ decoded again as  └ decoded, ends in an
                                        context             incomplete character

    ``read`` stays on a boundary where the decode splits: decode(ids) == decode(ids[:read]) +
    decode(ids[read:]). It moves to the end when the window's text does not end in U+FFFD (after
    a complete character the UTF-8 decoder starts afresh), or, when the pending tail grows past an
    incomplete character (a run of invalid bytes), to a cut the decode splits at.

    Text layer: stop strings are searched in the tail of ``S + P`` that could hold a new match,
    and released text stops ``hold`` characters short of the end of ``S``. The concatenation of
    all deltas is what ``IncrementalText`` gives when fed the full decode after every push.
    """

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._special = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._stop = stop
        self._hold = stop_hold(stop)
        # token layer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0
        # text layer; offsets count characters of the text
        self._released: list[str] = []
        self._sent = 0  # characters released
        self._settled_len = 0  # len(S)
        self._recent = ""  # S[_recent_at:]: what release and the next stop search read
        self._recent_at = 0
        self._pending = ""  # P
        self._searched_len = 0  # len(S + P) at the last search
        self._stopped = False
        self._finished = False

    @property
    def stopped(self) -> bool:
        """A stop string was found; the text ends before it and later pushes return nothing."""
        return self._stopped

    @property
    def text(self) -> str:
        """The full text so far (released, held back and pending), ending before a stop string."""
        return "".join(self._released) + self._recent[self._sent - self._recent_at :] + self._pending

    def push(self, token_ids: Sequence[int], final: bool = False) -> str:
        """Append new output ids; returns the text that became releasable. ``final`` flushes
        everything held back and ends the text (later pushes return nothing)."""
        if self._stopped or self._finished:
            return ""
        self._finished = final
        self._ids.extend(t for t in token_ids if t not in self._special)
        settled, self._pending = self._settle(final)
        self._recent += settled
        self._settled_len += len(settled)
        self._search_stop()
        end = self._settled_len
        if not (final or self._stopped):
            end -= self._hold
        delta = ""
        if end > self._sent:
            delta = self._recent[self._sent - self._recent_at : end - self._recent_at]
            self._released.append(delta)
            self._sent = end
        # keep what the next release and the next search read: from the first unreleased
        # character, or one before the last `hold` characters of S + P
        keep_from = min(self._sent, max(0, self._searched_len - self._hold - 1))
        if keep_from > self._recent_at:
            self._recent = self._recent[keep_from - self._recent_at :]
            self._recent_at = keep_from
        return delta

    # ------------------------------------------------------------------ token layer

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens))

    def _settle(self, final: bool) -> tuple[str, str]:
        """Decode the window: (text newly settled, pending text after it)."""
        ids, prefix, read = self._ids, self._prefix, self._read
        if read == len(ids):
            return "", ""
        prefix_text = self._decode(ids[prefix:read])
        new_text = self._decode(ids[prefix:])
        if final or not new_text.endswith(REPLACEMENT):
            self._prefix, self._read = read, len(ids)
            return new_text[len(prefix_text) :], ""
        cut = len(ids) - _MAX_INCOMPLETE_TOKENS
        if cut > read:
            # With an incomplete character behind the cut, the bytes after it either complete it
            # (the decode then does not split there) or end it as invalid for good.
            left, right = self._decode(ids[prefix:cut]), self._decode(ids[cut:])
            if right and left + right == new_text:
                self._prefix, self._read = read, cut
                return left[len(prefix_text) :], right
        return "", new_text[len(prefix_text) :]

    # ------------------------------------------------------------------ text layer

    def _search_stop(self) -> None:
        """Find a stop string that is new in S + P; if there is one, the text ends before it."""
        full_len = self._settled_len + len(self._pending)
        # as in IncrementalText: a new match ends in a new character or in the last one
        search_from = max(self._recent_at, self._searched_len - self._hold - 1)
        self._searched_len = full_len
        if not self._stop:
            return
        known = self._recent + self._pending  # S + P from _recent_at on
        hits = [j for s in self._stop if (j := known.find(s, search_from - self._recent_at)) != -1]
        if not hits:
            return
        end = self._recent_at + min(hits)
        self._recent = known[: end - self._recent_at]
        self._settled_len = self._searched_len = end
        self._pending = ""
        self._stopped = True


# --------------------------------------------------------------------------- token bytes


def _byte_of_char() -> Mapping[str, int]:
    """GPT-2's byte-level alphabet, inverted: byte-level BPE vocabularies spell each byte as one
    printable character (printable Latin-1 as itself, the other 68 bytes as U+0100 onwards)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    others = [b for b in range(256) if b not in chars]
    chars.update({b: chr(256 + n) for n, b in enumerate(others)})
    return MappingProxyType({c: b for b, c in chars.items()})


BYTE_OF_CHAR: Final = _byte_of_char()


def token_text_and_bytes(tokenizer: Any, token_id: int) -> tuple[str, list[int]]:
    """A token's display text and its raw UTF-8 bytes, as OpenAI's logprobs ``token`` and
    ``bytes``. The text is the token decoded alone (as vLLM gives it: U+FFFD for part of a
    character); the bytes are the token's own, so the bytes of the tokens that split a character
    join into it. Special tokens give their content. Not cached: callers cache per token id."""
    text = str(tokenizer.decode([token_id]))
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        # a byte-level piece spells its bytes; other vocabularies (an added token with text
        # outside the alphabet, SentencePiece pieces) fail the check below and keep their text
        if all(c in BYTE_OF_CHAR for c in piece):
            raw = bytes(BYTE_OF_CHAR[c] for c in piece)
            if raw.decode("utf-8", errors="replace") == text:
                return text, list(raw)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            try:
                return text, [int(piece[3:5], 16)]
            except ValueError:
                pass
    return text, list(text.encode("utf-8"))
