"""The aggregated server as a real process on loopback, driven by the official openai client."""

from __future__ import annotations

import base64
import io
import json
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from PIL import Image

from epdserve.bench.workload import gif_data_url
from epdserve.bench.workload import image_data_url as data_url
from epdserve.hf_reference import HFReference
from epdserve.shapes import ShapesWorld, render_images
from tests.server_utils import device_args, http, post_json, running

MODEL = "shapes-qwen2vl"


@pytest.fixture(scope="module")
def server() -> str:
    with running(["serve", *device_args(), "--max-model-len", "1024", "--num-kv-blocks", "256"]) as url:
        yield url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


def image_message(question: str, images: list[Image.Image]) -> list[dict]:
    parts: list[dict] = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": question}]}]


def test_models_and_health(server: str, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert http("GET", server + "/health")[0] == 200


def test_image_answer_matches_transformers(client: openai.OpenAI, model_dir: Path) -> None:
    ref = HFReference(model_dir)
    world = ShapesWorld(31)
    for qtype in ("describe", "where_is", "describe_nth"):
        s = world.sample(qtype)
        images = render_images(s)
        r = client.chat.completions.create(model=MODEL, messages=image_message(s.question, images), temperature=0)
        assert r.choices[0].message.content == ref.answer(s.question, images=images)
        assert r.choices[0].finish_reason == "stop"
        assert r.usage is not None and r.usage.prompt_tokens > 20 and r.usage.completion_tokens >= 1


def test_chat_template_kwargs_reach_the_template(client: openai.OpenAI, hf: HFReference) -> None:
    """The template numbers images ("Picture 2: ") unless add_vision_id=False is passed through."""
    s = ShapesWorld(8).sample("describe_nth")
    images = render_images(s)
    messages = image_message(s.question, images)
    named = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=0, extra_body={"chat_template_kwargs": {"add_vision_id": False}}
    )
    hf_messages = [{"role": "user", "content": [*({"type": "image"} for _ in images), {"type": "text", "text": "q"}]}]
    n_named, n_plain = (
        len(
            hf.tok(
                hf.tok.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False, add_vision_id=v)
            )["input_ids"]
        )
        for v in (True, False)
    )
    assert named.usage is not None and plain.usage is not None
    assert named.usage.prompt_tokens - plain.usage.prompt_tokens == n_named - n_plain > 0
    assert named.choices[0].message.content == hf.answer(s.question, images=images)


def test_video_gif_answer_matches_transformers(client: openai.OpenAI, model_dir: Path) -> None:
    ref = HFReference(model_dir)
    s = ShapesWorld(5).sample("direction")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "video_url", "video_url": {"url": gif_data_url(s.frames)}},
                {"type": "text", "text": s.question},
            ],
        }
    ]
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    # GIF stores a palette; decode the same GIF for the reference
    gif = Image.open(io.BytesIO(base64.b64decode(gif_data_url(s.frames).split(",", 1)[1])))
    frames = []
    for i in range(gif.n_frames):
        gif.seek(i)
        frames.append(gif.convert("RGB"))
    assert r.choices[0].message.content == ref.answer(s.question, video=frames)


def test_streaming_equals_non_streaming_and_reports_usage(client: openai.OpenAI) -> None:
    s = ShapesWorld(8).sample("describe")
    msgs = image_message(s.question, render_images(s))
    full = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=20)
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, temperature=0, max_tokens=20, stream=True, stream_options={"include_usage": True}
    )
    text, finish, usage = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text == full.choices[0].message.content
    assert finish == full.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_sixteen_concurrent_requests(client: openai.OpenAI) -> None:
    world = ShapesWorld(77)
    samples = [world.sample(q) for q in ["describe", "shape", "color", "where"] * 4]

    def ask(s) -> str:
        r = client.chat.completions.create(
            model=MODEL, messages=image_message(s.question, render_images(s)), temperature=0
        )
        return r.choices[0].message.content or ""

    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(ask, samples))
    alone = [ask(s) for s in samples[:4]]
    assert together[:4] == alone  # batching does not change greedy output
    assert all(together)


def test_sampling_controls(client: openai.OpenAI) -> None:
    msgs = [{"role": "user", "content": "Describe the image."}]
    r = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=7, temperature=0, extra_body={"min_tokens": 7, "ignore_eos": True}
    )
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    a = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=1.0, seed=123)
    b = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=1.0, seed=123)
    assert a.choices[0].message.content == b.choices[0].message.content
    s = ShapesWorld(3).sample("describe")
    full = client.chat.completions.create(
        model=MODEL, messages=image_message(s.question, render_images(s)), temperature=0
    )
    text = full.choices[0].message.content or ""
    cut = text.split(" ")[2]
    stopped = client.chat.completions.create(
        model=MODEL, messages=image_message(s.question, render_images(s)), temperature=0, stop=[" " + cut]
    )
    assert stopped.choices[0].message.content == text[: text.index(" " + cut)]
    assert stopped.choices[0].finish_reason == "stop"


def _png_bomb(side: int) -> str:
    # a valid PNG header claiming side x side pixels with a tiny body: refused before decoding
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    ihdr = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    raw = (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(raw).decode()


def _img_req(url: str, **extra: object) -> dict:
    return {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Describe the image."},
                ],
            }
        ],
        **extra,
    }


BLUE_DOT = data_url(Image.new("RGB", (56, 56), (40, 80, 220)))

BAD_REQUESTS = [
    ("malformed json", b"{not json", 400),
    ("unknown model", {"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404),
    ("missing messages", {"model": MODEL}, 400),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("bad base64", _img_req("data:image/png;base64,!!!notbase64!!!"), 400),
    ("not an image", _img_req("data:image/png;base64," + base64.b64encode(b"hello world, not a png").decode()), 400),
    ("decompression bomb", _img_req(_png_bomb(30000)), 413),
    (
        "too many images",
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}] * 9,
                }
            ],
        },
        400,
    ),
    ("prompt too long", {"model": MODEL, "messages": [{"role": "user", "content": "circle " * 2000}]}, 400),
    ("temperature", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400),
    ("top_p", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400),
    ("max_tokens", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400),
    ("n", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400),
    ("template kwargs override", _img_req(BLUE_DOT, chat_template_kwargs={"add_generation_prompt": False}), 400),
    ("template kwargs type", _img_req(BLUE_DOT, chat_template_kwargs=["add_vision_id"]), 400),
    ("private url", _img_req("http://127.0.0.1:9/x.png"), 400),
    ("file url", _img_req("file:///etc/passwd"), 400),
    (
        "audio to a vision model",
        {
            "model": MODEL,
            "messages": [
                {"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "AA==", "format": "wav"}}]}
            ],
        },
        400,
    ),
]


@pytest.mark.parametrize("name,payload,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_clear_error_and_server_keeps_serving(
    server: str, client: openai.OpenAI, name: str, payload: object, status: int
) -> None:
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    got, raw = http("POST", server + "/v1/chat/completions", body)
    assert got == status, raw
    err = json.loads(raw)["error"]
    assert err["message"] and err["type"]
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_oversized_image(server: str) -> None:
    big = Image.new("RGB", (5000, 4000), (10, 20, 30))
    status, body = post_json(server + "/v1/chat/completions", _img_req(data_url(big, "JPEG")))
    assert status == 413, body


def _metric(server: str, name: str) -> float:
    text = http("GET", server + "/metrics")[1].decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_client_disconnect_cancels_the_request(server: str) -> None:
    import socket
    import time

    host, port = server.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Describe the image."}],
            "max_tokens": 900,
            "min_tokens": 900,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    with socket.create_connection((host, int(port))) as sock:
        head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        seen = b""
        while b"data:" not in seen:
            chunk = sock.recv(4096)
            assert chunk, "stream ended before the first event"
            seen += chunk
    # the engine notices the closed stream and frees the request's blocks
    deadline = time.time() + 30
    while time.time() < deadline and _metric(server, "epd_num_requests_running") > 0:
        time.sleep(0.1)
    assert _metric(server, "epd_num_requests_running") == 0
    assert _metric(server, "epd_kv_blocks_free") == 256


def test_http_image_url_fetched_with_private_addresses_allowed(model_dir: Path) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    s = ShapesWorld(44).sample("shape")
    buf = io.BytesIO()
    render_images(s)[0].save(buf, format="PNG")
    png = buf.getvalue()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(png)))
            self.end_headers()
            self.wfile.write(png)

        def log_message(self, *args: object) -> None:
            pass

    media = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=media.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{media.server_address[1]}/shape.png"
    try:
        with running(["serve", "--allow-private-media", "--max-model-len", "512", "--num-kv-blocks", "64"]) as srv:
            c = openai.OpenAI(base_url=srv + "/v1", api_key="none", max_retries=0)
            msgs = [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": s.question}],
                }
            ]
            r = c.chat.completions.create(model=MODEL, messages=msgs, temperature=0)
            ref = HFReference(model_dir)
            assert r.choices[0].message.content == ref.answer(s.question, images=render_images(s))
    finally:
        media.shutdown()


def test_text_completions_match_transformers_and_model_is_optional(
    server: str, client: openai.OpenAI, hf: HFReference
) -> None:
    """``/v1/completions``: a raw prompt, no template; greedy tokens identical to transformers',
    streamed or not; ``model`` may be left out (chat and completions alike); ``/version``."""
    import torch

    prompt = "<|im_start|>user\nWhat shapes are there?<|im_end|>\n<|im_start|>assistant\n"
    ids = hf.tok(prompt, add_special_tokens=False)["input_ids"]
    inputs = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
    expected = hf.tok.decode(hf.generate_ids(inputs, max_new_tokens=12), skip_special_tokens=True)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.choices[0].text == expected
    assert r.usage is not None and r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens <= 12
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == expected
    # model left out: the served one
    status, body = post_json(server + "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    assert status == 200 and body["model"] == MODEL and body["choices"][0]["text"] == expected
    status, body = post_json(
        server + "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    )
    assert status == 200 and body["model"] == MODEL
    # refused clearly
    for bad, param in (({"prompt": ""}, "prompt"), ({"prompt": [10**9]}, "prompt"), ({"prompt": "x", "n": 2}, "n"),
                       ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "model": "other"}, None)):  # fmt: skip
        status, body = post_json(server + "/v1/completions", bad)
        assert 400 <= status < 500 and body["error"]["message"], (bad, body)
        if param:
            assert body["error"]["param"] == param
    status, raw = http("GET", server + "/version")
    assert status == 200 and b'"version"' in raw
