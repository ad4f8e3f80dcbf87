"""The parts of epdserve's vLLM connector that need no vLLM: its config, the handles of a request's
``ec_transfer_params`` and the interface check (against small stand-in classes; the real vLLM
classes are checked in test_vllm_connector.py where vLLM is installed)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from epdserve.encoder.protocol import EncodedItem
from epdserve.integrations.vllm import compat, launch
from epdserve.integrations.vllm.config import VllmECConfig
from epdserve.integrations.vllm.handles import PARAMS_KEY, ec_transfer_params, handles_by_key
from epdserve.integrations.vllm.placement import front_end_cpus
from epdserve.launcher import free_port
from epdserve.router.config import RouterConfig
from epdserve.router.refs import media_refs
from epdserve.router.vllm_worker import VllmLoad, as_sent, is_vllm_models, parse_vllm_load, vllm_body
from epdserve.transfer.base import InvalidHandle
from epdserve.transfer.cached import CACHED_HANDLE
from tests.optional import unavailable

# --------------------------------------------------------------------------- config


def test_config_from_extra_config() -> None:
    cfg = VllmECConfig.from_extra({"local_encode": False, "timeout_s": 5, "model_id": "m"})
    assert cfg == VllmECConfig(model_id="m", local_encode=False, timeout_s=5.0)
    assert VllmECConfig.from_extra(None) == VllmECConfig()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"local_encoding": False}, r"unknown ec_connector_extra_config key\(s\) local_encoding"),
        ({"local_encode": "no"}, "local_encode must be a bool"),
        ({"timeout_s": True}, "timeout_s must be a float"),
        ({"timeout_s": 0}, "timeout_s must be positive"),
        ({"store_url": "http://x"}, "store url must look like"),
    ],
)
def test_config_refuses_what_it_does_not_know(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        VllmECConfig.from_extra(extra)


def test_the_secret_comes_from_the_environment_or_a_private_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EPD_CLUSTER_SECRET", raising=False)
    with pytest.raises(ValueError, match="needs the cluster secret"):
        VllmECConfig().ec_config()
    monkeypatch.setenv("EPD_CLUSTER_SECRET", "s" * 32)
    assert VllmECConfig().ec_config().secret == "s" * 32
    path = tmp_path / "secret"
    path.write_text("f" * 32)
    path.chmod(0o644)
    with pytest.raises(ValueError, match="readable by everyone"):
        VllmECConfig(cluster_secret_file=str(path)).ec_config()
    path.chmod(0o600)
    cfg = VllmECConfig(cluster_secret_file=str(path), timeout_s=3.0).ec_config()
    assert cfg.secret == "f" * 32 and cfg.timeout_s == 3.0


# --------------------------------------------------------------------------- handles in ec_transfer_params


def h(key: str, **more: Any) -> dict:
    return {"key": key, "mac": "0" * 64, **more}


def test_handles_by_key() -> None:
    params = ec_transfer_params([h("a"), h("b"), h("a", lease="2")])
    by_key, surplus = handles_by_key(params, limit=3)
    assert by_key == {"a": h("a"), "b": h("b")}
    assert surplus == [h("a", lease="2")]  # a repeated item's second lease: given back, not read
    assert handles_by_key(None, 1) == ({}, [])
    assert handles_by_key({"kv": 1}, 1) == ({}, [])


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ([h("a")], "not a JSON object"),
        ({PARAMS_KEY: h("a")}, "is not a list"),
        ({PARAMS_KEY: [h("a"), h("b")]}, "2 handles for 1 media items"),
        ({PARAMS_KEY: ["a"]}, "names no key"),
        ({PARAMS_KEY: [{"key": 7}]}, "names no key"),
    ],
)
def test_malformed_handles_are_refused(params: object, message: str) -> None:
    with pytest.raises(InvalidHandle, match=message):
        handles_by_key(params, limit=1)


# --------------------------------------------------------------------------- interface check


class Base:
    def start_load_caches(self, encoder_cache, **kwargs): ...
    def save_caches(self, encoder_cache, mm_hash, **kwargs): ...
    def has_cache_item(self, identifier): ...
    def ensure_cache_available(self, request, num_computed_tokens): ...
    def update_state_after_alloc(self, request, index): ...
    def build_connector_meta(self, scheduler_output): ...
    def take_unavailable_requests(self): ...
    def request_finished(self, request): ...
    def bind_connector_metadata(self, connector_metadata): ...
    def shutdown(self): ...


class Request:
    def __init__(self) -> None:
        self.request_id = ""
        self.mm_features: list = []
        self.ec_transfer_params = None

    def get_num_encoder_embeds(self, input_id: int) -> int:
        return 0


def test_the_interface_check_passes_the_interface_it_knows() -> None:
    assert compat.interface_problems(Base, Request) == []
    assert compat.check("0.32.0+cpu", Base, Request) is True
    assert compat.check("0.33.1", Base, Request) is False  # untested but same interface: allowed


def test_a_changed_interface_fails_naming_the_version() -> None:
    methods = {k: v for k, v in vars(Base).items() if k != "take_unavailable_requests"}
    methods["has_cache_item"] = lambda self, identifier, request: False
    changed = type("Changed", (), methods)
    with pytest.raises(compat.IncompatibleVllm) as e:
        compat.check("0.40.0", changed, Request)
    msg = str(e.value)
    assert "vLLM 0.40.0" in msg and "0.32.x" in msg
    assert "has_cache_item('identifier', 'request')" in msg
    assert "ECConnectorBase.take_unavailable_requests is gone" in msg
    with pytest.raises(compat.IncompatibleVllm, match=r"Request\.ec_transfer_params is gone"):
        compat.check("0.40.0", Base, type("Bare", (), {"get_num_encoder_embeds": Request.get_num_encoder_embeds}))


# --------------------------------------------------------------------------- the router's vLLM worker adapter


def encoded(uuid: str, connector: str = "shm") -> EncodedItem:
    handle = {"key": uuid, "connector": connector, "mac": "0" * 64}
    return EncodedItem(
        uuid=uuid, modality="image", grid_thw=(1, 4, 4), num_embeddings=4, dtype="float32", shape=(4, 8),
        ec_handle=handle, status="computed",
    )  # fmt: skip


def test_vllm_body_keeps_the_media_and_passes_uuids_and_handles() -> None:
    client = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "data:a"}, "uuid": "client-chosen"},
                {"type": "text", "text": "compare"},
                {"type": "image_url", "image_url": {"url": "data:b"}},
                {"type": "image_url", "image_url": {"url": "data:c"}, "uuid": "x"},
                {"type": "image_url", "image_url": {"url": "data:d"}},
            ]},
        ],
        "ec_transfer_params": {"epdserve_handles": [{"key": "forged"}]},
        "kv_transfer_params": {"do_remote_decode": True},
    }  # fmt: skip
    before = json.dumps(client)
    refs = media_refs(client)
    refs[0].result, refs[1].result = encoded("ua"), encoded("ub")
    refs[2].raw = True  # the worker encodes it itself
    refs[3].result = encoded("ud", connector=CACHED_HANDLE)  # only a cached handle: unreadable for vLLM
    out = vllm_body(client, refs)
    parts = out["messages"][1]["content"]
    assert [p.get("uuid") for p in parts] == ["ua", None, "ub", None, None]  # no client uuid survives
    assert [p.get("image_url", {}).get("url") for p in parts] == ["data:a", None, "data:b", "data:c", "data:d"]
    assert out["ec_transfer_params"] == {"epdserve_handles": [refs[0].result.ec_handle, refs[1].result.ec_handle]}
    assert "kv_transfer_params" not in out
    assert json.dumps(client) == before  # the client's body is left as it was
    nothing_encoded = vllm_body(client, [])  # --dispatch never: every part goes raw
    assert "ec_transfer_params" not in nothing_encoded
    assert not [p for p in nothing_encoded["messages"][1]["content"] if "uuid" in p]  # vLLM keys its caches by it
    assert not as_sent(client)


def test_a_body_goes_to_vllm_as_sent_only_when_nothing_in_it_is_the_router_s() -> None:
    text = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    image = {"type": "image_url", "image_url": {"url": "data:a"}}
    assert as_sent(text) and vllm_body(text, []) == text
    with_image = {**text, "messages": [{"role": "user", "content": [image, {"type": "text", "text": "?"}]}]}
    assert as_sent(with_image) and vllm_body(with_image, []) == with_image
    named = {**text, "messages": [{"role": "user", "content": [{**image, "uuid": "mine"}]}]}
    assert not as_sent(named)
    for field in ("ec_transfer_params", "kv_transfer_params"):
        assert not as_sent({**text, field: {}})


VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def test_vllm_load_from_its_metrics() -> None:
    load = parse_vllm_load(VLLM_METRICS)
    assert load == VllmLoad(running=4.0, waiting=2.0, kv_usage=0.25) and load.outstanding == 6.0
    with pytest.raises(ValueError, match="no vLLM request gauges"):
        parse_vllm_load("# TYPE epd_num_requests_running gauge\nepd_num_requests_running 1\n")


def test_the_load_of_a_real_vllm_metrics_page() -> None:
    """vLLM 0.32's own /metrics (CPU build) while it ran one request, as the router scraped it."""
    text = (Path(__file__).parent / "corpus" / "vllm-0.32-metrics.txt").read_text()
    load = parse_vllm_load(text)
    assert (load.running, load.waiting) == (1.0, 0.0)
    assert load.kv_usage == pytest.approx(0.0029325513196480912, rel=1e-9)
    report = load.report()
    assert report.load_ratio == pytest.approx(load.kv_usage, rel=1e-9) and report.running == 1 and report.vision


def test_vllm_load_is_a_load_report() -> None:
    idle = VllmLoad(running=0.0, waiting=0.0, kv_usage=0.0).report()
    assert idle.load_ratio == 0.0 and idle.vision and (idle.running, idle.waiting) == (0, 0)
    busy = VllmLoad(running=3.0, waiting=0.0, kv_usage=0.5).report()
    assert busy.load_ratio == pytest.approx(0.5, rel=1e-9)  # nothing waits: the KV cache in use
    full = VllmLoad(running=4.0, waiting=2.0, kv_usage=0.25).report()
    assert full.load_ratio == pytest.approx(1.5, rel=1e-9) and (full.running, full.waiting) == (4, 2)
    for bad in ("nan", "-1", "1e12"):
        with pytest.raises(ValueError, match="out of range"):
            parse_vllm_load(
                VLLM_METRICS.replace('{engine="1",model_name="m"} 1.0', '{engine="1",model_name="m"} ' + bad)
            )


def test_a_vllm_worker_is_told_by_its_model_cards() -> None:
    assert is_vllm_models({"object": "list", "data": [{"id": "m", "owned_by": "vllm"}]})
    assert not is_vllm_models({"object": "list", "data": [{"id": "m", "owned_by": "epdserve"}]})
    assert not is_vllm_models({"data": []}) and not is_vllm_models(["vllm"])


@pytest.mark.parametrize("bad", [{"policy": "kv_aware"}, {"prefills": ("http://p:1",), "decodes": ("http://d:1",)}])
def test_the_router_takes_vllm_workers_where_it_can_drive_them(bad: dict) -> None:
    with pytest.raises(ValueError, match="--pd-engine vllm"):
        RouterConfig(pds=("http://v:1",), pd_engine="vllm", **bad)
    with pytest.raises(ValueError, match="unknown PD engine"):
        RouterConfig(pd_engine="sglang")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- ``epdserve up --lm-engine vllm``


def test_the_vllm_command_line_carries_the_connector_and_the_operator_s_flags_last() -> None:
    cmd = launch.serve_command("/v/bin/vllm", "/m/qwen", "qwen", "127.0.0.1", 8100, {"local_encode": False},
                               ["--tensor-parallel-size", "2", "--max-model-len=4096"])  # fmt: skip
    assert cmd[:9] == ["/v/bin/vllm", "serve", "/m/qwen", "--host", "127.0.0.1", "--port", "8100",
                       "--served-model-name", "qwen"]  # fmt: skip
    config = json.loads(cmd[cmd.index("--ec-transfer-config") + 1])
    assert config["ec_connector_module_path"] == "epdserve.integrations.vllm.ec_connector"
    assert config["ec_role"] == "ec_consumer" and config["ec_connector_extra_config"] == {"local_encode": False}
    assert VllmECConfig.from_extra(config["ec_connector_extra_config"]).local_encode is False
    assert cmd[-3:] == ["--tensor-parallel-size", "2", "--max-model-len=4096"]
    assert "--ec-transfer-config" not in launch.serve_command("vllm", "/m", "m", "::1", 1, connector=False)
    launch.check_vllm_args(["--dtype", "float32", "--port-offset"])  # only up's own flags are refused
    for owned in ("--port", "--host=0.0.0.0", "--ec-transfer-config", "--served-model-name"):
        with pytest.raises(ValueError, match="may not set"):
            launch.check_vllm_args(["--enforce-eager", owned])


def test_a_pinned_vllm_binds_its_model_worker_to_the_engine_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    from epdserve.up import Topology, plan_cores

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    plan = plan_cores(Topology.parse("1e+2pd"), [0, 1, 2, 3])
    assert plan.engines == {"pd0": [1, 3], "pd1": [2]}  # the encoder and the front ends share core 0
    assert launch.vllm_cpu_binding(plan.engines["pd0"], ["--enforce-eager"]) == {"VLLM_CPU_OMP_THREADS_BIND": "1,3"}
    assert launch.vllm_cpu_binding(plan.engines["pd1"], []) == {"VLLM_CPU_OMP_THREADS_BIND": "2"}
    assert launch.vllm_cpu_binding(None, []) == {}  # not pinned
    for parallel in (["--tensor-parallel-size", "2"], ["-tp=2"], ["--pipeline-parallel-size=2"]):
        assert launch.vllm_cpu_binding([2, 3], parallel) == {}  # each rank needs its own list
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    assert launch.vllm_cpu_binding([2], []) == {}  # the operator's own binding stands


def test_up_counts_its_encoders_and_leaves_vllm_to_size_itself() -> None:
    from epdserve.sizing import Settings
    from epdserve.up import Deployment, Topology

    d = Deployment(Topology.parse("2e+3pd"), None, port=free_port(), lm_engine="vllm", verbose=True)
    lines: list[str] = []
    d.line = lambda text, *args, **kwargs: lines.append(text)  # type: ignore[method-assign]
    d._check_fit(Settings())
    assert len(lines) == 1 and lines[0].startswith("fits: "), lines
    assert "2 model process(es)" in lines[0] and "(encoder memory: " in lines[0] and "pd memory" not in lines[0]
    assert "not counted: 3 vLLM instance(s), which size their own memory" in lines[0]


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "epdserve.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def test_up_with_vllm_not_installed_fails_in_one_line() -> None:
    assert unavailable("vllm") is not None, "this interpreter has vLLM: the test needs one without it"
    path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/bin", "/bin"])
    out = run_cli("up", "--lm-engine", "vllm", "--force", "--port", str(free_port()), env={"PATH": path})
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "vLLM is not installed" in lines[0] and "epdserve[vllm]" in lines[0], out.stderr
    assert "ready" not in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--topology", "aggregated"], "runs the <N>e+<M>pd topologies"),
        (["--topology", "1e+1p+1d"], "runs the <N>e+<M>pd topologies"),
        (["--vllm-args", "--enforce-eager --port 9"], "may not set --port"),
        (["--vllm-args=--host=::"], "may not set --host"),
        (["--vllm-args", "--dtype 'float32"], "--vllm-args: No closing quotation"),
        (["--max-model-len", "512"], "give vLLM's flags in --vllm-args"),
    ],
)
def test_up_with_vllm_refuses_what_it_cannot_run_in_one_line(args: list[str], message: str) -> None:
    out = run_cli("up", "--lm-engine", "vllm", *args, "--port", str(free_port()))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr, out.stderr
    out = run_cli("up", "--vllm-args=--enforce-eager", "--port", str(free_port()))
    assert out.returncode == 2 and "--vllm-args needs --lm-engine vllm" in out.stderr


CHILD = """
import subprocess, sys, time
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
print("started", helper.pid, flush=True)
print("second line", flush=True)
time.sleep(600)
"""


def wrapper(*cmd: str) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", launch.WRAPPER, *launch.wrapper_args("pd0", cmd)]
    return subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True)


def stop_wrapper(proc: subprocess.Popen[str]) -> None:
    """Stop the wrapper as ``up`` does (SIGTERM: it cleans up after vLLM), then kill whatever of its
    group is left."""
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextlib.contextmanager
def wrapped(*cmd: str) -> Iterator[tuple[subprocess.Popen[str], IO[str]]]:
    """The wrapper running ``cmd``, and its stderr; stopped afterwards."""
    proc = wrapper(*cmd)
    try:
        assert proc.stderr is not None
        yield proc, proc.stderr
    finally:
        stop_wrapper(proc)


def test_the_vllm_wrapper_prefixes_lines_and_takes_vllm_s_helpers_down() -> None:
    with wrapped(sys.executable, "-c", CHILD) as (proc, err):
        first = err.readline()
        assert first.startswith("[pd0 vllm] started "), first
        helper = int(first.split()[-1])
        assert err.readline() == "[pd0 vllm] second line\n"
        proc.send_signal(signal.SIGTERM)  # the wrapper alone, as the kernel does when ``up`` dies
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 10
        while Path(f"/proc/{helper}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # reaped by init once killed
        assert not Path(f"/proc/{helper}").exists() or "Z" in Path(f"/proc/{helper}/stat").read_text().split()[2]


LEAVES_SOCKETS = """
import os, socket, sys, time
where = os.environ.get("VLLM_RPC_BASE_PATH", "")
sock = socket.socket(socket.AF_UNIX)
sock.bind(os.path.join(where, "engine.sock"))  # left behind, as vLLM leaves its ZMQ sockets
print("rpc", where, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("operator_s", [False, True])
def test_vllm_s_sockets_go_with_it_unless_the_operator_chose_where(
    operator_s: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if operator_s:
        monkeypatch.setenv(launch.RPC_DIR_ENV, str(tmp_path))
    else:
        monkeypatch.delenv(launch.RPC_DIR_ENV, raising=False)
    with wrapped(sys.executable, "-c", LEAVES_SOCKETS) as (proc, err):
        line = err.readline()
        assert line.startswith("[pd0 vllm] rpc /"), line
        where = Path(line.split()[-1])
        assert (where / "engine.sock").is_socket()
        assert (where == tmp_path) is operator_s
        if not operator_s:
            assert where.name.startswith("epd-vllm-pd0-") and (where.stat().st_mode & 0o077) == 0  # private
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert where.exists() is operator_s  # ours removed with what vLLM left in it; the operator's kept


FAKE_VLLM = """
import http.server, subprocess, sys, threading, time
engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # its engine core
threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # a second thread to move

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

print("engine", engine.pid, flush=True)
http.server.HTTPServer(("127.0.0.1", PORT), Health).serve_forever()
"""


def test_the_vllm_wrapper_moves_vllm_s_front_end_off_the_engine_s_cores_once_it_is_up() -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    front, engine = cores[0], cores[1]
    port = free_port()
    cmd = [sys.executable, "-c", FAKE_VLLM.replace("PORT", str(port))]
    argv = [sys.executable, "-m", launch.WRAPPER,
            *launch.wrapper_args("pd0", cmd, front_end=([front], f"http://127.0.0.1:{port}"))]  # fmt: skip
    # started as ``up`` starts a pinned vLLM: the wrapper and all it starts on the engine's core
    proc = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: os.sched_setaffinity(0, {engine}))  # fmt: skip
    try:
        assert proc.stderr is not None
        first = proc.stderr.readline()
        assert first.startswith("[pd0 vllm] engine "), first
        engine_core = int(first.split()[-1])
        said = proc.stderr.readline()
        assert said.startswith("[pd0 vllm] front end (pid ") and said.endswith(f" on cores {front}\n"), said
        api = int(said.split("pid ")[1].split(",")[0])
        threads = [int(t.name) for t in Path(f"/proc/{api}/task").iterdir()]
        assert len(threads) >= 2 and all(os.sched_getaffinity(t) == {front} for t in threads)
        assert os.sched_getaffinity(engine_core) == {engine}  # started before: stays with the engine
        assert os.sched_getaffinity(proc.pid) == {engine}
    finally:
        stop_wrapper(proc)
    bad = subprocess.run([sys.executable, "-m", launch.WRAPPER, "--name", "pd0", "--front-end-cpus", "0", "--", "true"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and "--front-end-cpus and --url go together" in bad.stderr


def test_the_wrapper_takes_a_non_empty_core_list_for_the_front_end() -> None:
    assert front_end_cpus("0") == [0] and front_end_cpus("3,0-1") == [0, 1, 3] and front_end_cpus("2-2,2") == [2]
    for bad in ("", "1-0", "-1", "a", ","):
        with pytest.raises(ValueError):
            front_end_cpus(bad)


def test_the_vllm_wrapper_exits_as_vllm_did() -> None:
    proc = wrapper("sh", "-c", "echo bad flag >&2; exit 3")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 3 and err == "[pd0 vllm] bad flag\n"
    proc = wrapper("sh", "-c", r"printf 'load 0%%\rload 100%%\r\nready\r\n'")  # a progress bar's redraws
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0 and err == "[pd0 vllm] load 0%\n[pd0 vllm] load 100%\n[pd0 vllm] ready\n", err
    proc = wrapper("/nonexistent/vllm", "serve")
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 127 and err.startswith("[pd0 vllm] could not start /nonexistent/vllm")
    json_line = launch.prefixed("pd1", "INFO 1 engine up\n", log_json=True)
    assert json.loads(json_line)["logger"] == "vllm.pd1" and json.loads(json_line)["message"] == "INFO 1 engine up"
