"""The hostile media corpus (tests/corpus/media) against a real deployment: every file gets a 200
or its 4xx within its decode budget, whichever role decodes it, and the deployment goes on serving
normal image requests with every encoder healthy.

Real processes on loopback: two encoders, a language-model worker with its own vision tower, and
three routers over them: one that sends media to the encoders, one that decodes media itself
(``--frontend-decode``) and one that lets the worker decode some (``--dispatch adaptive``). The
worker is also called directly (its aggregated media path)."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from subprocess import Popen

import pytest

from epdserve.bench.workload import image_data_url
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.media.errors import InvalidMedia, MediaError, MediaTooLarge
from epdserve.media.limits import MediaLimits
from epdserve.shapes import ShapesWorld
from tests.server_utils import http
from tests.test_media_budget import CORPUS, EXPECTED

MODEL = "shapes-qwen2vl"
ADMIN_KEY = "test-admin-key-media-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
PD_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "256"]
BUDGET_S = MediaLimits().decode_timeout_s + 20  # a decode's budget, and generous room for a loaded machine
STATUS: dict[type[MediaError] | None, int] = {None: 200, InvalidMedia: 400, MediaTooLarge: 413}


@dataclass
class Deployment:
    routers: dict[str, str]  # how it decodes media → its URL
    encoders: list[str]
    pd: str


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    procs: list[Popen] = []
    try:
        encoders = []
        for _ in range(2):
            port = free_port()
            procs.append(start_role(["encoder", "--port", str(port)]))
            encoders.append(f"http://127.0.0.1:{port}")
        pd_port = free_port()
        procs.append(start_role(["serve", "--port", str(pd_port), *PD_ARGS]))
        pd = f"http://127.0.0.1:{pd_port}"
        for url, proc in zip([*encoders, pd], procs, strict=True):
            wait_healthy(url, proc)
        routers = {}
        for name, extra in (
            ("encoders", []),
            ("frontend", ["--frontend-decode"]),
            ("adaptive", ["--dispatch", "adaptive"]),
        ):
            port = free_port()
            args = ["router", "--port", str(port), "--encoders", *encoders, "--pds", pd, "--probe-interval", "0.5"]
            procs.append(start_role([*args, *extra], env={"EPD_ADMIN_KEY": ADMIN_KEY}))
            routers[name] = f"http://127.0.0.1:{port}"
            wait_healthy(routers[name], procs[-1])
        yield Deployment(routers, encoders, pd)
    finally:
        for p in reversed(procs):
            stop(p)


def chat(part: dict) -> bytes:
    content = [part, {"type": "text", "text": "Describe it."}]
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()


def media_part(modality: str, data: bytes) -> dict:
    url = "data:application/octet-stream;base64," + base64.b64encode(data).decode()
    return {"type": f"{modality}_url", f"{modality}_url": {"url": url}}


def normal_image(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": image_data_url(ShapesWorld(seed).scene().render())}}


def encoders_healthy(d: Deployment) -> bool:
    for url in d.routers.values():
        status, body = http("GET", url + "/v1/workers", headers=ADMIN)
        assert status == 200, body
        if not all(w["healthy"] for w in json.loads(body)["encoders"]):
            return False
    return True


CASES = [(name, modality) for name in sorted(EXPECTED) for modality in EXPECTED[name] if modality != "audio"]


@pytest.mark.parametrize("via", ["encoders", "frontend", "adaptive", "worker"])
def test_every_corpus_file_gets_its_answer_within_budget(deployment: Deployment, via: str) -> None:
    url = deployment.pd if via == "worker" else deployment.routers[via]
    wrong = []
    for name, modality in CASES:
        t0 = time.monotonic()
        status, body = http(
            "POST", url + "/v1/chat/completions", chat(media_part(modality, (CORPUS / name).read_bytes()))
        )
        took = time.monotonic() - t0
        want = STATUS[EXPECTED[name][modality]]
        error = json.loads(body).get("error") if status != 200 else None
        if status != want or took > BUDGET_S or (error is not None and not error.get("code")):
            wrong.append((name, modality, status, round(took, 1), body[:200]))
    assert not wrong, wrong
    assert encoders_healthy(deployment)
    status, body = http("POST", url + "/v1/chat/completions", chat(normal_image(7)))
    assert status == 200, body


def test_a_stream_of_malformed_files_does_not_take_encoders_out(deployment: Deployment) -> None:
    """Truncated GIFs sent as videos, the formats no client sends, over and over, while others
    send normal images: the bad requests fail alone, the normal ones are served."""
    url = deployment.routers["encoders"] + "/v1/chat/completions"
    bad = [
        chat(media_part("video", (CORPUS / "gif_truncated_index_error.gif").read_bytes())),
        chat(media_part("video", (CORPUS / "gif_truncated_struct_error.gif").read_bytes())),
        chat(media_part("image", (CORPUS / "dds_32x32.dds").read_bytes())),
    ]

    def attack(i: int) -> int:
        return http("POST", url, bad[i % len(bad)])[0]

    def normal(i: int) -> int:
        return http("POST", url, chat(normal_image(100 + i)))[0]

    with ThreadPoolExecutor(4) as pool:
        attacks = pool.map(attack, range(30))
        normals = pool.map(normal, range(10))
        assert set(attacks) == {400}
        assert set(normals) == {200}
    assert encoders_healthy(deployment)
    for enc in deployment.encoders:
        assert http("GET", enc + "/health")[0] == 200


def encoder_batches(d: Deployment) -> float:
    """Vision forwards the encoders have run, all of them together."""
    total = 0.0
    for url in d.encoders:
        status, body = http("GET", url + "/metrics")
        assert status == 200
        total += sum(
            float(line.split()[-1])
            for line in body.decode().splitlines()
            if line.startswith("epd_encoder_batches_total ")
        )
    return total


@pytest.mark.parametrize("via", ["encoders", "frontend", "adaptive", "worker"])
def test_media_the_prompt_cannot_hold_is_refused_before_it_is_encoded(deployment: Deployment, via: str) -> None:
    """New images whose placeholders alone leave no room for the completion asked for: every path
    answers as the worker would, 400 context_length_exceeded, and no encoder runs its vision tower
    for them; with a smaller completion the same images are served."""
    url = (deployment.pd if via == "worker" else deployment.routers[via]) + "/v1/chat/completions"
    seed = {"encoders": 200, "frontend": 210, "adaptive": 220, "worker": 230}[via]
    content = [normal_image(seed + i) for i in range(4)] + [{"type": "text", "text": "Compare them."}]

    def ask(max_tokens: int) -> tuple[int, dict]:
        body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        status, raw = http("POST", url, json.dumps(body).encode())
        return status, json.loads(raw)

    context = int(PD_ARGS[PD_ARGS.index("--max-model-len") + 1])
    batches = encoder_batches(deployment)
    status, body = ask(context - 8)  # four images hold at least 4 x 12 placeholders
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert encoder_batches(deployment) == batches
    status, body = ask(4)
    assert status == 200, body
