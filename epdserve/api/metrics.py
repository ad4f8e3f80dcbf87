"""Each role's metrics, on ``prometheus-client``: one registry per role instance, names prefixed
``epd_`` and, where vLLM has the same quantity, named as vLLM names it (``epd_num_requests_running``
for ``vllm:num_requests_running``).

Three kinds: counters (``inc``, labelled or not; declare them with ``counter`` so they are
exported at 0 before the first event), histograms (``histogram``), and values read at scrape time
from the role's own state (``gauge``; ``monotonic=True`` exports a count that only grows, e.g. one
kept by the engine core, as a counter).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import prometheus_client
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from epdserve.api.errors import Unauthorized
from epdserve.api.exposure import health_metric

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# ``<name>_created`` series double every counter and histogram and nothing here reads them
prometheus_client.disable_created_metrics()


class _Reads(Collector):
    """The values read at scrape time."""

    def __init__(self) -> None:
        self.reads: dict[str, tuple[str, bool, Callable[[], float]]] = {}
        self.labelled: dict[str, tuple[str, str, bool, Callable[[], Mapping[str, float]]]] = {}

    def collect(self) -> Iterator[Metric]:
        for name, (help_text, monotonic, read) in self.reads.items():
            if monotonic:
                yield CounterMetricFamily(name.removesuffix("_total"), help_text, value=read())
            else:
                yield GaugeMetricFamily(name, help_text, value=read())
        for name, (help_text, label, monotonic, read_all) in self.labelled.items():
            family: CounterMetricFamily | GaugeMetricFamily = (
                CounterMetricFamily(name.removesuffix("_total"), help_text, labels=(label,))
                if monotonic
                else GaugeMetricFamily(name, help_text, labels=(label,))
            )
            for value, count in read_all().items():
                family.add_metric((value,), count)
            yield family


MAX_CACHED_CHILDREN = 4096  # labelled counters ``Metrics.inc`` keeps at hand


class Metrics:
    def __init__(self, prefix: str = "epd_") -> None:
        self.prefix = prefix
        self.registry = CollectorRegistry(auto_describe=False)
        self._counters: dict[str, Counter] = {}
        self._children: dict[object, Counter] = {}  # (name, *label items) -> the labelled counter
        self._histograms: dict[str, Histogram] = {}
        self._reads = _Reads()
        self.registry.register(self._reads)

    def counter(self, name: str, help_text: str, labels: Sequence[str] = ()) -> Counter:
        """The counter ``name`` (made on first use; without labels it is exported at 0 from now)."""
        full = self.prefix + name
        c = self._counters.get(full)
        if c is None:
            c = self._counters[full] = Counter(
                full, help_text or name, labelnames=tuple(labels), registry=self.registry
            )
        return c

    def inc(self, name: str, value: float = 1.0, labels: Mapping[str, str] | None = None, help_text: str = "") -> None:
        key = (name, *labels.items()) if labels else name
        child = self._children.get(key)
        if child is None:
            c = self.counter(name, help_text, tuple(labels or ()))
            child = c.labels(**labels) if labels else c
            if len(self._children) < MAX_CACHED_CHILDREN:  # label values are few; never unbounded
                self._children[key] = child
        child.inc(value)

    def gauge(self, name: str, help_text: str, read: Callable[[], float], monotonic: bool = False) -> None:
        self._reads.reads[self.prefix + name] = (help_text, monotonic, read)

    def counts(
        self, name: str, help_text: str, label: str, read: Callable[[], Mapping[str, float]], monotonic: bool = True
    ) -> None:
        """Values kept elsewhere (e.g. counts of the engine core), by one label, read at scrape
        time; a counter, or a gauge (``monotonic=False``)."""
        self._reads.labelled[self.prefix + name] = (help_text, label, monotonic, read)

    def histogram(
        self,
        name: str,
        help_text: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        full = self.prefix + name
        h = self._histograms.get(full)
        if h is None:
            h = self._histograms[full] = Histogram(
                full, help_text, labelnames=tuple(labels), buckets=tuple(buckets), registry=self.registry
            )
        return h

    def render(self, only: Callable[[str], bool] | None = None) -> bytes:
        """The exposition; ``only``: of the families whose name (without the prefix) it keeps."""
        if only is None:
            return prometheus_client.generate_latest(self.registry)
        kept = [f for f in self.registry.collect() if only(f.name.removeprefix(self.prefix))]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(kept))
        return prometheus_client.generate_latest(registry)


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def federate(scrapes: Sequence[tuple[str, str, str]]) -> bytes:
    """Workers' expositions as one: each ``(role, instance, text)``'s samples get ``role`` and
    ``instance`` labels, and families of one name are merged across workers. A worker whose text
    does not parse is left out (its families would be partial)."""
    merged: dict[str, Metric] = {}
    for role, instance, text in scrapes:
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        for fam in families:
            into = merged.get(fam.name)
            if into is None:
                into = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            elif into.type != fam.type:
                continue  # workers of another version disagree on a family: keep the first
            for s in fam.samples:
                into.add_sample(s.name, {**s.labels, "role": role, "instance": instance}, s.value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(merged.values())))
    return prometheus_client.generate_latest(registry)


def public_metrics(metrics: Metrics, level: str) -> web.Response:
    """``/metrics`` for a caller without credentials, at ``level`` (``ExposureConfig.metrics_level``)."""
    if level == "none":
        raise Unauthorized("Metrics need the admin key or the cluster credential on this instance.")
    body = metrics.render(health_metric if level == "health" else None)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
