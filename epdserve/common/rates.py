"""How long a unit of work takes, as it is measured now and then."""

from __future__ import annotations


class CostRate:
    """Seconds per unit of work, from a pair of ever-growing totals (seconds, units) sampled now
    and then: an exponential average over the intervals that did work, so it follows the current
    conditions (contention, batch sizes) rather than the whole lifetime."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self.value = 0.0  # 0 until an interval with work was seen
        self._last: tuple[float, float] | None = None

    def update(self, seconds: float, units: float) -> float:
        last, self._last = self._last, (seconds, units)
        if last is not None:
            self.add(seconds - last[0], units - last[1])
        return self.value

    def add(self, seconds: float, units: float) -> float:
        """One interval's work, measured directly: ``seconds`` for ``units`` (none: no change)."""
        if units > 0 and seconds >= 0:
            rate = seconds / units
            self.value = rate if not self.value else (1 - self.weight) * self.value + self.weight * rate
        return self.value
