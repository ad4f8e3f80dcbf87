"""Observability: every role's metrics through prometheus-client, the router's federated view of
its workers (one scrape target), the Grafana dashboard's queries naming exported metrics, and
per-request stage timing through router → encoder → connector → PD, returned when asked."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from epdserve.api.timing import parse_server_timing, server_timing
from epdserve.up import Deployment, Topology
from tests.server_utils import http, internal_headers, signed_headers
from tests.test_topologies import request_set

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "epdserve.json"
PROMQL_WORDS = {"sum", "by", "rate", "histogram_quantile", "le", "max", "min", "avg", "increase"}


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    d = Deployment(Topology.parse("1e+1pd"), None, port=0, extra_pd_args=["--max-model-len", "1024"])
    d.start()
    try:
        yield d
    finally:
        d.stop()


def chat(url: str, req: dict, stream: bool, timing: bool, operator: bool = True) -> tuple[int, dict[str, str], bytes]:
    """``operator``: with the cluster credential (only the operator sees how media was obtained)."""
    body = {"model": "shapes-qwen2vl", "max_tokens": 8, **{k: v for k, v in req.items() if k != "stream"}}
    body["stream"] = stream
    data = json.dumps(body).encode()
    target = url + "/v1/chat/completions"
    headers = {"X-EPD-Timing": "1", **(signed_headers("POST", target, data) if operator else {})} if timing else {}
    import urllib.request

    r = urllib.request.Request(target, data=data, headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(r, timeout=120) as resp:
        return resp.status, dict(resp.headers), resp.read()


def scrape(url: str, operator: bool = True) -> dict[str, list]:
    """Sample name -> samples of a /metrics exposition (which must parse); ``operator``: with the
    cluster credential (the router adds its workers' metrics only for the operator)."""
    status, raw = http("GET", url + "/metrics", headers=internal_headers() if operator else None)
    assert status == 200
    out: dict[str, list] = {}
    for fam in text_string_to_metric_families(raw.decode()):
        for s in fam.samples:
            out.setdefault(s.name, []).append(s)
    return out


def test_an_access_line_is_written_after_the_handler_returns(caplog: pytest.LogCaptureFixture) -> None:
    """In a role's event loop the access line waits for the loop's next turn (the answer is on
    its way by then); outside one it is written at once. Either way every field is in it."""
    import asyncio

    from epdserve.api import logs

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "epdserve.access"]

    async def handler() -> list[str]:
        logs.access(id="r1", status=200, e2e_ms=1.25)
        during = lines()
        await asyncio.sleep(0)
        return during

    with caplog.at_level("INFO", logger="epdserve.access"):
        assert asyncio.run(handler()) == []
        assert lines() == ["id=r1 status=200 e2e_ms=1.2"]
        logs.access(id="r2", status=400, error="bad")
        assert lines()[-1] == "id=r2 status=400 error=bad"


def test_server_timing_round_trips() -> None:
    value = server_timing({"a": 0.0123, "b_c": 1.5}, {"media": "1 computed"})
    assert parse_server_timing(value) == pytest.approx({"a": 0.0123, "b_c": 1.5})
    assert parse_server_timing('x;dur=abc, y;desc="no dur", z ; dur=2') == {"z": 0.002}


def test_stage_timing_is_returned_only_when_asked(deployment: Deployment) -> None:
    req = request_set()[1]  # one image
    _, headers, _ = chat(deployment.url, req, stream=False, timing=False)
    assert "Server-Timing" not in headers
    _, headers, _ = chat(deployment.url, request_set()[2], stream=False, timing=True)  # four new images
    stages = parse_server_timing(headers["Server-Timing"])
    for stage in ("router_encode", "encoder_compute", "encoder_queue", "encoder_put", "pd_preprocess"):
        assert stage in stages, stages
    for stage in ("pd_fetch", "pd_queue", "pd_prefill", "pd_decode"):
        assert stage in stages, stages
    assert all(v >= 0 for v in stages.values())
    assert stages["encoder_compute"] > 0 and stages["pd_prefill"] > 0 and stages["pd_decode"] > 0
    assert 'media;desc="4 computed"' in headers["Server-Timing"]
    # streamed: the stages up to the first token (decode comes after the headers)
    _, headers, body = chat(deployment.url, request_set()[2], stream=True, timing=True)
    stages = parse_server_timing(headers["Server-Timing"])
    assert "pd_prefill" in stages and "pd_decode" not in stages and body.endswith(b"data: [DONE]\n\n")
    assert 'media;desc="4 cache_hit"' in headers["Server-Timing"]


def test_stage_details_that_reveal_other_users_are_for_the_operator_only(deployment: Deployment) -> None:
    """Whether an image came from a cache, the router's directory, or was computed tells who
    sent it before: a public caller gets its request's language-model stages, nothing of media."""
    req = request_set()[1]
    chat(deployment.url, req, stream=False, timing=True)  # cached from now on
    _, headers, _ = chat(deployment.url, req, stream=False, timing=True, operator=False)
    value = headers["Server-Timing"]
    stages = parse_server_timing(value)
    assert "pd_prefill" in stages and "media" not in value, value
    assert not any(s.startswith(("router_", "encoder_")) for s in stages), value
    _, headers, _ = chat(deployment.url, req, stream=False, timing=True)  # the operator sees them
    assert "media;desc=" in headers["Server-Timing"] and "router_encode" in headers["Server-Timing"]


def test_the_router_is_one_scrape_target_for_the_deployment(deployment: Deployment) -> None:
    chat(deployment.url, request_set()[0], stream=False, timing=False)  # text only
    samples = scrape(deployment.url)
    enc = next(r.url for r in deployment.roles if r.name.startswith("encoder"))
    pd = next(r.url for r in deployment.roles if r.name.startswith("pd"))
    # the router's own, and each worker's with role and instance labels
    assert any(
        s.labels == {"kind": "text", "status": "200"} and s.value >= 1 for s in samples["epd_router_requests_total"]
    )
    pd_requests = samples["epd_requests_total"]
    assert {s.labels["role"] for s in pd_requests} == {"pd"} and {s.labels["instance"] for s in pd_requests} == {pd}
    assert any(s.labels["kind"] == "image" and s.value >= 1 for s in pd_requests)
    assert {s.labels["instance"] for s in samples["epd_encoder_items_total"]} == {enc}
    stages = {s.labels["stage"] for s in samples["epd_request_stage_seconds_count"]}
    assert stages >= {"preprocess", "fetch", "queue", "prefill", "decode"}
    assert 0.0 <= samples["epd_kv_cache_usage_perc"][0].value <= 1.0
    # every role's memory account as it stated it, and what its processes hold now
    for prefix in ("epd_router_", "epd_encoder_", "epd_"):
        totals = [s.value for s in samples[f"{prefix}memory_planned_bytes"] if s.labels["part"] == "total"]
        assert len(totals) == 1 and totals[0] > 0
        assert [s.value > 0 for s in samples[f"{prefix}memory_resident_bytes"]] == [True]
    # a worker's own /metrics: prometheus-client's exposition, vLLM's names
    own = scrape(pd)
    for name in ("epd_num_requests_running", "epd_time_to_first_token_seconds_bucket", "epd_prefix_cache_hits_total"):
        assert name in own
    assert own["epd_kv_cache_touched_bytes"][0].value > 0  # the request's blocks, in every layer
    # anyone else gets the router's own metrics: no worker's, so no internal address
    public = scrape(deployment.url, operator=False)
    assert "epd_router_requests_total" in public and "epd_requests_total" not in public
    assert pd not in http("GET", deployment.url + "/metrics")[1].decode()


def test_every_dashboard_query_names_an_exported_metric(deployment: Deployment) -> None:
    exported = set(scrape(deployment.url))
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    assert len(queries) >= 20
    for q in queries:
        names = {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", q) if w.startswith("epd_")}
        assert names, f"a panel queries no epdserve metric: {q}"
        missing = names - exported
        assert not missing, f"{q} names {missing}, not exported"
    assert {w for q in queries for w in re.findall(r"\b([a-z_]+)\(", q)} <= PROMQL_WORDS


def test_access_lines_stats_lines_and_json_logs(tmp_path: Path) -> None:
    """``--log-format json``: every role writes one JSON object per line; one access line per
    request on the router and on each worker, all carrying the request's id; stats lines while
    there is traffic; start and stop lines saying where each role listens."""
    d = Deployment(
        Topology.parse("1e+1pd"),
        None,
        port=0,
        log_dir=tmp_path,
        extra_args=["--log-format", "json", "--log-stats-interval", "0.5"],
    )
    d.start()
    try:
        import time
        import urllib.request

        body = {"model": "shapes-qwen2vl", "max_tokens": 8, "temperature": 0, **request_set()[1]}
        r = urllib.request.Request(
            d.url + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": "req-42"},
        )
        usage = json.loads(urllib.request.urlopen(r, timeout=120).read())["usage"]
        bad = urllib.request.Request(
            d.url + "/v1/chat/completions",
            data=json.dumps({**body, "temperature": -1}).encode(),
            headers={"Content-Type": "application/json", "X-Request-Id": "req-43"},
        )
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(bad, timeout=120)
        time.sleep(1.2)  # a stats line
        urls = {r.name: r.url for r in d.roles}
    finally:
        d.stop()
    lines = {name: [json.loads(x) for x in (tmp_path / f"{name}.log").read_text().splitlines() if x.startswith("{")]
             for name in ("router", "encoder0", "pd0")}  # fmt: skip
    for name, records in lines.items():
        access = [r for r in records if r["logger"] == "epdserve.access"]
        assert [r["id"] for r in access if r["id"].startswith("req-")][:1] == ["req-42"], name
        assert any(r["logger"] == "epdserve.stats" for r in records), name
        port = urls[name].rsplit(":", 1)[1]
        assert any(port in r["message"] and "stopping" in r["message"] for r in records), name
    router = [r for r in lines["router"] if r["logger"] == "epdserve.access"]
    assert {(r["id"], r["status"]) for r in router} == {("req-42", 200), ("req-43", 400)}
    ok = next(r for r in router if r["id"] == "req-42")
    assert ok["kind"] == "image" and ok["media"] == "1 computed" and ok["ran_on"] == urls["pd0"]
    pd = next(r for r in lines["pd0"] if r["logger"] == "epdserve.access")
    assert pd["output_tokens"] == usage["completion_tokens"] and pd["prompt_tokens"] == usage["prompt_tokens"]
    assert pd["prompt_tokens"] > 0 and pd["ttft_ms"] <= pd["e2e_ms"]
    assert any(urls["encoder0"] in r["message"] and urls["pd0"] in r["message"] for r in lines["router"])


def test_the_router_answers_completions_and_version(deployment: Deployment) -> None:
    """Through the router: ``/v1/completions`` (streamed and not, by the official client) answers
    as the worker does, ``model`` may be left out, and ``/version`` exists on every role."""
    import openai

    client = openai.OpenAI(base_url=deployment.url + "/v1", api_key="none", max_retries=0, timeout=120)
    pd = next(r.url for r in deployment.roles if r.name.startswith("pd"))
    prompt = "<|im_start|>user\nWhat shapes are there?<|im_end|>\n<|im_start|>assistant\n"
    r = client.completions.create(model="shapes-qwen2vl", prompt=prompt, max_tokens=10, temperature=0)
    status, direct = http(
        "POST",
        pd + "/v1/completions",
        json.dumps({"prompt": prompt, "max_tokens": 10, "temperature": 0}).encode(),
        headers=internal_headers(),
    )
    assert status == 200 and r.choices[0].text == json.loads(direct)["choices"][0]["text"]
    streamed = client.completions.create(
        model="shapes-qwen2vl", prompt=prompt, max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == r.choices[0].text
    status, raw = http("POST", deployment.url + "/v1/completions", json.dumps({"prompt": prompt}).encode())
    assert status == 200 and json.loads(raw)["model"] == "shapes-qwen2vl"
    for role in deployment.roles:
        assert http("GET", role.url + "/version")[0] == 200


def test_one_trace_across_the_roles(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--otlp-traces-endpoint``: router, encoder and worker export to a real OTLP/HTTP receiver;
    a request is one trace under the client's own span, each role's server span under the
    router's client span that called it, the worker's stages under its server span."""
    pytest.importorskip("opentelemetry.sdk", reason="pip install 'epdserve[tracing]'", exc_type=ImportError)
    import time
    import urllib.request

    from tests.otlp_collector import otlp_collector

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # export within 0.1 s
    with otlp_collector() as collector:
        d = Deployment(Topology.parse("1e+1pd"), None, port=0, extra_args=["--otlp-traces-endpoint", collector.url])
        d.start()
        try:
            trace_id, client_span = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
            body = {"model": "shapes-qwen2vl", "max_tokens": 8, "temperature": 0, **request_set()[1]}
            r = urllib.request.Request(
                d.url + "/v1/chat/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "traceparent": f"00-{trace_id}-{client_span}-01"},
            )
            urllib.request.urlopen(r, timeout=120).read()
            deadline = time.monotonic() + 10
            while len({s.service for s in collector.spans if s.trace_id == trace_id}) < 3:
                assert time.monotonic() < deadline, collector.spans
                time.sleep(0.1)
            time.sleep(0.3)  # the last batches
        finally:
            d.stop()
    spans = [s for s in collector.spans if s.trace_id == trace_id]
    by = {(s.service, s.name): s for s in spans}
    router = next(s for s in spans if s.service == "epdserve-router" and s.kind == 2)  # SERVER
    assert router.name == "POST /v1/chat/completions" and router.parent_id == client_span
    assert router.attributes["http.status_code"] == 200 and router.attributes["epd.kind"] == "image"
    encode_call = by[("epdserve-router", "POST /v1/encode")]
    worker_call = next(
        s for s in spans if s.service == "epdserve-router" and s.kind == 3 and s.name != "POST /v1/encode"
    )
    assert encode_call.parent_id == router.span_id and worker_call.parent_id == router.span_id
    encoder = by[("epdserve-encoder", "POST /v1/encode")]
    assert encoder.parent_id == encode_call.span_id and encoder.attributes["epd.computed"] == 1
    pd = by[("epdserve-pd", "POST /v1/chat/completions")]
    assert (
        pd.parent_id == worker_call.span_id and pd.attributes["epd.request_id"] == router.attributes["epd.request_id"]
    )
    stages = {s.name: s for s in spans if s.service == "epdserve-pd" and s.parent_id == pd.span_id}
    assert set(stages) == {"preprocess", "fetch", "queue", "prefill", "decode"}
    assert stages["preprocess"].start_ns <= stages["prefill"].start_ns <= stages["decode"].start_ns
    assert router.start_ns <= encode_call.start_ns <= worker_call.start_ns <= router.end_ns
