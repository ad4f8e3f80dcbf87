"""Benchmark runs and their results as numbers and files: the run's config, summaries, SLO goodput,
a text table, JSON and plots.

A ``Summary`` condenses a list of ``RequestResult``: latency statistics (TTFT, TPOT, ITL, E2E),
request and token throughput, error counts by status, and goodput under an ``SLO``. ITL statistics
pool every inter-token gap of every successful request; TPOT statistics are per request.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from epdserve.bench.client import RequestResult, percentile, server_url
from epdserve.bench.plots import pyplot
from epdserve.bench.workload import WorkloadConfig

_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


def parse_duration(text: str) -> float:
    """Seconds of ``"500ms"``, ``"2s"``, ``"150us"``; a bare number is milliseconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s)?\s*", text)
    if m is None:
        raise ValueError(f"not a duration: {text!r} (use e.g. 500ms, 2s, 150us)")
    return float(m.group(1)) * _UNITS[m.group(2) or "ms"]


@dataclass(frozen=True)
class SLO:
    """Per-request latency bounds in seconds; a request meets the SLO when it succeeded within every given bound."""

    ttft: float | None = None  # time to first token
    tpot: float | None = None  # mean time per output token after the first
    itl: float | None = None  # the request's longest inter-token gap (its max ITL), so every gap is within it
    e2e: float | None = None  # end-to-end latency

    @classmethod
    def parse(cls, text: str) -> SLO:
        """``"ttft=500ms,itl=100ms,e2e=2s,tpot=50ms"`` (any subset; empty text: no SLO)."""
        bounds: dict[str, float] = {}
        for item in filter(None, (s.strip() for s in text.split(","))):
            name, sep, value = item.partition("=")
            name = name.strip().lower()
            if not sep or name not in SLO_METRICS:
                raise ValueError(f"bad SLO item {item!r}: expected one of {', '.join(SLO_METRICS)} as name=duration")
            bounds[name] = parse_duration(value)
        return cls(**bounds)

    @property
    def given(self) -> dict[str, float]:
        """The bounds that are set."""
        return {k: v for k in SLO_METRICS if (v := getattr(self, k)) is not None}

    def met_by(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        measured = {"ttft": r.ttft, "tpot": r.tpot, "itl": r.max_itl, "e2e": r.e2e}
        return all(measured[k] <= bound for k, bound in self.given.items())

    def __str__(self) -> str:
        return ",".join(f"{k}<={v * 1e3:g}ms" for k, v in self.given.items()) or "none"


@dataclass(frozen=True)
class Stats:
    """Distribution of one latency in seconds."""

    count: int  # number of values
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Stats:
        if not values:
            return cls(0, 0.0, 0.0, 0.0, 0.0, 0.0)
        return cls(
            len(values),
            sum(values) / len(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
            max(values),
        )


@dataclass(frozen=True)
class Summary:
    """What a benchmark run (or one request kind of it) achieved."""

    requests: int  # requests sent
    completed: int  # requests that streamed to the end
    errors: dict[str, int]  # failed requests by HTTP status, "stream" (error event) or "connection"
    duration_s: float  # wall time of the measured phase
    request_throughput: float  # completed requests per second
    input_tokens: int  # prompt tokens of completed requests, from usage
    output_tokens: int  # completion tokens of completed requests, from usage
    input_token_throughput: float  # input tokens per second
    output_token_throughput: float  # output tokens per second
    ttft: Stats  # time to first token, per request
    tpot: Stats  # time per output token after the first, per request with 2+ tokens
    itl: Stats  # every inter-token gap of every request, pooled
    e2e: Stats  # end-to-end latency, per request
    slo_met: int | None  # requests that met every SLO bound (None: no SLO given)
    goodput: float | None  # SLO-meeting requests per second (None: no SLO given)
    stages: dict[str, Stats] = field(default_factory=dict)  # the server's stage timing, per stage


def error_label(r: RequestResult) -> str:
    """How a failed request failed: its HTTP status, "stream" (error event or broken stream) or "connection"."""
    if r.status == 0:
        return "connection"
    return "stream" if r.status == 200 else str(r.status)


def summarize(results: list[RequestResult], duration_s: float, slo: SLO | None = None) -> Summary:
    """Condense ``results`` of a run that took ``duration_s`` seconds; goodput when ``slo`` has bounds."""
    ok = [r for r in results if r.ok]
    errors = Counter(error_label(r) for r in results if not r.ok)
    per_s = 1.0 / duration_s if duration_s > 0 else 0.0
    tokens_in = sum(r.prompt_tokens for r in ok)
    tokens_out = sum(r.output_tokens for r in ok)
    met = sum(slo.met_by(r) for r in ok) if slo is not None and slo.given else None
    return Summary(
        requests=len(results),
        completed=len(ok),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        request_throughput=len(ok) * per_s,
        input_tokens=tokens_in,
        output_tokens=tokens_out,
        input_token_throughput=tokens_in * per_s,
        output_token_throughput=tokens_out * per_s,
        ttft=Stats.of([r.ttft for r in ok]),
        tpot=Stats.of([r.tpot for r in ok if r.output_tokens > 1]),
        itl=Stats.of([g for r in ok for g in r.itl]),
        e2e=Stats.of([r.e2e for r in ok]),
        slo_met=met,
        goodput=None if met is None else met * per_s,
        stages={
            name: Stats.of([r.stages[name] for r in ok if name in r.stages])
            for name in dict.fromkeys(n for r in ok for n in r.stages)
        },
    )


def summarize_by_kind(results: list[RequestResult], duration_s: float, slo: SLO | None = None) -> dict[str, Summary]:
    """One summary per request kind over the same wall time; empty when all requests are of one kind."""
    kinds = sorted({r.kind for r in results})
    if len(kinds) < 2:
        return {}
    return {k: summarize([r for r in results if r.kind == k], duration_s, slo) for k in kinds}


# ---- one run ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """Every knob of one benchmark run; ``run_bench`` needs nothing else."""

    url: str = "http://127.0.0.1:8000"  # base URL of the server (with or without /v1)
    model: str = ""  # model name sent in requests; "" takes the first id of the server's /v1/models
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)  # what each request looks like
    num_requests: int = 100  # measured requests
    warmup: int = 4  # unmeasured requests sent before the clock starts (payloads from seed + 1)
    concurrency: int = 8  # clients of the closed loop; also the warm-up's concurrency
    request_rate: float = 0.0  # mean Poisson arrival rate in req/s (open loop); 0 means closed loop
    seed: int = 0  # fixes payloads and arrival times
    slo: SLO = field(default_factory=SLO)  # latency bounds for goodput (none set: no goodput)
    timeout_s: float = 600.0  # total time allowed per request

    def __post_init__(self) -> None:
        object.__setattr__(self, "url", server_url(self.url))  # one form, whatever was typed
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.request_rate < 0:
            raise ValueError(f"request_rate must be >= 0, got {self.request_rate}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def open_loop(self) -> bool:
        return self.request_rate > 0


@dataclass(frozen=True)
class BenchResult:
    """One measured run: the raw per-request results and what they add up to."""

    config: BenchConfig  # the run's knobs
    model: str  # model name the requests carried
    results: list[RequestResult]  # measured requests in send order
    started: float  # time.perf_counter() at the start of the measured phase
    duration_s: float  # from the start of the measured phase to the last response
    cpu_s: float  # CPU seconds this process spent during the measured phase
    max_send_lag_s: float  # open loop: how late the latest send was against its Poisson schedule
    summary: Summary  # all measured requests
    per_kind: dict[str, Summary]  # one summary per request kind when there are several

    @property
    def cpu_fraction(self) -> float:
        """Client CPU per wall second; near 1.0 the (single-threaded) client is the bottleneck."""
        return self.cpu_s / self.duration_s if self.duration_s > 0 else 0.0


@dataclass(frozen=True)
class SelfTestResult:
    """The configured load against ``TrivialServer``, once with full-length and once with one-token answers."""

    full: BenchResult  # answers of workload.output_len tokens
    one_token: BenchResult  # the same requests answered with one token: the per-request cost alone

    @property
    def cpu_per_request_s(self) -> float:
        """Client CPU per request (sending the body, one event, accounting); includes the trivial server's share."""
        return self.one_token.cpu_s / max(1, self.one_token.summary.completed)

    @property
    def cpu_per_token_s(self) -> float:
        """Client CPU per further streamed token (one SSE event); includes the trivial server's share."""
        extra = self.full.summary.output_tokens - self.one_token.summary.output_tokens
        return max(0.0, self.full.cpu_s - self.one_token.cpu_s) / extra if extra > 0 else 0.0


# ---- text ------------------------------------------------------------------------------------------


def format_summary(s: Summary, slo: SLO | None = None, title: str = "all requests") -> str:
    """A short human-readable block: counts, throughput, goodput and a latency table in ms."""
    errors = ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "none"
    lines = [
        f"--- {title} ---",
        f"requests ok/sent    {s.completed}/{s.requests}   errors: {errors}",
        f"duration            {s.duration_s:.2f} s",
        f"request throughput  {s.request_throughput:.2f} req/s",
        f"token throughput    in {s.input_token_throughput:.1f} tok/s, out {s.output_token_throughput:.1f} tok/s "
        f"({s.input_tokens} in, {s.output_tokens} out)",
    ]
    if s.goodput is not None:
        lines.append(f"goodput             {s.goodput:.2f} req/s ({s.slo_met}/{s.requests} met {slo})")
    lines.append(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for name in LATENCY_METRICS:
        st: Stats = getattr(s, name)
        row = (st.mean, st.p50, st.p90, st.p99, st.max)
        lines.append(f"{name.upper():<6}" + "".join(f"{1e3 * v:>10.2f}" for v in row))
    if s.stages:
        lines.append("where the time went (server's stage timing, ms):")
        width = max(len(n) for n in s.stages) + 2
        lines.append(f"{'':<{width}}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
        for name, st in s.stages.items():
            row = (st.mean, st.p50, st.p90, st.p99, st.max)
            lines.append(f"{name:<{width}}" + "".join(f"{1e3 * v:>10.2f}" for v in row))
    return "\n".join(lines)


def format_result(result: BenchResult) -> str:
    """The whole run: client health, the overall summary, then one block per request kind."""
    c = result.config
    arrival = f"Poisson {c.request_rate:g} req/s" if c.request_rate > 0 else f"concurrency {c.concurrency}"
    head = (
        f"epdserve bench: {c.url} model={result.model} {arrival}, {c.num_requests} requests "
        f"(+{c.warmup} warm-up)\nclient: {result.cpu_s:.2f} s CPU = {100 * result.cpu_fraction:.0f}% of one core"
    )
    if c.request_rate > 0:
        head += f", latest send {1e3 * result.max_send_lag_s:.1f} ms behind schedule"
    if result.cpu_fraction > 0.8:
        head += "\nwarning: the client used most of a core; latencies may include client delay (see --self-test)"
    blocks = [head, format_summary(result.summary, c.slo)]
    blocks += [format_summary(s, c.slo, f"kind {k}") for k, s in result.per_kind.items()]
    return "\n".join(blocks)


# ---- files -----------------------------------------------------------------------------------------


def request_record(r: RequestResult, started: float, slo: SLO) -> dict[str, Any]:
    """Raw timings of one request in seconds; ``start_s`` is relative to the start of the measured phase."""
    return {
        "kind": r.kind,
        "ok": r.ok,
        "status": r.status,
        "error": r.error,
        "start_s": r.start - started,
        "ttft_s": r.ttft,
        "tpot_s": r.tpot,
        "e2e_s": r.e2e,
        "max_itl_s": r.max_itl,
        "itl_s": r.itl,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "slo_met": slo.met_by(r) if slo.given else None,
        "stages_s": r.stages,
    }


def result_json(result: BenchResult) -> dict[str, Any]:
    """Config, summary, per-kind summaries, client overhead and every request's raw timings."""
    return {
        "config": dataclasses.asdict(result.config),
        "model": result.model,
        "summary": dataclasses.asdict(result.summary),
        "per_kind": {k: dataclasses.asdict(s) for k, s in result.per_kind.items()},
        "client": {
            "cpu_s": result.cpu_s,
            "cpu_fraction": result.cpu_fraction,
            "max_send_lag_s": result.max_send_lag_s,
        },
        "requests": [request_record(r, result.started, result.config.slo) for r in result.results],
    }


def write_json(data: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1))
    return path


def metric_values(results: list[RequestResult], metric: str) -> list[float]:
    """Values of one latency metric in seconds over successful requests (ITL: every gap)."""
    ok = [r for r in results if r.ok]
    if metric == "itl":
        return [g for r in ok for g in r.itl]
    if metric == "tpot":
        return [r.tpot for r in ok if r.output_tokens > 1]
    return [getattr(r, metric) for r in ok]


def write_plots(result: BenchResult, directory: Path) -> list[Path]:
    """One PNG per latency metric: histogram and CDF in ms, one line per request kind (and "all")."""
    plt = pyplot()
    directory.mkdir(parents=True, exist_ok=True)
    kinds = sorted({r.kind for r in result.results})
    groups = {"all": result.results} if len(kinds) != 1 else {}
    groups.update({k or "all": [r for r in result.results if r.kind == k] for k in kinds})
    paths = []
    for metric in LATENCY_METRICS:
        fig, (hist, cdf) = plt.subplots(1, 2, figsize=(11, 4))
        for label, rs in groups.items():
            ms = sorted(1e3 * v for v in metric_values(rs, metric))
            if not ms:
                continue
            hist.hist(ms, bins=40, histtype="step", label=f"{label} (n={len(ms)})")
            cdf.step(ms, [(i + 1) / len(ms) for i in range(len(ms))], where="post", label=label)
        hist.set(xlabel=f"{metric.upper()} (ms)", ylabel="count", title=f"{metric.upper()} histogram")
        cdf.set(xlabel=f"{metric.upper()} (ms)", ylabel="fraction ≤ x", title=f"{metric.upper()} CDF", ylim=(0, 1.02))
        for ax in (hist, cdf):
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend()
        fig.tight_layout()
        path = directory / f"{metric}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


# ---- self-test -------------------------------------------------------------------------------------


def format_self_test(st: SelfTestResult) -> str:
    """The client's ceiling: throughput and CPU cost against an instant server, and its latency floor."""
    f, c = st.full, st.full.config
    arrival = f"Poisson {c.request_rate:g} req/s" if c.request_rate > 0 else f"concurrency {c.concurrency}"
    return "\n".join(
        [
            f"self-test: the configured load against an in-process instant server on 127.0.0.1 ({arrival}, "
            f"{c.num_requests} requests, {c.workload.output_len} tokens each)",
            f"client ceiling      {f.summary.request_throughput:.1f} req/s, "
            f"{f.summary.output_token_throughput:.0f} output tok/s ({100 * f.cpu_fraction:.0f}% of one core)",
            f"client CPU          {1e6 * st.cpu_per_request_s:.0f} us per request + "
            f"{1e6 * st.cpu_per_token_s:.1f} us per output token "
            "(upper bound: includes the trivial server, same process)",
            f"latency floor       TTFT p50 {1e3 * f.summary.ttft.p50:.2f} ms, p99 {1e3 * f.summary.ttft.p99:.2f} ms; "
            f"ITL p50 {1e3 * f.summary.itl.p50:.3f} ms, p99 {1e3 * f.summary.itl.p99:.3f} ms",
            format_summary(f.summary, c.slo, "full-length answers"),
        ]
    )


def self_test_json(st: SelfTestResult) -> dict[str, Any]:
    return {
        "self_test": {
            "cpu_per_request_s": st.cpu_per_request_s,
            "cpu_per_token_s": st.cpu_per_token_s,
            "one_token_summary": dataclasses.asdict(st.one_token.summary),
        },
        **result_json(st.full),
    }
