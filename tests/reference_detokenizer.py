"""The detokenizer's reference semantics, for tests: text decoded from *all* output ids each step,
released up to where it can no longer change (held back: a possible stop-string start, an
incomplete UTF-8 tail). ``Detokenizer`` must release exactly the same text in bounded work."""

from __future__ import annotations

from dataclasses import dataclass, field

from epdserve.engine.detokenizer import REPLACEMENT, stop_hold


@dataclass
class IncrementalText:
    """The reference semantics: fed the decoding of *all* output ids at every step."""

    stop: tuple[str, ...] = ()
    text: str = ""  # full decoded text so far (stop string excluded once hit)
    sent: int = 0  # characters already released
    stopped: bool = False
    _hold: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._hold = stop_hold(self.stop)

    def update(self, decoded: str, final: bool = False) -> str:
        """Feed the decoding of all output ids; returns the newly releasable text."""
        if self.stopped:
            return ""
        # a new match ends in a new character or in the last one (it may have been U+FFFD)
        search_from = max(0, len(self.text) - self._hold - 1)
        self.text = decoded
        hits = [j for s in self.stop if (j := decoded.find(s, search_from)) != -1]
        if hits:
            self.text = decoded[: min(hits)]
            self.stopped = True
        end = len(self.text)
        if not (final or self.stopped):
            # a trailing U+FFFD may still change, and a stop string may begin up to hold
            # characters before it
            end -= self._hold + self.text.endswith(REPLACEMENT)
        if end <= self.sent:
            return ""
        delta = self.text[self.sent : end]
        self.sent = end
        return delta
