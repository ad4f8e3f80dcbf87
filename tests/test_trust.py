"""Issue 13, as an attacker and an operator would try it: credentials on every surface, handles a
client cannot forge, resources that cheap bad requests cannot pin, and honest failures.

One E+PD stack of real processes on loopback: an encoder with a deliberately small slab, a PD
worker that serves only callers with the cluster credential, and a router with an API key."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from subprocess import Popen

import openai
import pytest

from epdserve.bench.workload import image_data_url
from epdserve.encoder.protocol import ENCODER_PROTOCOL_VERSION
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.security import peers
from epdserve.security.credentials import ClusterCredential
from epdserve.shapes import ShapesWorld
from epdserve.transfer.config import ECConfig
from epdserve.transfer.factory import make_consumer
from epdserve.transfer.signing import sign
from tests.server_utils import http, internal_headers, wait_until

MODEL = "shapes-qwen2vl"
API_KEY = "sk-test-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PD_ARGS = ["--max-model-len", "1024", "--num-kv-blocks", "256"]
SLAB = 1 << 20  # a few dozen images' embeddings: easy to fill on purpose


@dataclass
class Stack:
    router: str
    encoder: str
    pd: str
    pd_proc: Popen

    def metric(self, url: str, name: str) -> float:
        m = re.search(rf"^{re.escape(name)} (\S+)$", http("GET", url + "/metrics")[1].decode(), re.MULTILINE)
        assert m is not None, f"{name} not in {url}/metrics"
        return float(m.group(1))


def start_stack() -> tuple[Stack, list[Popen]]:
    enc_port, pd_port, port = free_port(), free_port(), free_port()
    procs = [
        start_role(["encoder", "--port", str(enc_port), "--ec-shm-bytes", str(SLAB)]),
        start_role(["serve", "--port", str(pd_port), "--no-vision-tower", "--internal-only", *PD_ARGS]),
    ]
    stack = Stack(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{enc_port}", f"http://127.0.0.1:{pd_port}", procs[1])
    try:
        wait_healthy(stack.encoder, procs[0])
        wait_healthy(stack.pd, procs[1])
        args = ["router", "--port", str(port), "--encoders", stack.encoder, "--pds", stack.pd]
        procs.append(start_role([*args, "--probe-interval", "0.5"], env={"EPD_API_KEY": API_KEY}))
        wait_healthy(stack.router, procs[2])
    except BaseException:
        for p in procs:
            stop(p)
        raise
    return stack, procs


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    s, procs = start_stack()
    try:
        yield s
    finally:
        for p in reversed(procs):
            stop(p)


def image(seed: int) -> dict:
    return {"type": "image_url", "image_url": {"url": image_data_url(ShapesWorld(seed).scene().render())}}


def chat(parts: list[dict], **extra: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 8, **extra}


def post(url: str, body: dict, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    status, raw = http("POST", url, json.dumps(body).encode(), headers=headers)
    return status, json.loads(raw)


def encode(stack: Stack, seeds: list[int]) -> tuple[int, dict]:
    items = [{"modality": "image", "url": image(s)["image_url"]["url"]} for s in seeds]
    return post(
        stack.encoder + "/v1/encode",
        {"version": ENCODER_PROTOCOL_VERSION, "model": MODEL, "items": items},
        internal_headers(),
    )


def embeds_chat(item: dict, handle: dict | None = None, before: str = "") -> dict:
    """A chat with the item as metadata; ``before``: text ahead of it (a prefix no cache holds)."""
    part = {
        "type": "image_embeds",
        "image_embeds": {"image_grid_thw": item["grid_thw"]},
        "uuid": item["uuid"],
        "ec_handle": item["ec_handle"] if handle is None else handle,
    }
    lead = [{"type": "text", "text": before}] if before else []
    return chat([*lead, part, {"type": "text", "text": "Describe the image."}])


# ---------------------------------------------------------------------------- who may call what


def test_public_api_needs_the_api_key(stack: Stack) -> None:
    body = chat([{"type": "text", "text": "hi"}])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        status, err = post(stack.router + "/v1/chat/completions", body, headers)
        assert status == 401 and err["error"]["code"] == "invalid_api_key", err
    assert http("GET", stack.router + "/v1/models")[0] == 401
    # probes and scrapers need no key
    assert http("GET", stack.router + "/health")[0] == 200
    assert http("GET", stack.router + "/metrics")[0] == 200
    # the official client with the key
    c = openai.OpenAI(base_url=stack.router + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [image(1), {"type": "text", "text": "Describe the image."}]}],
        temperature=0,
    )  # type: ignore[list-item]
    assert r.choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.router + "/v1", api_key="nope", max_retries=0).models.list()


def test_internal_surfaces_refuse_callers_without_the_cluster_credential(stack: Stack) -> None:
    items = {
        "version": ENCODER_PROTOCOL_VERSION,
        "model": MODEL,
        "items": [{"modality": "image", "url": image(2)["image_url"]["url"]}],
    }
    text = chat([{"type": "text", "text": "hi"}])
    wrong = peers.sign(ClusterCredential.generate(), "POST", stack.encoder + "/v1/encode", b"{}")
    for headers in ({}, wrong, AUTH):
        for url, body in ((stack.encoder + "/v1/encode", items), (stack.encoder + "/v1/release", {"handles": []})):
            status, err = post(url, body, headers)
            assert status == 401 and err["error"]["code"] == "invalid_api_key", (url, err)
        # the PD worker behind the router serves only the router
        status, err = post(stack.pd + "/v1/chat/completions", text, headers)
        assert status == 401, err
        status, _ = http("GET", stack.pd + "/v1/kv/digest", headers=headers)
        assert status == 401
    assert post(stack.pd + "/v1/chat/completions", text, internal_headers())[0] == 200
    status, digest = http("GET", stack.pd + "/v1/kv/digest", headers=internal_headers())
    assert status == 200 and json.loads(digest)["block_size"] > 0


# ---------------------------------------------------------------------------- handles


def test_a_client_never_gets_to_name_a_handle(stack: Stack) -> None:
    status, out = encode(stack, [3])
    assert status == 200, out
    (victim,) = out["items"]
    # through the public endpoint, even a real, valid handle is refused before anything acts on it
    status, err = post(stack.router + "/v1/chat/completions", embeds_chat(victim), AUTH)
    assert status == 400 and "not accepted" in err["error"]["message"], err
    assert "/dev/shm" not in json.dumps(err)
    # the victim's lease is untouched: the router's own internal call still uses it
    status, ok = post(stack.pd + "/v1/chat/completions", embeds_chat(victim), internal_headers())
    assert status == 200, ok


def test_forged_foreign_tampered_and_replayed_handles_are_refused(stack: Stack) -> None:
    status, out = encode(stack, [4])
    assert status == 200, out
    (victim,) = out["items"]
    handle = victim["ec_handle"]
    foreign_key = ClusterCredential.generate().derive("ec-handle")
    forgeries = {
        "unsigned": {k: v for k, v in handle.items() if k != "mac"},
        "tampered offset": {**handle, "offset": handle["offset"] + 64},
        "tampered lease": {**handle, "lease": "f" * 32},
        "tampered path": {**handle, "path": "/etc/passwd"},
        "foreign": sign({k: v for k, v in handle.items() if k != "mac"}, foreign_key),
        "tcp to anywhere": sign({**handle, "connector": "tcp", "host": "127.0.0.1", "port": 22}, foreign_key),
    }
    for name, forged in forgeries.items():
        status, err = post(stack.pd + "/v1/chat/completions", embeds_chat(victim, forged), internal_headers())
        assert status == 400, (name, err)
        assert "/dev/shm" not in json.dumps(err) and "/etc" not in json.dumps(err), (name, err)
    # none of it touched the victim's embeddings: the genuine handle still works, exactly once
    status, ok = post(stack.pd + "/v1/chat/completions", embeds_chat(victim), internal_headers())
    assert status == 200, ok
    # replayed where the embeddings must be read (a prefix nothing cached): the lease was released
    replay = embeds_chat(victim, before="Look at this.")
    status, err = post(stack.pd + "/v1/chat/completions", replay, internal_headers())
    assert 400 <= status < 500 or status == 503, err
    assert err["error"]["message"] and "/dev/shm" not in json.dumps(err)
    # the failed read is counted, by its cause
    causes = {
        c: stack.metric(stack.pd, f'epd_ec_failures_total{{cause="{c}"}}') for c in ("invalid_handle", "unavailable")
    }
    assert causes["invalid_handle" if status == 400 else "unavailable"] >= 1, causes
    # where the worker has the image's KV cached it reads nothing, yet a forged handle is still refused
    for name, forged in forgeries.items():
        status, err = post(stack.pd + "/v1/chat/completions", embeds_chat(victim, forged), internal_headers())
        assert status == 400, (name, err)


# ---------------------------------------------------------------------------- bounded resources


def test_cheap_rejected_image_requests_hold_nothing(stack: Stack) -> None:
    url = stack.router + "/v1/chat/completions"
    encodes = stack.metric(stack.encoder, "epd_encode_requests_total")
    # invalid sampling parameters: refused before any encoder works on them
    for i in range(50):
        status, err = post(url, chat([image(1000 + i)], temperature=5.0), AUTH)
        assert status == 400 and err["error"]["param"] == "temperature"
    status, err = post(url, {**chat([image(1)]), "model": "no-such-model"}, AUTH)
    assert status == 404 and err["error"]["code"] == "model_not_found"
    assert stack.metric(stack.encoder, "epd_encode_requests_total") == encodes
    # refused by the PD worker after the encode (a template argument only the PD checks): the
    # router gives the leases back at once, so a flood cannot fill the slab
    bad = {"add_generation_prompt": False}
    for i in range(60):  # more images than the slab holds
        status, err = post(url, chat([image(2000 + i)], chat_template_kwargs=bad), AUTH)
        assert status == 400, err
    assert wait_until(lambda: stack.metric(stack.encoder, "epd_encoder_ec_live_handles") == 0, 5)
    assert stack.metric(stack.encoder, "epd_encoder_ec_held_bytes") == 0
    status, ok = post(url, chat([image(3000), {"type": "text", "text": "Describe the image."}]), AUTH)
    assert status == 200, ok


def test_full_slab_is_a_429_not_an_outage(stack: Stack) -> None:
    held: list[dict] = []
    seed = 5000
    status = 200
    while status == 200 and len(held) < 500:
        seed += 1
        status, out = encode(stack, [seed])
        if status == 200:
            held += [it["ec_handle"] for it in out["items"]]
    assert status == 429, out
    assert held, "the slab took nothing"
    # the encoder stays healthy and the router says "retry later", with Retry-After
    assert http("GET", stack.encoder + "/health")[0] == 200
    req = urllib.request.Request(
        stack.router + "/v1/chat/completions",
        data=json.dumps(chat([image(seed)])).encode(),  # the image that did not fit
        headers={"Content-Type": "application/json", **AUTH},
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == 429 and e.value.headers["Retry-After"] == "1"
    assert http("GET", stack.router + "/health")[0] == 200
    # text never needed the encoder
    status, ok = post(stack.router + "/v1/chat/completions", chat([{"type": "text", "text": "hi"}]), AUTH)
    assert status == 200, ok
    # giving the leases back empties the slab, and images work again
    status, out = post(stack.encoder + "/v1/release", {"handles": held}, internal_headers())
    assert status == 200 and out["released"] == len(held)
    assert stack.metric(stack.encoder, "epd_encoder_ec_live_handles") == 0
    status, ok = post(stack.router + "/v1/chat/completions", chat([image(seed + 11)]), AUTH)
    assert status == 200, ok


def test_cache_hits_share_one_stored_copy(stack: Stack) -> None:
    before = stack.metric(stack.encoder, "epd_encoder_ec_held_bytes")
    status, first = encode(stack, [7000])
    assert status == 200
    one = stack.metric(stack.encoder, "epd_encoder_ec_held_bytes") - before
    assert one > 0
    handles = [first["items"][0]["ec_handle"]]
    for _ in range(5):
        status, again = encode(stack, [7000])
        assert status == 200 and again["items"][0]["status"] == "cache_hit"
        handles.append(again["items"][0]["ec_handle"])
    assert stack.metric(stack.encoder, "epd_encoder_ec_held_bytes") - before == one
    assert len({h["lease"] for h in handles}) == 6  # six leases on one stored copy
    status, out = post(stack.encoder + "/v1/release", {"handles": handles}, internal_headers())
    assert status == 200 and out["released"] == 6
    assert stack.metric(stack.encoder, "epd_encoder_ec_held_bytes") == before


def test_huge_prompts_do_not_stall_other_requests(stack: Stack) -> None:
    url = stack.router + "/v1/chat/completions"
    huge = chat([{"type": "text", "text": "x" * (30 << 20)}])
    results: list[int] = []

    def normal(i: int) -> int:
        return post(url, chat([{"type": "text", "text": f"hi {i}"}]), AUTH)[0]

    rss = _rss_kb(stack.pd_proc.pid)
    with ThreadPoolExecutor(4) as pool:
        t0 = time.monotonic()
        attacks = [pool.submit(post, url, huge, AUTH) for _ in range(2)]
        results = [normal(i) for i in range(4)]
        took = time.monotonic() - t0
        codes = [a.result()[0] for a in attacks]
    assert codes == [413, 413]
    assert results == [200] * 4 and took < 30
    # a prompt under the character bound but over the context is refused by the worker, not run
    status, err = post(url, chat([{"type": "text", "text": "shape " * 100_000}]), AUTH)
    assert status == 400 and "context length" in err["error"]["message"]
    assert _rss_kb(stack.pd_proc.pid) - rss < 300_000  # the worker did not balloon


def _rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


# ---------------------------------------------------------------------------- honest failure


def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error() -> None:
    stack, procs = start_stack()
    try:
        body = chat([{"type": "text", "text": "Describe the image."}], stream=True)
        body.update(max_tokens=900, min_tokens=900, ignore_eos=True)
        req = urllib.request.Request(
            stack.router + "/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **AUTH},
        )
        events: list[str] = []
        with urllib.request.urlopen(req, timeout=120) as r:
            assert r.status == 200
            killed = False
            for raw in r:
                line = raw.decode().strip()
                if line.startswith("data: "):
                    events.append(line[6:])
                if not killed and len(events) >= 3:
                    os.kill(stack.pd_proc.pid, signal.SIGKILL)
                    killed = True
        assert killed and events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert error["error"]["code"] == "worker_failed" and error["error"]["message"]
        assert not any('"finish_reason":"length"' in e for e in events)
        # the official client sees an error, not a short answer
        stack.pd_proc.wait()
        c = openai.OpenAI(base_url=stack.router + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
        assert e.value.status_code in (502, 503)
    finally:
        for p in reversed(procs):
            stop(p)


def test_a_client_leaving_before_the_answer_releases_its_embeddings(stack: Stack) -> None:
    async def leave() -> None:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            body = chat([image(8000 + i) for i in range(4)] + [{"type": "text", "text": "Describe the image."}])
            with contextlib.suppress(TimeoutError):
                await s.post(
                    stack.router + "/v1/chat/completions",
                    json=body,
                    headers=AUTH,
                    timeout=aiohttp.ClientTimeout(total=0.05),
                )

    held = stack.metric(stack.encoder, "epd_encoder_ec_live_handles")
    for _ in range(5):
        asyncio.run(leave())
    assert wait_until(lambda: stack.metric(stack.encoder, "epd_encoder_ec_live_handles") == held, 10)


def test_consumer_with_another_secret_refuses_our_handles(stack: Stack) -> None:
    status, out = encode(stack, [9000])
    assert status == 200
    (item,) = out["items"]

    async def read(secret: str) -> str:
        consumer = make_consumer(ECConfig(secret=secret))
        try:
            await consumer.get(item["ec_handle"], *item["shape"], MODEL)
            return "read"
        except Exception as e:
            return type(e).__name__
        finally:
            await consumer.close()

    assert asyncio.run(read(ClusterCredential.generate().secret.decode())) == "InvalidHandle"
    assert asyncio.run(read(os.environ["EPD_CLUSTER_SECRET"])) == "read"
