"""Incremental detokenization with stop strings.

Text is decoded from all output ids each step (outputs are short next to the cost of a step) and
released up to the point where it can no longer change: an incomplete UTF-8 sequence or a
possible beginning of a stop string is held back.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class IncrementalText:
    stop: tuple[str, ...] = ()
    text: str = ""  # full decoded text so far (stop string excluded once hit)
    sent: int = 0  # characters already released
    stopped: bool = False
    _hold: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._hold = max((len(s) for s in self.stop), default=1) - 1

    def update(self, decoded: str, final: bool = False) -> str:
        """Feed the decoding of all output ids; returns the newly releasable text."""
        if self.stopped:
            return ""
        search_from = max(0, len(self.text) - self._hold - 1)
        self.text = decoded
        hits = [j for s in self.stop if (j := decoded.find(s, search_from)) != -1]
        if hits:
            self.text = decoded[: min(hits)]
            self.stopped = True
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._hold
            if self.text.endswith("\ufffd"):
                end = min(end, len(self.text) - 1)
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
