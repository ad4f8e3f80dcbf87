"""Every model family through every topology: on a small random-weight checkpoint of each
architecture (built offline by ``tests.checkpoints``), the aggregated server answers what
transformers' ``generate`` answers, and E+PD with each connector and E/P/D answer exactly what the
aggregated server answers at temperature 0 (videos against transformers: each family's oracle
test, which builds a video's inputs as that family's processor does)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from epdserve.assets import default_model_dir
from epdserve.bench.workload import gif_data_url
from epdserve.bench.workload import image_data_url as data_url
from epdserve.hf_reference import HFReference
from epdserve.launcher import free_port
from epdserve.models.registry import supported_architectures
from epdserve.shapes import ShapesWorld, render_images
from epdserve.up import Deployment, Topology
from tests.checkpoints import build
from tests.optional import unavailable
from tests.server_utils import counter, openai_client

MAX_TOKENS = 12
PD_ARGS = ["--max-model-len", "2048", "--num-kv-blocks", "256", "--max-num-batched-tokens", "64"]
HAVE_MOONCAKE = unavailable("mooncake.store") is None  # installed, and its native libraries load
MOONCAKE = pytest.param(
    "mooncake", marks=pytest.mark.skipif(not HAVE_MOONCAKE, reason="pip install 'epdserve[mooncake]'")
)
# the vision families; video only where the family takes it through every topology
VISION_FAMILIES = {"qwen2_5_vl": True, "qwen3_vl": True}
TopLogprobs = list[tuple[bytes, float]]  # a token's top alternatives: (bytes, logprob)


def _deploy(model: Path, topology: str, connector: str = "shm", kv_connector: str = "shm") -> Deployment:
    d = Deployment(
        Topology.parse(topology),
        str(model),
        port=0,  # up picks it, and picks again if another server takes it while the model loads
        ec_connector=connector,  # type: ignore[arg-type]
        kv_connector=kv_connector,  # type: ignore[arg-type]
        extra_pd_args=PD_ARGS,
    )
    d.start()
    return d


def vision_requests(video: bool) -> list[tuple[dict, list | None]]:
    """Text only, one image, three images of different sizes, a repeated image, a video; the
    64-token budget of a step splits the longer prompts inside a placeholder run. Each request
    comes with its images for transformers (None: not asked of transformers here, the video: its
    family's oracle test builds a video's inputs as its processor does)."""
    w = ShapesWorld(2026)
    one = w.sample("describe")
    sizes: dict[tuple[int, int], object] = {}
    for sc in (w.scene() for _ in range(12)):
        sizes.setdefault((sc.width, sc.height), sc)
    three = [sc.render() for sc in list(sizes.values())[:3]]  # type: ignore[attr-defined]

    def parts(images: list) -> list[dict]:
        return [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]

    def msg(content: list[dict], q: str) -> list[dict]:
        return [{"role": "user", "content": [*content, {"type": "text", "text": q}]}]

    reqs: list[tuple[dict, list | None]] = [
        ({"messages": [{"role": "user", "content": "Describe the image."}], "max_tokens": 8}, []),
        ({"messages": msg(parts(render_images(one)), one.question)}, render_images(one)),
        ({"messages": msg(parts(three), "Describe the third image.")}, three),
        (
            {"messages": msg(parts(render_images(one) * 2), "Describe the second image."), "stream": True},
            render_images(one) * 2,
        ),
    ]
    if video:
        vid = w.sample("direction")
        reqs.append(
            ({"messages": msg([{"type": "video_url", "video_url": {"url": gif_data_url(vid.frames)}}], "?")}, None)
        )
    return reqs


def transformers_answer(ref: HFReference, req: dict, images: list) -> str:
    """transformers' greedy answer to ``req`` (its image parts as ``images``, in order)."""
    content = req["messages"][0]["content"]
    if isinstance(content, list):
        content = [{"type": "image"} if p["type"] == "image_url" else p for p in content]
    inputs = ref.inputs([{"role": "user", "content": content}], images=images)
    ids = ref.generate_ids(inputs, max_new_tokens=req.get("max_tokens", MAX_TOKENS))
    return str(ref.tok.decode(ids, skip_special_tokens=True))


def ask(url: str, model: str, req: dict) -> str:
    c = openai_client(url)
    body = {"max_tokens": MAX_TOKENS, **req}
    if body.get("stream"):
        stream = c.chat.completions.create(model=model, temperature=0, **body)
        return "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    r = c.chat.completions.create(model=model, temperature=0, **body)
    return r.choices[0].message.content or ""


@pytest.fixture(scope="module", params=sorted(VISION_FAMILIES))
def vision_family(request, tmp_path_factory) -> Iterator[tuple[Path, list[dict], list[str], TopLogprobs]]:
    """A family's checkpoint, its requests, the aggregated server's answers to them, which are
    transformers' ``generate``'s, and that server's first-token top logprobs for ``_image_part``
    (float32: what bfloat16 is held to)."""
    model = build(request.param, tmp_path_factory.mktemp("ckpt") / f"{request.param}-tiny")
    cases = vision_requests(VISION_FAMILIES[request.param])
    reqs = [r for r, _ in cases]
    d = _deploy(model, "aggregated")
    try:
        expected = [ask(d.url, model.name, r) for r in reqs]
        float32 = _top_logprobs(d.url, model.name, _image_part())
    finally:
        d.stop()
    assert len(set(expected)) > 1, "the requests must not all get one answer"
    ref = HFReference(model)
    for (req, images), answer in zip(cases, expected, strict=True):
        if images is not None:
            assert answer == transformers_answer(ref, req, images)
    del ref
    yield model, reqs, expected, float32


def _assert_same(model: Path, topology: str, reqs: list[dict], expected: list[str], **kw: str) -> None:
    d = _deploy(model, topology, **kw)
    try:
        got = [ask(d.url, model.name, r) for r in reqs]
        if d.topology.split:  # the KV went through the connector: the decode worker recomputed none
            p, dec = (next(r.url for r in d.roles if r.name == name) for name in ("prefill0", "decode0"))
            assert counter(dec, "kv_fallbacks_total") == 0
            assert counter(dec, "kv_transfers_in_total") == counter(p, "kv_transfers_out_total") >= 1
    finally:
        d.stop()
    assert got == expected


@pytest.mark.parametrize("connector", ["shm", "tcp", "fs", MOONCAKE])
def test_e_pd_equals_aggregated(vision_family, connector: str) -> None:
    model, reqs, expected, _ = vision_family
    _assert_same(model, "1e+1pd", reqs, expected, connector=connector)


@pytest.mark.parametrize("kv_connector", ["shm", "tcp"])
def test_e_p_d_equals_aggregated(vision_family, kv_connector: str) -> None:
    model, reqs, expected, _ = vision_family
    _assert_same(model, "1e+1p+1d", reqs, expected, kv_connector=kv_connector)


@pytest.mark.parametrize("command", [["serve"], ["up"], ["up", "--topology", "1e+1pd"]])
def test_an_unrecognised_architecture_fails_at_once_naming_what_is_supported(tmp_path: Path, command) -> None:
    src = default_model_dir()
    for f in src.glob("*.json"):
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    config["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    r = subprocess.run(
        [sys.executable, "-m", "epdserve.cli", *command, "--model", str(tmp_path), "--port", str(free_port())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2
    message = r.stderr.strip().splitlines()[-1]
    assert "unsupported architecture 'LlamaForCausalLM'" in message
    for name in supported_architectures():
        assert name in message
    assert "Traceback" not in r.stderr


def _first_token_logprobs(model: Path, topology: str, dtype: str, part: dict) -> TopLogprobs:
    d = Deployment(
        Topology.parse(topology),
        str(model),
        port=0,
        extra_pd_args=[*PD_ARGS, "--dtype", dtype],
        extra_encoder_args=["--dtype", dtype],
    )
    d.start()
    try:
        return _top_logprobs(d.url, model.name, part)
    finally:
        d.stop()


def _top_logprobs(url: str, model: str, part: dict) -> TopLogprobs:
    """The first token's top logprobs of a greedy answer about ``part``."""
    r = openai_client(url).chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}],
        temperature=0,
        max_tokens=1,
        logprobs=True,
        top_logprobs=3,
    )
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content
    # by bytes: several partial UTF-8 tokens all print as U+FFFD
    return [(bytes(t.bytes or []), t.logprob) for t in r.choices[0].logprobs.content[0].top_logprobs]


def _image_part() -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(ShapesWorld(5).scene().render())}}


def _audio_part() -> dict:
    import base64
    import io

    import numpy as np
    import soundfile as sf

    buf = io.BytesIO()
    samples = (0.1 * np.random.default_rng(0).standard_normal(16000)).astype(np.float32)
    sf.write(buf, samples, 16000, format="WAV", subtype="FLOAT")
    return {"type": "input_audio", "input_audio": {"data": base64.b64encode(buf.getvalue()).decode(), "format": "wav"}}


def test_bfloat16_serves_each_family_through_e_pd(vision_family) -> None:
    """In bfloat16 the first token's top logprobs are float32's within bfloat16's rounding, and
    E+PD (bfloat16 embeddings through the EC connector; DeepStack levels) gives the aggregated
    server's (rounding apart: other processes, other batch shapes)."""
    model, _, _, full = vision_family
    _assert_bfloat16_serves(model, _image_part(), full)


def test_bfloat16_serves_the_audio_family_through_e_pd(tmp_path: Path) -> None:
    """As for each vision family, with audio embeddings through the EC connector."""
    model = build("qwen2_audio", tmp_path / "qwen2_audio-tiny")
    full = _first_token_logprobs(model, "aggregated", "float32", _audio_part())
    _assert_bfloat16_serves(model, _audio_part(), full)


def _assert_bfloat16_serves(model: Path, part: dict, full: TopLogprobs) -> None:
    """The aggregated server and E+PD in bfloat16 against ``full``, float32's top logprobs."""
    half = _first_token_logprobs(model, "aggregated", "bfloat16", part)
    disaggregated = _first_token_logprobs(model, "1e+1pd", "bfloat16", part)
    _assert_close(full, half, 0.25)
    _assert_close(half, disaggregated, 0.05)


def _assert_close(a: TopLogprobs, b: TopLogprobs, tol: float) -> None:
    """Two top-3 lists name mostly the same tokens, with logprobs within ``tol`` (near-ties may swap)."""
    da, db = dict(a), dict(b)
    common = da.keys() & db.keys()
    assert len(common) >= 2, (a, b)
    for token in common:
        assert abs(da[token] - db[token]) < tol, (token, a, b)
