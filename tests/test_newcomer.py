"""epdserve as a newcomer meets it: the real command in a subprocess, from a working directory of
its own (the parent of a clone), against real busy ports, real malformed checkpoints, real servers
that are down or want a key. Every failure is one line that says what to do, with no traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdserve.assets import default_model_dir
from epdserve.bench.client import server_url
from epdserve.bench.workload import image_data_url
from epdserve.launcher import PORT_IN_USE_EXIT, free_port
from epdserve.shapes import ShapesWorld
from tests.server_utils import http

STARTUP_S = 180.0  # generous: the cores here are shared with the rest of the suite
SMALL = ("--max-model-len", "512", "--num-kv-blocks", "64")  # a small KV cache: quick to allocate


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment without keys (a newcomer's shell has none), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("EPD_API_KEY", "EPD_ADMIN_KEY", "EPD_CLUSTER_SECRET")}
    return {**env, **extra}


def epdserve(*args: str) -> list[str]:
    """``epdserve <args>`` as the console script runs it: the script's directory, not the working
    directory, is first on its import path (``-P`` does the same for ``python -m``)."""
    return [sys.executable, "-P", "-m", "epdserve.cli", *args]


def run(
    cwd: Path, *args: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        epdserve(*args), cwd=cwd, env=env or clean_env(), capture_output=True, text=True, timeout=timeout
    )


def one_line_error(done: subprocess.CompletedProcess, *words: str) -> str:
    """The single error line of a failed command, holding ``words``, and no traceback."""
    assert done.returncode != 0, done.stdout
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def parent_of_clone(tmp_path: Path) -> Path:
    """A directory holding a folder named like the package, as the parent of a clone does; it is
    made importable here and fails on import, so anything importing it instead of the installed
    package shows at once."""
    clone = tmp_path / "epdserve"
    clone.mkdir()
    (clone / "__init__.py").write_text("raise ImportError('the clone folder shadowed the package')\n")
    return tmp_path


class Up:
    """``epdserve up`` started the way a user does, from ``cwd``, in its own session."""

    def __init__(self, cwd: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err, self.logs = cwd / "up.out", cwd / "up.err", cwd / "logs"
        cmd = epdserve("up", *args, "--port", str(self.port), "--log-dir", str(self.logs))
        with self.out.open("wb") as out, self.err.open("wb") as err:
            self.proc = subprocess.Popen(
                cmd, cwd=cwd, stdout=out, stderr=err, start_new_session=True, env=env or clean_env()
            )

    def output(self) -> str:
        logs = sorted(self.logs.glob("*.log")) if self.logs.is_dir() else []
        roles = "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in logs)
        return f"{self.out.read_text()}\n{self.err.read_text()}\n{roles}"

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline and self.proc.poll() is None:
            if "ready in" in self.out.read_text():
                return
            time.sleep(0.2)
        raise AssertionError(f"up not ready (rc {self.proc.poll()}):\n{self.output()}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def status(url: str) -> int:
    """The HTTP status of a GET, 0 while nothing listens."""
    try:
        return http("GET", url, timeout=5)[0]
    except OSError:
        return 0


def image_chat(url: str, timeout: float = 120.0) -> tuple[int, bytes]:
    img = image_data_url(ShapesWorld(3).scene().render())
    body = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": img}},
                    {"type": "text", "text": "What shape is it?"},
                ],
            }
        ],
        "max_tokens": 4,
        "temperature": 0,
    }
    return http("POST", url + "/v1/chat/completions", json.dumps(body).encode(), timeout=timeout)


# ---- a deployment started from the parent of a clone ------------------------------------------------


def test_up_from_the_parent_of_a_clone_serves_and_demo_takes_its_url_and_key(parent_of_clone: Path) -> None:
    """The roles (and the engine core each language-model role starts) import the installed
    package, not the folder in the working directory; the URL ``up`` prints works in ``demo``
    as printed (with /v1), with the key given by flag; a wrong or missing key is one line."""
    u = Up(parent_of_clone, "--topology", "aggregated", "--api-key", "sesame", "--log-format", "json", *SMALL)
    try:
        u.wait_ready()
        printed = json.loads(u.out.read_text().splitlines()[-1])["url"]
        assert printed == u.url + "/v1"
        done = run(parent_of_clone, "demo", "--url", printed, "--api-key", "sesame", "-n", "2", timeout=300)
        assert done.returncode == 0, done.stderr
        assert "2 exact" in done.stdout or "/2 exact" in done.stdout, done.stdout
        refused = run(parent_of_clone, "demo", "--url", printed, "-n", "1")
        one_line_error(refused, "--api-key", "EPD_API_KEY")
        wrong = run(parent_of_clone, "demo", "--url", u.url, "--api-key", "nope", "-n", "1")
        one_line_error(wrong, "refused the API key")
    finally:
        code = u.stop()
    assert code == 0, u.output()
    assert "shadowed" not in u.output()
    # with --log-format json every line is JSON: up's own and the role's, its start-up line among them
    lines = [json.loads(line) for line in (u.out.read_text() + u.err.read_text()).splitlines() if line]
    assert {line["logger"] for line in lines} == {"epdserve.up"}
    records = [json.loads(line) for line in (u.logs / "serve.log").read_text().splitlines() if line.startswith("{")]
    (started,) = [r for r in records if r.get("event") == "started"]
    assert started["model"] == "shapes-qwen2vl" and started["family"] == "Qwen2VLForConditionalGeneration"
    assert (started["dtype"], started["device"], started["auth"]) == ("float32", "cpu", "api key")
    assert started["kernels"].startswith(("fused", "torch (")), started
    assert started["kv_blocks"] == 64 and started["kv_bytes"].endswith("GiB")
    assert started["listen"] == f"http://127.0.0.1:{u.port}"


def test_demo_against_a_server_that_is_down_says_so_in_one_line(tmp_path: Path) -> None:
    done = run(tmp_path, "demo", "--url", f"http://127.0.0.1:{free_port()}/v1", "-n", "1")
    one_line_error(done, "no server answers", "epdserve up")


# ---- readiness ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    """1e+1pd started from a directory of its own; an image request may wait a long time for an
    encoder (the restart test's encoder loads on shared cores)."""
    u = Up(tmp_path_factory.mktemp("up"), "--topology", "1e+1pd", "--encoder-wait-s", "120", *SMALL)
    try:
        u.wait_ready()
        yield u
    finally:
        u.stop()


def test_ready_means_every_role_and_start_up_warns_of_nothing(deployment: Up) -> None:
    status, body = http("GET", deployment.url + "/ready")
    assert status == 200, body
    seen = json.loads(body)
    assert seen["encoders"] >= 1 and seen["pds"] >= 1, seen
    status, _ = image_chat(deployment.url)
    assert status == 200
    router_log = (deployment.logs / "router.log").read_text()
    assert "failed its health probe" not in router_log, router_log
    # each role says once what it runs, how and where
    for role, says in {
        "encoder0": ("model=shapes-qwen2vl", "dtype=float32", "kernels=", "ec_connector=shm", 'auth="cluster only"'),
        "pd0": ("family=Qwen2VLForConditionalGeneration", "kv_blocks=64", "kv_bytes=", 'auth="cluster only"'),
        "router": (
            "encoders=http://127.0.0.1:",
            "pds=http://127.0.0.1:",
            "auth=off",
            f"listen=http://127.0.0.1:{deployment.port}",
        ),
    }.items():
        started = [line for line in (deployment.logs / f"{role}.log").read_text().splitlines() if " started: " in line]
        assert len(started) == 1, (role, started)
        for word in says:
            assert word in started[0], (role, started[0])


def test_image_requests_sent_when_health_first_answers_are_served(tmp_path: Path) -> None:
    """A client that waits for /health and then sends images gets answers, not 503s: the router
    answers /health once a worker is up, and media waits for an encoder still loading."""
    from concurrent.futures import ThreadPoolExecutor

    u = Up(tmp_path, "--topology", "1e+1pd", *SMALL)
    try:
        deadline = time.monotonic() + STARTUP_S
        while status(u.url + "/health") != 200:
            assert u.proc.poll() is None and time.monotonic() < deadline, u.output()
            time.sleep(0.02)
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: image_chat(u.url)[0], range(16)))
        assert answers == [200] * 16, answers
    finally:
        assert u.stop() == 0, u.output()


def test_an_image_request_waits_for_an_encoder_that_restarts(deployment: Up) -> None:
    """Kill the only encoder: a request sent while it restarts waits for it instead of a 503."""
    started = [line for line in deployment.err.read_text().splitlines() if "encoder0" in line and " pid " in line]
    os.killpg(int(started[-1].split(" pid ")[1].split()[0]), signal.SIGKILL)
    deadline = time.monotonic() + 10
    status, body = 200, b""
    while time.monotonic() < deadline:  # until the router has seen it go (it probes every 2 s)
        status, body = http("GET", deployment.url + "/ready")
        if status == 503:
            break
        time.sleep(0.05)
    assert status == 503, body
    status, body = image_chat(deployment.url, timeout=240)
    assert status == 200, body


def test_not_ready_answers_carry_retry_after() -> None:
    """A router whose workers are not up: /ready and /health are 503 with Retry-After."""
    from epdserve.launcher import start_role, stop

    dead, port = f"http://127.0.0.1:{free_port()}", free_port()
    router = start_role(["router", "--encoders", dead, "--pds", dead, "--port", str(port)])
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while status(url + "/version") != 200:  # it listens
            assert router.poll() is None and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.1)
        for path in ("/ready", "/health"):
            with pytest.raises(urllib.error.HTTPError) as answer:
                urllib.request.urlopen(url + path, timeout=10)
            assert answer.value.code == 503, path
            assert int(answer.value.headers["Retry-After"]) >= 1, path
    finally:
        stop(router)


# ---- one URL form ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "typed", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/", " http://h:8000/v1 "]
)
def test_every_form_of_a_url_is_the_same_server(typed: str) -> None:
    from epdserve.bench.report import BenchConfig

    assert server_url(typed) == "http://h:8000"
    # what bench, sweep and plan --calibrate send their requests with
    assert BenchConfig(url=typed).url == "http://h:8000"


def test_bench_takes_the_url_up_prints(deployment: Up, tmp_path: Path) -> None:
    done = run(
        tmp_path,
        "bench",
        "--url",
        deployment.url + "/v1/",
        "-n",
        "2",
        "--warmup",
        "0",
        "--concurrency",
        "1",
        "--output-len",
        "4",
        "--no-progress",
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "/v1/v1" not in done.stdout + done.stderr


# ---- errors a newcomer meets -------------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("command", ["serve", "encoder", "router"])
def test_a_role_on_a_busy_port_says_so(command: str, busy_port: int, tmp_path: Path) -> None:
    env = clean_env(EPD_CLUSTER_SECRET="s" * 43)
    extra = ["--pds", "http://127.0.0.1:1"] if command == "router" else []
    done = run(tmp_path, command, "--port", str(busy_port), *extra, env=env)
    one_line_error(done, f"port {busy_port}", "in use", "--port")
    assert done.returncode == PORT_IN_USE_EXIT


def test_up_on_a_busy_port_says_so(busy_port: int, tmp_path: Path) -> None:
    done = run(tmp_path, "up", "--port", str(busy_port))
    one_line_error(done, str(busy_port), "--port")
    assert done.returncode == 2


def test_a_second_up_racing_for_the_port_says_so(tmp_path: Path) -> None:
    """Both pass the port check; the second router then finds the port taken: a clear exit 2."""
    port = str(free_port())
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    procs = [
        subprocess.Popen(
            epdserve("up", "--topology", "aggregated", "--port", port, *SMALL),
            cwd=d,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for d in (first, second)
    ]
    try:
        loser = None
        deadline = time.monotonic() + STARTUP_S
        while loser is None and time.monotonic() < deadline:
            loser = next((p for p in procs if p.poll() is not None), None)
            time.sleep(0.2)
        assert loser is not None, "neither up gave way"
        err = loser.stderr.read() if loser.stderr else ""
        assert loser.returncode == 2, err
        assert "in use" in err and "--port" in err, err
        assert "Traceback" not in err, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()


def copy_of_embedded_model(where: Path) -> Path:
    model = where / "model"
    shutil.copytree(default_model_dir(), model)
    return model


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_malformed_config_json_is_one_line(command: str, tmp_path: Path) -> None:
    model = copy_of_embedded_model(tmp_path)
    text = (model / "config.json").read_text()
    (model / "config.json").write_text(text[: len(text) // 2])  # a download cut short
    done = run(tmp_path, command, "--model", str(model), env=clean_env(EPD_CLUSTER_SECRET="s" * 43))
    one_line_error(done, "config.json", "not valid JSON")


@pytest.mark.parametrize("command", ["up", "serve"])
def test_a_checkpoint_without_tokenizer_json_is_one_line(command: str, tmp_path: Path) -> None:
    model = copy_of_embedded_model(tmp_path)
    (model / "tokenizer.json").unlink()
    done = run(
        tmp_path, command, "--model", str(model), "--port", str(free_port()), env=clean_env(EPD_CLUSTER_SECRET="s" * 43)
    )
    one_line_error(done, "no tokenizer.json")


def test_a_hub_id_is_explained(tmp_path: Path) -> None:
    done = run(tmp_path, "up", "--model", "Qwen/Qwen2-VL-2B-Instruct")
    line = one_line_error(done, "Qwen/Qwen2-VL-2B-Instruct", "local checkpoint directory", "--model DIR")
    assert "download" in line


def test_debug_shows_the_traceback(tmp_path: Path) -> None:
    model = copy_of_embedded_model(tmp_path)
    (model / "config.json").write_text("{")
    quiet = run(tmp_path, "up", "--model", str(model))
    loud = run(tmp_path, "--debug", "up", "--model", str(model))
    after = run(tmp_path, "up", "--model", str(model), "--debug")
    assert "Traceback" not in quiet.stderr
    assert "Traceback" in loud.stderr and "Traceback" in after.stderr, loud.stderr


# ---- size check --------------------------------------------------------------------------------------


def test_a_topology_too_large_for_the_machine_is_refused_with_the_numbers(tmp_path: Path) -> None:
    done = run(tmp_path, "up", "--topology", "100e+1pd", "--port", str(free_port()))
    line = one_line_error(done, "100 encoder", "GiB", "available", "--force")
    assert done.returncode == 2
    assert "core" in line
    assert "pid" not in done.stderr  # nothing was started


def test_the_estimate_grows_with_the_caches_and_the_roles() -> None:
    from epdserve.memory import available_memory
    from epdserve.sizing import Settings, TooLargeError, accounts_here, check_fit

    model = default_model_dir()
    small = Settings({"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 1024}, {"encoder_cache_bytes": 1 << 20})
    fit = check_fit(model, small, 1, {"pd": 1}, False, accounts_here)
    assert 0 < fit.need_bytes < fit.available_bytes
    big_kv = Settings({**small.engine, "num_kv_blocks": 1 << 14}, small.encoder)
    pd = {r.memory.role: r.memory for r in check_fit(model, big_kv, 1, {"pd": 1}, False, accounts_here).roles}["pd"]
    assert pd.total > {r.memory.role: r.memory for r in fit.roles}["pd"].total
    huge = Settings(small.engine, {"encoder_cache_bytes": available_memory()})  # one encoder's cache fills the memory
    with pytest.raises(TooLargeError, match="--force"):
        check_fit(model, huge, 1, {"pd": 1}, False, accounts_here)
    # a role that would refuse to start is refused before anything starts
    with pytest.raises(TooLargeError, match="would refuse to start"):
        check_fit(
            model, Settings({**small.engine, "num_kv_blocks": 8}, small.encoder), 1, {"pd": 1}, False, accounts_here
        )


# ---- optional parts ----------------------------------------------------------------------------------


def test_sweep_runs_without_matplotlib(tmp_path: Path) -> None:
    """The heatmaps are optional: without matplotlib the sweep runs, says so, writes its tables."""
    site = tmp_path / "site"
    site.mkdir()
    # an install without the plot extra: importing matplotlib fails
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['matplotlib'] = None\n")
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    out = tmp_path / "out"
    done = run(
        tmp_path,
        "sweep",
        "--out",
        str(out),
        "--topologies",
        "aggregated",
        "--images",
        "1",
        "--output-lens",
        "4",
        "--requests",
        "1",
        "--warmup",
        "0",
        "--no-progress",
        timeout=600,
        env=clean_env(PYTHONPATH=path),
    )
    assert done.returncode == 0, done.stderr
    assert "no heatmaps" in done.stderr and "epdserve[plot]" in done.stderr
    assert (out / "report.md").is_file() and (out / "sweep.json").is_file()
    assert not list(out.glob("*.png"))


# ---- the README ----------------------------------------------------------------------------------


ROOT = Path(__file__).resolve().parent.parent


def test_ci_runs_exactly_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    blocks = readme.split("```bash\n")[1:]
    commands = {b.split("```")[0].strip() for b in blocks if "scripts/test.sh" in b}
    assert commands == {"bash scripts/test.sh"}, commands
    # CI runs that command, then the vLLM integration's job, and nothing else
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    steps = [line for line in ci if line.strip() and not line.startswith(("#", "set ", "cd "))]
    assert len(steps) == 2 and steps[0] == "bash scripts/test.sh", steps
    assert steps[1].endswith("bash scripts/test_vllm.sh"), steps


def test_every_link_in_the_readme_and_docs_resolves() -> None:
    import re

    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


# ---- help ----------------------------------------------------------------------------------------


def help_of(tmp_path: Path, command: str) -> str:
    done = run(tmp_path, command, "--help")
    assert done.returncode == 0, done.stderr
    return " ".join(done.stdout.split())  # argparse wraps lines: compare words


def test_help_states_defaults_in_words_a_user_knows(tmp_path: Path) -> None:
    up = help_of(tmp_path, "up")
    for flag, default in (("--policy", "least_outstanding"), ("--dtype", "float32"), ("--max-model-len", "4096")):
        assert re.search(rf"{flag} \S+ .*?\(default: {default}\)", up), flag
    assert "(default: 1e+1pd)" in up and "--force" in up
    sweep = help_of(tmp_path, "sweep")
    assert "``" not in sweep and "plan_cores" not in sweep and "None" not in sweep
    serve = help_of(tmp_path, "serve")
    assert re.search(r"--kv-connector \{[^}]*\} how a prefill instance hands a prompt's KV", serve)
    assert re.search(r"--url URL .*?\(default: http://127\.0\.0\.1:8000\)", help_of(tmp_path, "bench"))
