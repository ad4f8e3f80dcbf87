"""OpenAI ``logprobs`` entries from the engine's (token id, logprob, top logprobs)."""

from __future__ import annotations

from functools import lru_cache

from epdserve.api.responses import TokenLogprob, TopLogprob
from epdserve.engine.detokenizer import token_text_and_bytes


class TokenTexts:
    """Each token's display text and UTF-8 bytes, computed once per token id."""

    def __init__(self, tokenizer, cache_size: int = 1 << 16) -> None:
        self._of = lru_cache(maxsize=cache_size)(lambda tid: token_text_and_bytes(tokenizer, tid))

    def logprob(self, token_id: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
        text, raw = self._of(token_id)
        tops = []
        for tid, lp in top:
            t, b = self._of(tid)
            tops.append(TopLogprob(token=t, logprob=lp, bytes=b))
        return TokenLogprob(token=text, logprob=logprob, bytes=raw, top_logprobs=tops)
