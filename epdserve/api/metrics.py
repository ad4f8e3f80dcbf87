"""Prometheus text-format metrics without a client library: counters, gauges, histograms."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        acc = 0
        for b, c in zip(self.buckets, self.counts, strict=False):
            acc += c
            lines.append(f'{self.name}_bucket{{le="{b}"}} {acc}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines += [f"{self.name}_sum {self.sum}", f"{self.name}_count {self.count}"]
        return lines


class Metrics:
    """One registry per process role; gauges are read through callbacks at scrape time."""

    def __init__(self, prefix: str = "epd_") -> None:
        self.prefix = prefix
        self.counters: dict[tuple[str, str], float] = {}
        self.help: dict[str, str] = {}
        self.gauges: dict[str, tuple[str, Callable[[], float]]] = {}
        self.histograms: dict[str, Histogram] = {}

    def inc(self, name: str, value: float = 1.0, labels: str = "", help_text: str = "") -> None:
        key = (self.prefix + name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + value
        self.help.setdefault(self.prefix + name, help_text or name)

    def gauge(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        self.gauges[self.prefix + name] = (help_text, read)

    def histogram(self, name: str, help_text: str) -> Histogram:
        full = self.prefix + name
        if full not in self.histograms:
            self.histograms[full] = Histogram(full, help_text)
        return self.histograms[full]

    def render(self) -> str:
        lines: list[str] = []
        seen: set[str] = set()
        for (name, labels), v in sorted(self.counters.items()):
            if name not in seen:
                lines += [f"# HELP {name} {self.help[name]}", f"# TYPE {name} counter"]
                seen.add(name)
            lines.append(f"{name}{{{labels}}} {v}" if labels else f"{name} {v}")
        for name, (h, read) in sorted(self.gauges.items()):
            lines += [f"# HELP {name} {h}", f"# TYPE {name} gauge", f"{name} {read()}"]
        for hist in self.histograms.values():
            lines += hist.render()
        return "\n".join(lines) + "\n"
