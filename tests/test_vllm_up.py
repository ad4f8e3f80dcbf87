"""``epdserve up --lm-engine vllm`` as an operator runs it: epdserve's encoder and router beside a
real ``vllm serve`` (the installed vLLM, its CPU build), started, supervised and stopped by ``up``.

Runs only where vLLM is importable (``scripts/test_vllm.sh``); elsewhere skipped, saying so.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

import pytest

from epdserve.launcher import free_port, port_available, process_children, process_tree
from epdserve.topology import CorePlan, Topology, plan_cores
from tests.server_utils import http, internal_headers
from tests.test_up import alive, image_content, proc_cmdline, up, wait_for
from tests.test_vllm_connector import VLLM_ARGS, VLLM_ENV

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

START_S = 900.0  # vLLM's start-up on a busy 2-core machine


def greedy(url: str, content: object, max_tokens: int = 24, **extra: object) -> dict:
    body = {"model": "shapes-qwen2vl", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0.0, **extra}  # fmt: skip
    status, raw = http("POST", url + "/v1/chat/completions", json.dumps(body).encode(), timeout=600)
    assert status == 200, raw
    return json.loads(raw)


def samples(text: str, name: str, **labels: str) -> list[float]:
    """The values of ``name``'s samples carrying ``labels`` in an exposition."""
    found = []
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            found.append(float(line.rsplit(" ", 1)[1]))
    return found


def api_server(wrapper: int) -> int:
    """The pid of ``vllm serve`` (its API server), the child of the wrapper ``up`` started."""
    api = [p for p in process_children().get(wrapper, []) if b"\0serve\0" in proc_cmdline(p)]
    assert len(api) == 1, [proc_cmdline(p)[:80] for p in process_tree([wrapper])]
    return api[0]


def assert_placed(wrapper: int, plan: CorePlan) -> None:
    """Pinned, vLLM's engine (all it started) keeps to the engine's cores and its API server moves
    to the front ends' cores, beside the encoder, once it is up."""
    api = api_server(wrapper)
    front, engine = set(plan.roles["pd0"]), set(plan.engines["pd0"])
    assert wait_for(lambda: os.sched_getaffinity(api) == front, 60, 0.2), os.sched_getaffinity(api)
    below = [p for p in process_tree([api]) if p != api]
    assert below and all(os.sched_getaffinity(p) == engine for p in below), [proc_cmdline(p)[:60] for p in below]


def test_up_with_vllm_answers_as_epdserve_s_up_and_leaves_nothing(tmp_path: Path) -> None:
    content = image_content(3)
    for run in ("own", "vllm"):
        (tmp_path / run).mkdir()
    with up(tmp_path / "own", "--topology", "1e+1pd", "--dtype", "float32", "--max-model-len", "2048") as own:
        want = greedy(own.wait_ready(), content)["choices"][0]["message"]["content"]
    secret = tmp_path / "secret"
    secret.write_text(os.environ["EPD_CLUSTER_SECRET"])  # the test's: it signs the scrapes below
    secret.chmod(0o600)
    args = ["--lm-engine", "vllm", "--vllm-args", shlex.join(VLLM_ARGS), "--dtype", "float32", "--pin-cores"]
    plan = plan_cores(Topology.parse("1e+1pd"), sorted(os.sched_getaffinity(0)))
    with up(tmp_path / "vllm", *args, "--cluster-secret-file", str(secret), env=VLLM_ENV) as u:
        url = u.wait_ready(timeout=START_S)
        assert "1 encoder(s) + 1 vLLM instance(s) + router ready" in u.out.read_text()
        pids = process_tree([u.proc.pid])
        vllm_pid, vllm_url = u.roles()["pd0"]
        assert len(process_tree([vllm_pid])) >= 3, "the wrapper, vllm serve and its engine core"
        assert_placed(vllm_pid, plan)
        got = greedy(url, content)["choices"][0]["message"]["content"]
        assert got == want

        # while a long request runs, the router reads vLLM's load from its /metrics, and
        # federates vLLM's metrics with its own
        # long requests one after another until the router has seen one running: a probe between
        # two scrapes may miss a request that ends early on a fast machine
        seen: dict[str, list[float]] = {}
        done = threading.Event()

        def keep_busy() -> None:
            while not done.is_set():
                greedy(url, content, 400, ignore_eos=True)

        long = threading.Thread(target=keep_busy)
        long.start()

        def busy() -> bool:
            status, raw = http("GET", url + "/metrics", headers=internal_headers())
            text = raw.decode()
            seen["ratio"] = samples(text, "epd_router_load_ratio", role="pd")
            seen["running"] = samples(text, "vllm:num_requests_running", role="pd")
            if (out := os.environ.get("EPD_VLLM_METRICS_OUT")) and sum(seen["running"]):
                Path(out).write_bytes(http("GET", vllm_url + "/metrics")[1])  # a real page, for the unit test
            return status == 200 and sum(seen["running"]) >= 1 and sum(seen["ratio"]) > 0

        try:
            assert wait_for(busy, 300, 0.5), seen
        finally:
            done.set()
            long.join(timeout=600)

        log = (u.logs / "pd0.log").read_text(errors="replace")
        lines = [line for line in log.split("\n") if line.strip()]  # a progress bar's \r stays inside its line
        bare = [line for line in lines if not line.startswith("[pd0 vllm] ")]
        assert lines and not bare, bare[:5]

        # vLLM killed in the middle of two requests, one streamed and one not: the streamed one
        # ends with an error event, the other with a 5xx error, neither hangs; ``up`` starts vLLM
        # again on its port, and it answers as before. "In the middle" is read from the streamed
        # request's own tokens as they reach this client (vLLM's /metrics can answer late while it
        # decodes, and a kill gated on it may come after both requests ended); the whole one was
        # sent first and needs far longer than the stream takes to show its first tokens
        answers: list[tuple[int, bytes]] = []

        def ask(stream: bool) -> bytes:
            body = {"model": "shapes-qwen2vl", "messages": [{"role": "user", "content": content}],
                    "max_tokens": 1800, "temperature": 0.0, "ignore_eos": True, "stream": stream}  # fmt: skip
            return json.dumps(body).encode()

        whole = threading.Thread(
            target=lambda: answers.append(http("POST", url + "/v1/chat/completions", ask(False), timeout=600))
        )
        whole.start()
        chat = urllib.request.Request(
            url + "/v1/chat/completions", data=ask(True), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(chat, timeout=600) as stream:
            tokens = 0
            while tokens < 3:
                line = stream.readline()
                assert line, "the stream ended before its first tokens"
                if line.startswith(b"data: {"):
                    tokens += bool(json.loads(line[6:])["choices"][0]["delta"].get("content"))
            api = [api_server(vllm_pid)]
            os.kill(api[0], signal.SIGKILL)
            rest = stream.read().decode()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), rest[-300:]
        whole.join(timeout=120)
        assert len(answers) == 1, "the request in flight hung"
        status, raw = answers[0]
        assert status >= 500 and "error" in json.loads(raw), (status, raw[:300])
        new_pid, new_url = u.wait_restarted("pd0", vllm_pid, timeout=START_S)
        assert new_url == vllm_url and "restarted pd0" in u.stderr()
        assert_placed(new_pid, plan)
        assert wait_for(lambda: http("GET", url + "/health")[0] == 200, 60, 0.5)
        assert greedy(url, content)["choices"][0]["message"]["content"] == want
        assert not alive(api[0])
        pids = process_tree([u.proc.pid])

        u.proc.send_signal(signal.SIGTERM)
        assert u.proc.wait(timeout=120) == 0
        assert wait_for(lambda: not any(alive(p) for p in pids), 30), [p for p in pids if alive(p)]


def test_vllm_s_own_load_generator_runs_against_epdserve(tmp_path: Path) -> None:
    """``vllm bench serve``, a third-party client, against ``epdserve up``: its multimodal chat
    benchmark (two images a prompt) and its text completions benchmark, every request answered
    with every token it asked for."""
    vllm = Path(sys.executable).with_name("vllm")
    model = str(Path(__file__).resolve().parents[1] / "epdserve" / "assets" / "shapes-qwen2vl")
    runs = {
        "chat": ["--backend", "openai-chat", "--endpoint", "/v1/chat/completions", "--dataset-name", "random-mm",
                 "--random-mm-base-items-per-request", "2", "--random-mm-bucket-config", "{(112, 112, 1): 1.0}",
                 "--random-mm-limit-mm-per-prompt", json.dumps({"image": 2, "video": 0})],
        "completions": ["--backend", "openai", "--dataset-name", "random"],
    }  # fmt: skip
    with up(tmp_path, "--topology", "1e+1pd") as u:
        url = u.wait_ready().removesuffix("/v1")
        for name, args in runs.items():
            cmd = [str(vllm), "bench", "serve", "--base-url", url, "--model", "shapes-qwen2vl", "--tokenizer", model,
                   "--num-prompts", "12", "--random-input-len", "32", "--random-output-len", "16",
                   "--max-concurrency", "4", "--ignore-eos", "--temperature", "0", "--save-result",
                   "--result-dir", str(tmp_path), "--result-filename", f"{name}.json", *args]  # fmt: skip
            done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **VLLM_ENV}, timeout=600)
            assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
            result = json.loads((tmp_path / f"{name}.json").read_text())
            assert (result["completed"], result["failed"]) == (12, 0), (name, result)
            assert result["total_output_tokens"] == 12 * 16, (name, result["total_output_tokens"])


def test_up_with_vllm_that_fails_at_start_says_so_in_one_line(tmp_path: Path) -> None:
    """A flag vLLM refuses: ``up`` names the instance that exited, and starts nothing more."""
    with up(tmp_path, "--lm-engine", "vllm", "--vllm-args", "--no-such-vllm-flag 1", env=VLLM_ENV) as u:
        assert u.proc.wait(timeout=START_S) == 1
        errors = [line for line in u.stderr().splitlines() if "error" in line]
        assert len(errors) == 1 and "pd0 exited with code" in errors[0] and "during start-up" in errors[0], errors
        assert "[pd0 vllm] " in (u.logs / "pd0.log").read_text(errors="replace")
        pids = set(u.seen)
        assert wait_for(lambda: not any(alive(p) for p in pids), 30)


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive ports no server listens on."""
    while True:
        first = free_port()
        if first + n < 65536 and all(port_available("127.0.0.1", first + i) for i in range(n)):
            return first


def test_the_gpu_check_s_vllm_part_runs_on_the_cpu(tmp_path: Path) -> None:
    """``scripts/gpu_check.sh --vllm-only`` rehearsed with vLLM's CPU build (``EPD_CHECK_DEVICE=cpu``):
    ``up --lm-engine vllm`` answers, then the benchmark runs through the router to an encoder and a
    vLLM with epdserve's connector, and against a plain vLLM; nothing is left running."""
    out = tmp_path / "out"
    first = _free_ports(5)
    env = dict(os.environ, EPD_CHECK_DEVICE="cpu", EPD_CHECK_PORT=str(first), OUT=str(out), VLLM_GPU_ENV=sys.prefix)
    run = subprocess.run(["bash", "scripts/gpu_check.sh", "--vllm-only"], cwd=Path(__file__).resolve().parents[1],
                         env=env, capture_output=True, text=True, timeout=3 * START_S)  # fmt: skip
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-4000:]
    assert "rehearsal on cpu" in log and "gpu_check: all steps passed" in log
    assert (out / "vllm-up-answer.txt").read_text().startswith("up --lm-engine vllm: ")
    for bench in ("bench-epd-encoder-vllm", "bench-vllm-aggregated"):
        summary = json.loads((out / bench).read_text())["summary"]
        assert summary["completed"] == summary["requests"] == 64 and not summary["errors"], (bench, summary)
    stages = json.loads((out / "bench-epd-encoder-vllm").read_text())["summary"]["stages"]
    assert "router_encode" in stages and "encoder_compute" in stages, stages  # the images went to the encoder
    # the script stopped every server it started: none of its ports has a listener
    assert wait_for(lambda: all(port_available("127.0.0.1", first + i) for i in range(5)), 30)
