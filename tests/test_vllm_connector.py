"""epdserve's encoders in front of a real vLLM: ``vllm serve`` with epdserve's EC connector and a
real epdserve encoder, greedy answers compared with a plain vLLM on the same requests.

Runs only where vLLM is importable (``scripts/test_vllm.sh`` installs its CPU build and runs these
tests with that interpreter); elsewhere the module is skipped, saying so (tests/tiers.py EXTRAS).

Three vLLM instances, at most two at a time: a plain one (the reference), one whose connector
forbids local encoding (an answer from it can only have come from epdserve's embeddings), and one
that allows it (a handle that fails must leave the answer exactly as vLLM computes it).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import av
import msgspec
import pytest
from PIL import Image

from epdserve.encoder.protocol import ENCODER_PROTOCOL_VERSION, EncodedItem
from epdserve.integrations.vllm import compat, launch
from epdserve.integrations.vllm.handles import ec_transfer_params
from epdserve.launcher import free_port
from epdserve.router.refs import media_refs
from epdserve.router.vllm_worker import vllm_body
from epdserve.shapes import ShapesWorld
from tests.server_utils import http, internal_headers, post_json, running

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

MODEL = "shapes-qwen2vl"  # the served name on both sides: handles carry it as their model identity
START_S = 600.0  # vLLM's start-up on a busy 2-core machine
DEVICE = os.environ.get("EPD_TEST_DEVICE", "cpu")  # scripts/gpu_check_vllm.sh runs these on cuda
# what the embedded checkpoint needs of vLLM, as an operator passes it (``up --vllm-args``); on a
# GPU two vLLM instances share its memory
VLLM_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--enforce-eager",
             "--limit-mm-per-prompt", json.dumps({"image": 4, "video": 1}),
             *(["--gpu-memory-utilization", "0.3"] if DEVICE != "cpu" else [])]  # fmt: skip
VLLM_ENV = {
    "HF_HUB_OFFLINE": "1",
    **({"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1"} if DEVICE == "cpu" else {}),
}


# --------------------------------------------------------------------------- media and requests


def image_url(seed: int) -> str:
    buf = io.BytesIO()
    ShapesWorld(seed).scene().render().save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def video_url(seed: int) -> str:
    """An MPEG-4 clip of a shapes-world video (a container and codec both sides decode)."""
    frames: list[Image.Image] = ShapesWorld(seed).video().frames()
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=2)
        assert isinstance(stream, av.VideoStream)
        stream.width, stream.height, stream.pix_fmt = frames[0].width, frames[0].height, "yuv420p"
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_image(f)):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return "data:video/mp4;base64," + base64.b64encode(buf.getvalue()).decode()


Media = list[tuple[str, str]]  # (modality, data URL) in prompt order


def encode(encoder: str, media: Media) -> list[dict]:
    """The encoder's items (uuid, handle, ...) for ``media``, as the router gets them."""
    body = {
        "version": ENCODER_PROTOCOL_VERSION,
        "model": MODEL,
        "items": [{"modality": m, "url": u} for m, u in media],
    }
    status, out = post_json(encoder + "/v1/encode", body, headers=internal_headers())
    assert status == 200, out
    return out["items"]


def chat_body(media: Media, items: list[dict] | None = None, handles: list[dict] | None = None) -> dict:
    """A greedy chat request; with ``items`` each media part carries its epdserve uuid and the
    request the handles (``handles``, default: the items' own)."""
    parts: list[dict] = []
    for i, (modality, u) in enumerate(media):
        kind = "image_url" if modality == "image" else "video_url"
        part: dict = {"type": kind, kind: {"url": u}}
        if items is not None:
            part["uuid"] = items[i]["uuid"]
        parts.append(part)
    parts.append({"type": "text", "text": "Describe what you see."})
    body: dict = {
        "model": MODEL,
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 24,
        "temperature": 0.0,
        "logprobs": True,
    }
    if items is not None:
        body["ec_transfer_params"] = ec_transfer_params(
            handles if handles is not None else [i["ec_handle"] for i in items]
        )
    return body


def post_chat(url: str, body: dict) -> tuple[int, dict]:
    status, raw = http("POST", url + "/v1/chat/completions", json.dumps(body).encode(), timeout=300)
    return status, json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode(errors="replace")}


def chat(
    url: str, media: Media, items: list[dict] | None = None, handles: list[dict] | None = None
) -> tuple[int, dict]:
    return post_chat(url, chat_body(media, items, handles))


def tokens(resp: dict) -> list[str]:
    return [t["token"] for t in resp["choices"][0]["logprobs"]["content"]]


def live_handles(encoder: str) -> float:
    status, body = http("GET", encoder + "/metrics")
    assert status == 200
    for line in body.decode().splitlines():
        if line.startswith("epd_encoder_ec_live_handles "):
            return float(line.split()[1])
    raise AssertionError("the encoder exports no epd_encoder_ec_live_handles")


def wait_released(encoder: str, timeout: float = 30.0) -> float:
    """The encoder's live leases, once they reached 0 (or whatever is left after ``timeout``)."""
    t0 = time.time()
    while (n := live_handles(encoder)) and time.time() - t0 < timeout:
        time.sleep(0.2)
    return n


# --------------------------------------------------------------------------- servers


@contextmanager
def vllm_serve(model_dir: Path, ec_extra: dict | None = None) -> Iterator[str]:
    """``vllm serve`` of the embedded checkpoint (fp32, eager, CPU), with epdserve's connector
    when ``ec_extra`` is given; its whole process group is stopped afterwards."""
    port = free_port()
    cmd = launch.serve_command(
        str(Path(sys.executable).with_name("vllm")), str(model_dir), MODEL, "127.0.0.1", port,
        ec_extra, VLLM_ARGS, connector=ec_extra is not None,
    )  # fmt: skip
    rpc = tempfile.TemporaryDirectory(prefix=f"vllm-{port}-rpc-")  # the sockets vLLM leaves behind
    env = dict(os.environ, **VLLM_ENV, VLLM_RPC_BASE_PATH=rpc.name)
    log = tempfile.NamedTemporaryFile(prefix=f"vllm-{port}-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{Path(log.name).read_text()[-4000:]}")
            if time.time() - t0 > START_S:
                raise TimeoutError(
                    f"vllm serve not healthy after {START_S:.0f} s:\n{Path(log.name).read_text()[-4000:]}"
                )
            try:
                if http("GET", url + "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(1)
        yield url
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        rpc.cleanup()


@pytest.fixture(scope="module")
def encoder(model_dir: Path) -> Iterator[str]:
    with running(["encoder", "--model", str(model_dir), "--device", DEVICE, "--dtype", "float32"]) as url:
        yield url


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Iterator[str]:
    with vllm_serve(model_dir) as url:
        yield url


@pytest.fixture(scope="class")
def strict(model_dir: Path) -> Iterator[str]:
    """Local encoding forbidden (one class's instance: at most two vLLMs run at once)."""
    with vllm_serve(model_dir, {"local_encode": False}) as url:
        yield url


@pytest.fixture(scope="class")
def lenient(model_dir: Path) -> Iterator[str]:
    """Local encoding allowed (the default)."""
    with vllm_serve(model_dir, {}) as url:
        yield url


CASES: dict[str, Media] = {
    "image": [("image", image_url(1))],
    "multi-image": [("image", image_url(2)), ("image", image_url(3)), ("image", image_url(4))],
    "repeated-image": [("image", image_url(5)), ("image", image_url(6)), ("image", image_url(5))],
    "video": [("video", video_url(7))],
}


def test_the_installed_vllm_has_the_interface_the_connector_implements() -> None:
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase
    from vllm.v1.request import Request

    assert compat.interface_problems(ECConnectorBase, Request) == []


# --------------------------------------------------------------------------- local encoding forbidden


class TestEmbeddingsFromEpdserve:
    """``local_encode: false``: vLLM never runs its vision tower, so every answer it gives was
    computed from epdserve's embeddings."""

    @pytest.mark.parametrize("case", list(CASES))
    def test_greedy_answers_are_vllm_s(self, case: str, encoder: str, reference: str, strict: str) -> None:
        media = CASES[case]
        status, want = chat(reference, media)
        assert status == 200, want
        items = encode(encoder, media)
        status, got = chat(strict, media, items)
        assert status == 200, got
        assert tokens(got) == tokens(want)
        assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"]
        assert wait_released(encoder) == 0  # every lease given back after its read

    def test_answers_are_epdserve_s_own(self, model_dir: Path, encoder: str, strict: str) -> None:
        """The same requests through epdserve's own language model (aggregated): same greedy text."""
        with running(
            ["serve", "--model", str(model_dir), "--max-model-len", "2048", "--device", DEVICE, "--dtype", "float32"]
        ) as own:
            for case in ("image", "multi-image", "video"):
                media = CASES[case]
                status, want = chat(own, media)
                assert status == 200, want
                status, got = chat(strict, media, encode(encoder, media))
                assert status == 200, got
                assert got["choices"][0]["message"]["content"] == want["choices"][0]["message"]["content"], case

    def test_the_router_s_vllm_body(self, encoder: str, reference: str, strict: str) -> None:
        """``router.vllm_worker.vllm_body`` on a client's request with a client uuid and a raw part:
        vLLM answers it as the plain vLLM answers the client's own request."""
        media = CASES["multi-image"]
        status, want = chat(reference, media)
        assert status == 200, want
        client = chat_body(media)
        client["messages"][0]["content"][0]["uuid"] = "chosen-by-the-client"
        refs = media_refs(client)
        for r, item in zip(refs, encode(encoder, media), strict=True):
            r.result, r.encoder = msgspec.convert(item, EncodedItem), encoder
        refs[2].raw = True  # left to the worker: with local encoding forbidden, the request fails
        status, out = post_chat(strict, vllm_body(client, refs))
        assert status >= 500, out
        release(encoder, refs[2].result.ec_handle)
        refs = media_refs(client)
        for r, item in zip(refs, encode(encoder, media), strict=True):
            r.result = msgspec.convert(item, EncodedItem)
        status, out = post_chat(strict, vllm_body(client, refs))
        assert status == 200, out
        assert tokens(out) == tokens(want)
        assert wait_released(encoder) == 0

    def test_the_router_drives_vllm(self, encoder: str, reference: str, strict: str) -> None:
        """``epdserve router --pd-engine vllm``: media encoded on epdserve's encoder, answered by vLLM."""
        router = ["router", "--encoders", encoder, "--pds", strict, "--pd-engine", "vllm"]
        with running(router) as url:
            for case in ("multi-image", "video"):
                media = CASES[case]
                status, want = chat(reference, media)
                assert status == 200, want
                status, got = chat(url, media)
                assert status == 200, got
                assert tokens(got) == tokens(want), case
        assert wait_released(encoder) == 0

    def test_an_item_without_a_handle_fails_its_request_only(self, encoder: str, strict: str) -> None:
        media = [("image", image_url(11))]
        status, err = chat(strict, media)  # no handles at all
        assert status >= 500, err
        items = encode(encoder, media)
        forged = copy.deepcopy(items[0]["ec_handle"])
        forged["checksum"] = "0" * 16  # the MAC no longer verifies
        status, err = chat(strict, media, items, [forged])
        assert status >= 500, err
        release(encoder, items[0]["ec_handle"])
        status, ok = chat(strict, media, encode(encoder, media))  # the instance serves on
        assert status == 200, ok


# --------------------------------------------------------------------------- other connectors, the shared store


def counter(url: str, name: str) -> float:
    """A counter of a role's /metrics, summed over its labels, read as the operator."""
    status, raw = http("GET", url + "/metrics", headers=internal_headers())
    assert status == 200
    lines = raw.decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith((name + " ", name + "{")))


@pytest.mark.parametrize("connector", ["tcp", "mooncake"])
def test_a_connector_and_the_shared_store_reach_vllm(
    connector: str, model_dir: Path, reference: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """epdserve's router in front of a vLLM that never encodes, its encoder on the ``tcp``
    connector with a Redis store, or on ``mooncake`` with a Mooncake store: the media of a request
    reach vLLM through the connector, and the same request again reaches it as the store's entries
    (the router's directory hands vLLM their store handles; no encode call). Greedy answers are the
    plain vLLM's both times, and every lease is given back."""
    from epdserve.store.mooncake_master import master_binary, start_master
    from tests.redis_server import redis_server

    with contextlib.ExitStack() as stack:
        if connector == "tcp":
            server = stack.enter_context(redis_server())
            monkeypatch.setenv("EPD_STORE_PASSWORD", server.password)  # the encoder's and vLLM's
            store_url, extra = server.url, ["--ec-tcp-port", str(free_port())]
        else:
            if master_binary() is None:
                pytest.skip("no mooncake_master: pip install -e '.[mooncake]'")
            master = start_master()
            stack.callback(master.stop)
            store_url, extra = master.url, []
        named = ["--model", str(model_dir), "--device", DEVICE, "--dtype", "float32"]
        enc = stack.enter_context(
            running(["encoder", *named, "--ec-connector", connector, *extra, "--store-url", store_url])
        )
        strict = stack.enter_context(vllm_serve(model_dir, {"local_encode": False, "store_url": store_url}))
        url = stack.enter_context(running(["router", "--encoders", enc, "--pds", strict, "--pd-engine", "vllm"]))
        for case in ("multi-image", "video"):
            media = CASES[case]
            status, want = chat(reference, media)
            assert status == 200, want
            for attempt in ("encoded", "from the store"):
                status, got = chat(url, media)
                assert status == 200, (case, attempt, got)
                assert tokens(got) == tokens(want), (case, attempt)
        distinct = len(CASES["multi-image"]) + len(CASES["video"])
        assert counter(url, "epd_router_directory_hits_total") >= distinct  # every repeat from the store
        assert counter(enc, "epd_encoder_items_total") <= distinct + 1  # encoded once (a lost race aside)
        assert wait_released(enc) == 0


# --------------------------------------------------------------------------- local encoding allowed


class TestFallback:
    """``local_encode: true`` (the default): an item whose handle cannot be used is encoded by
    vLLM itself, and the answer is exactly vLLM's."""

    def test_handles_are_used_and_released(self, encoder: str, reference: str, lenient: str) -> None:
        media = CASES["multi-image"]
        status, want = chat(reference, media)
        assert status == 200
        status, got = chat(lenient, media, encode(encoder, media))
        assert status == 200 and tokens(got) == tokens(want)
        assert wait_released(encoder) == 0

    @pytest.mark.parametrize("damage", ["forged", "released", "wrong-rows"])
    def test_a_bad_handle_is_encoded_locally(self, damage: str, encoder: str, reference: str, lenient: str) -> None:
        seed = {"forged": 21, "released": 22, "wrong-rows": 23}[damage]
        media = [("image", image_url(seed))]  # fresh content: nothing of it is cached in vLLM yet
        status, want = chat(reference, media)
        assert status == 200
        items = encode(encoder, media)
        handle = items[0]["ec_handle"]
        if damage == "forged":
            handle = {**handle, "model_id": "another-model"}  # altered: the MAC fails
        elif damage == "released":
            release(encoder, handle)
        elif damage == "wrong-rows":
            # a validly signed handle of an image of another size, under its own key: the rows
            # vLLM's placeholders need do not match, so it must not be used
            other = next(
                it
                for s in range(100, 140)
                for it in encode(encoder, [("image", image_url(s))])
                if it["num_embeddings"] != items[0]["num_embeddings"] or release(encoder, it["ec_handle"])
            )
            release(encoder, handle)
            handle, items = other["ec_handle"], [{**items[0], "uuid": other["uuid"]}]
        status, got = chat(lenient, media, items, [handle])
        assert status == 200, got
        assert tokens(got) == tokens(want)
        if damage == "forged":
            release(encoder, items[0]["ec_handle"])  # what the router does with a lease the worker refused
        assert wait_released(encoder) == 0


# --------------------------------------------------------------------------- Qwen3-VL (DeepStack)


class TestDeepStack:
    """Qwen3-VL's embeddings hold its DeepStack feature levels side by side (the merger's output,
    then each tap's in order), which vLLM splits to feed its first layers: read in another order,
    every answer would change. A tiny Qwen3-VL checkpoint of transformers' own architecture."""

    @pytest.fixture(scope="class")
    def qwen3(self, tmp_path_factory: pytest.TempPathFactory) -> Path:
        from tests.checkpoints import build

        return build("qwen3_vl", tmp_path_factory.mktemp("qwen3-vl") / "tiny-qwen3-vl")

    def test_vllm_fed_by_epdserve_answers_as_epdserve_and_as_vllm(self, qwen3: Path) -> None:
        named = ["--model", str(qwen3), "--served-model-name", MODEL, "--device", DEVICE, "--dtype", "float32"]

        def answers(reference: str, fed: str, enc: str, case: str) -> tuple[dict, dict]:
            """The reference's answer to ``case``, and the one vLLM gives fed by the encoder."""
            media = CASES[case]
            status, want = chat(reference, media)
            assert status == 200, want
            status, got = chat(fed, media, encode(enc, media))
            assert status == 200, got
            return want, got

        with running(["encoder", *named]) as enc, vllm_serve(qwen3, {"local_encode": False}) as strict_q3:
            with running(["serve", *named, "--max-model-len", "2048"]) as own:
                for case in ("image", "multi-image"):
                    want, got = answers(own, strict_q3, enc, case)
                    # a random model may end on part of a UTF-8 sequence: epdserve shows it as U+FFFD,
                    # vLLM holds it back; the text before it is the comparison
                    ours, theirs = (r["choices"][0]["message"]["content"] for r in (want, got))
                    assert theirs.rstrip("\ufffd") == ours.rstrip("\ufffd") and ours, case
            with vllm_serve(qwen3) as plain:
                for case in ("image", "multi-image"):
                    want, got = answers(plain, strict_q3, enc, case)
                    assert tokens(got) == tokens(want), case
            assert wait_released(enc) == 0


def release(encoder: str, handle: dict) -> bool:
    """Give a lease back as the router does (False, so it reads as a filter's no)."""
    body = {"version": ENCODER_PROTOCOL_VERSION, "handles": [handle]}
    status, out = post_json(encoder + "/v1/release", body, headers=internal_headers())
    assert status == 200, out
    return False
