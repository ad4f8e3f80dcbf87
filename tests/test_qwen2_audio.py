"""Qwen2-Audio against transformers on a tiny random-weight checkpoint: the audio tower's output,
the placeholder count, partial loading, and the engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from epdserve.models.loader import load_model
from epdserve.models.qwen2_audio import Qwen2AudioForConditionalGeneration
from epdserve.models.qwen2_audio_layout import audio_grid, audio_tokens, encoder_frames
from epdserve.models.qwen2_vl_layout import MediaPlaceholderError
from epdserve.models.registry import prompt_layout
from tests.checkpoints import build
from tests.engine_utils import drain
from tests.numerics import assert_close_rel
from tests.optional import unavailable

torch.set_num_threads(1)

SR = 16000
# seconds: odd and even frame counts, the shortest audio that makes a token, the whole 30 s window
DURATIONS = (1.3, 0.71, 0.03, 30.0)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build("qwen2_audio", tmp_path_factory.mktemp("qwen2-audio"), seed=0)


@pytest.fixture(scope="module")
def hf_model(ckpt: Path):
    from transformers import Qwen2AudioForConditionalGeneration as HFQwen2Audio

    return HFQwen2Audio.from_pretrained(ckpt, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def feature_extractor(ckpt: Path):
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor.from_pretrained(ckpt)


def waveform(seconds: float, seed: int) -> np.ndarray:
    """A chirp with noise: energy in every mel band, so each frame differs."""
    t = np.arange(round(seconds * SR)) / SR
    rng = np.random.default_rng(seed)
    tone = np.sin(2 * np.pi * (200 + 1500 * t / max(seconds, 1e-3)) * t)
    return (0.3 * tone + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


@torch.inference_mode()
def hf_audio_embeddings(hf_model, feature_extractor, audios: list[np.ndarray]) -> list[torch.Tensor]:
    """transformers' projected audio features per item, taken from its own forward (padded to the
    30 s window, padded frames masked through feature_attention_mask)."""
    out = feature_extractor(
        audios, sampling_rate=SR, return_attention_mask=True, padding="max_length", return_tensors="pt"
    )
    frames = out["attention_mask"].sum(-1).tolist()
    counts = [audio_tokens(n) for n in frames]
    captured: list[torch.Tensor] = []
    hook = hf_model.model.multi_modal_projector.register_forward_hook(lambda m, a, o: captured.append(o))
    token = hf_model.config.audio_token_id
    ids = torch.tensor([[1] + [t for n in counts for t in [token] * n + [2]]])
    try:
        hf_model(
            input_ids=ids,
            input_features=out["input_features"],
            feature_attention_mask=out["attention_mask"],
            attention_mask=torch.ones_like(ids),
        )
    finally:
        hook.remove()
    return [captured[0][i, :n] for i, n in enumerate(counts)]


@pytest.fixture(scope="module")
def audio_only(ckpt: Path) -> Qwen2AudioForConditionalGeneration:
    m, _ = load_model(ckpt, parts=frozenset({"vision"}))
    assert isinstance(m, Qwen2AudioForConditionalGeneration)
    return m


# ---- the audio tower ------------------------------------------------------------------------


@torch.inference_mode()
def test_audio_tower_matches_transformers(hf_model, feature_extractor, audio_only) -> None:
    audios = [waveform(s, i) for i, s in enumerate(DURATIONS)]
    ref = hf_audio_embeddings(hf_model, feature_extractor, audios)
    feats = feature_extractor(audios, sampling_rate=SR, return_attention_mask=True, padding="max_length")
    frames = [int(n) for n in np.asarray(feats["attention_mask"]).sum(-1)]
    assert len({n % 2 for n in frames}) == 2 and min(frames) == 3 and max(frames) == 3000
    cfg = audio_only.config.audio
    assert cfg is not None and audio_only.audio is not None
    # each item carries its valid frames and the two its convolutions read past them
    rows = [
        torch.from_numpy(f[:, : encoder_frames(n, cfg)].T.copy())
        for f, n in zip(feats["input_features"], frames, strict=True)
    ]
    ours = audio_only.audio(torch.cat(rows), [audio_grid(n) for n in frames])  # all items in one forward
    assert ours.shape[0] == sum(r.shape[0] for r in ref)
    assert_close_rel(ours, torch.cat(ref))
    for row, n, r in zip(rows, frames, ref, strict=True):  # and each alone
        assert_close_rel(audio_only.audio(row, [audio_grid(n)]), r)


@torch.inference_mode()
def test_audio_tower_needs_the_frames_past_the_audio(hf_model, feature_extractor, audio_only) -> None:
    """Zeros in place of the two padded frames the convolutions read change the last valid frame,
    which every row attends to: those frames are part of the item."""
    audio = waveform(1.3, 0)
    ref = hf_audio_embeddings(hf_model, feature_extractor, [audio])[0]
    feats = feature_extractor([audio], sampling_rate=SR, padding="max_length")["input_features"][0]
    n = 130
    assert audio_only.audio is not None
    zeros_after = torch.from_numpy(np.concatenate([feats[:, :n].T, np.zeros((2, feats.shape[0]), np.float32)]))
    got = audio_only.audio(zeros_after, [audio_grid(n)])
    assert float((got - ref).abs().max()) > 1e-3 * float(ref.abs().max())


def test_audio_tower_rejects_inconsistent_input(audio_only) -> None:
    assert audio_only.audio is not None
    x = torch.zeros(encoder_frames(100, audio_only.audio.config), 128)
    for grid, rows in (
        ((1, 100, 1), x[:-1]),
        ((2, 100, 1), x),
        ((1, 2, 1), x[:4]),
        ((1, 3001, 1), torch.zeros(3000, 128)),
    ):
        with pytest.raises(MediaPlaceholderError):
            audio_only.audio(rows, [grid])
    with pytest.raises(MediaPlaceholderError):
        audio_only.audio(x[:, :80], [(1, 100, 1)])


# ---- the prompt layout ----------------------------------------------------------------------


def test_placeholder_count_is_transformers(hf_model, ckpt: Path) -> None:
    from epdserve.models.config import ModelConfig

    layout = prompt_layout(ModelConfig.from_pretrained(ckpt))
    frames = torch.arange(3, 3001)
    _, expected = hf_model.model.audio_tower._get_feat_extract_output_lengths(frames)
    assert [layout.num_placeholders(audio_grid(int(n))) for n in frames] == expected.tolist()
    assert layout.positions([1, 2, 3], [], []) == (None, 0)
    for bad in ((1, 2, 1), (1, 3001, 1), (2, 100, 1), (1, 100, 2)):
        with pytest.raises(ValueError):
            layout.num_placeholders(bad)


# ---- loading --------------------------------------------------------------------------------


def test_partial_loads_read_only_their_tensors(ckpt: Path) -> None:
    audio, report = load_model(ckpt, parts=frozenset({"vision"}))
    assert audio.language_model is None and audio.visual is None and audio.audio is not None
    assert report.tensors and all(n.startswith(("audio_tower.", "multi_modal_projector.")) for n in report.tensors)
    lm, report = load_model(ckpt, parts=frozenset({"language"}))
    assert lm.audio is None and lm.language_model is not None
    assert report.tensors and all(n.startswith("language_model.") for n in report.tensors)


def test_transformers5_names_map_to_ours() -> None:
    name = Qwen2AudioForConditionalGeneration.checkpoint_param_name
    assert name("model.audio_tower.layers.1.fc1.weight") == name("audio_tower.layers.1.fc1.weight")
    assert name("audio_tower.layers.1.fc1.weight") == "audio.layers.1.fc1.weight"
    assert name("model.multi_modal_projector.linear.bias") == "audio.projector.bias"
    assert (
        name("language_model.model.layers.0.self_attn.k_proj.weight")
        == "language_model.layers.0.self_attn.qkv_proj.weight"
    )
    assert name("model.language_model.layers.0.mlp.up_proj.weight") == "language_model.layers.0.mlp.gate_up_proj.weight"
    assert name("language_model.lm_head.weight") == name("lm_head.weight") == "language_model.lm_head.weight"
    assert name("visual.blocks.0.attn.qkv.weight") is None


# ---- the engine against transformers' generate ----------------------------------------------

MAX_NEW = 10


def chat(n_audio: int, question: str) -> list[dict]:
    return [
        {"role": "user", "content": [*({"type": "audio"} for _ in range(n_audio)), {"type": "text", "text": question}]}
    ]


def engine_cases() -> list[tuple[str, list[dict], list[np.ndarray]]]:
    return [
        ("text", chat(0, "What is a sound?"), []),
        ("audio", chat(1, "What do you hear?"), [waveform(1.3, 1)]),
        ("two-audios", chat(2, "Compare them."), [waveform(2.47, 2), waveform(0.61, 3)]),
    ]


@torch.inference_mode()
def hf_generate(hf_model, feature_extractor, tok, messages: list[dict], audios: list[np.ndarray]) -> list[int]:
    """transformers' greedy tokens, its inputs made as Qwen2AudioProcessor makes them: the prompt's
    <|AUDIO|> expanded to each item's count, features padded to 30 s with feature_attention_mask."""
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids: list[int] = []
    kwargs: dict[str, torch.Tensor] = {}
    if audios:
        out = feature_extractor(
            audios, sampling_rate=SR, return_attention_mask=True, padding="max_length", return_tensors="pt"
        )
        counts = iter(audio_tokens(int(n)) for n in out["attention_mask"].sum(-1))
        kwargs = {"input_features": out["input_features"], "feature_attention_mask": out["attention_mask"]}
    token = hf_model.config.audio_token_id
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        ids += [t] * next(counts) if t == token else [t]
    input_ids = torch.tensor([ids])
    gen = hf_model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=MAX_NEW,
        do_sample=False,
        **kwargs,
    )
    return gen[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def hf_tokens(ckpt: Path, hf_model, feature_extractor) -> dict[str, list[int]]:
    """transformers' greedy tokens for each of ``engine_cases``: what the engine, the server and
    every topology answer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    return {name: hf_generate(hf_model, feature_extractor, tok, m, a) for name, m, a in engine_cases()}


def engine_request(rid: str, builder, proc, messages: list[dict], audios: list[np.ndarray], eos: list[int]):
    from epdserve.common.sampling_params import SamplingParams
    from epdserve.engine.core import request_from
    from epdserve.engine.inputs import MediaInput
    from epdserve.engine.messages import AddRequest

    media = []
    for i, a in enumerate(audios):
        feats = proc.features(a)
        media.append(MediaInput(f"{rid}-{i}", "audio", feats.grid_thw, feats.features))
    p = builder.build(messages, media)
    assert p.mrope_positions is None and p.mrope_delta == 0
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    return request_from(AddRequest(rid, p.token_ids, params, p.mm_items, None, 0, eos))


def test_engine_greedy_tokens_match_transformers_alone_and_batched(ckpt: Path, hf_model, hf_tokens) -> None:
    from transformers import AutoTokenizer

    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core import EngineCore
    from epdserve.engine.inputs import InputBuilder
    from epdserve.media.audio import AudioProcessor, AudioProcessorConfig
    from epdserve.models.config import ModelConfig
    from tests.server_utils import TEST_DEVICE

    tok = AutoTokenizer.from_pretrained(ckpt)
    eos = hf_model.generation_config.eos_token_id
    eos = list(eos) if isinstance(eos, list) else [eos]
    expected = hf_tokens
    assert len({tuple(v) for v in expected.values()}) == len(expected)  # the audio changes the answer
    # a budget of 24 tokens splits every audio run across prefill chunks
    eng = EngineCore.from_pretrained(
        ckpt, EngineConfig(device=TEST_DEVICE, max_num_batched_tokens=24, num_kv_blocks=256, max_model_len=1024)
    )
    assert eng.vision  # the audio tower is this instance's media encoder
    builder = InputBuilder(tok, ModelConfig.from_pretrained(ckpt))
    proc = AudioProcessor(AudioProcessorConfig.from_pretrained(ckpt))
    for name, messages, audios in engine_cases():
        eng.add_request(engine_request(name, builder, proc, messages, audios, eos))
        assert drain(eng)[name] == expected[name], name
    for name, messages, audios in engine_cases():
        eng.add_request(engine_request(name + "#b", builder, proc, messages, audios, eos))
    got = drain(eng)
    assert {name: got[name + "#b"] for name in expected} == expected
    eng.scheduler.blocks.check_integrity()


def test_engine_without_the_audio_tower_fails_raw_audio_only(ckpt: Path) -> None:
    from transformers import AutoTokenizer

    from epdserve.engine.config import EngineConfig
    from epdserve.engine.core import EngineCore
    from epdserve.engine.inputs import InputBuilder
    from epdserve.media.audio import AudioProcessor, AudioProcessorConfig
    from epdserve.models.config import ModelConfig

    tok = AutoTokenizer.from_pretrained(ckpt)
    eng = EngineCore.from_pretrained(ckpt, EngineConfig(num_kv_blocks=64, max_model_len=512), vision=False)
    assert not eng.vision
    builder = InputBuilder(tok, ModelConfig.from_pretrained(ckpt))
    proc = AudioProcessor(AudioProcessorConfig.from_pretrained(ckpt))
    eng.add_request(engine_request("a", builder, proc, chat(1, "Hi"), [waveform(0.5, 0)], [422]))
    outs = [o for _ in range(3) for o in eng.step()]
    assert [o.request_id for o in outs] == ["a"] and "no audio encoder" in (outs[0].error or "")


# ---- the OpenAI API: input_audio parts on the aggregated server ------------------------------

SERVED = "tiny-audio"


def wav_b64(samples: np.ndarray, rate: int = SR, fmt: str = "WAV", subtype: str | None = "FLOAT") -> str:
    import base64
    import io

    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, subtype=subtype)
    return base64.b64encode(buf.getvalue()).decode()


def audio_part(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


@pytest.fixture(scope="module")
def server(ckpt: Path):
    from tests.server_utils import device_args, running

    # audio limits from the command line: at most 20 s, 2 audios per request (the default)
    args = ["serve", "--model", str(ckpt), "--served-model-name", SERVED, "--max-audio-seconds", "20", *device_args()]
    with running([*args, "--max-model-len", "1024", "--num-kv-blocks", "256"]) as url:
        yield url


def test_server_answers_input_audio_as_transformers(server: str, ckpt: Path, hf_tokens) -> None:
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)
    for name, messages, audios in engine_cases():
        expected = tok.decode(hf_tokens[name], skip_special_tokens=True)
        parts = [audio_part(wav_b64(a)) for a in audios]
        content = [*parts, *(p for p in messages[0]["content"] if p["type"] == "text")]
        r = client.chat.completions.create(
            model=SERVED, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=MAX_NEW
        )
        assert r.choices[0].message.content == expected, name


def test_server_resamples_44k_flac_as_scipy_would(server: str, ckpt: Path, hf_model, feature_extractor) -> None:
    """A 44.1 kHz stereo FLAC: its channel mean resampled to 16 kHz (by scipy, for the reference)."""
    import base64
    import io

    import soundfile as sf
    from transformers import AutoTokenizer

    from tests.server_utils import post_json

    signal = pytest.importorskip("scipy.signal")
    t = np.arange(int(44100 * 1.7)) / 44100
    stereo = (
        np.stack([np.sin(2 * np.pi * 330 * t), 0.5 * np.sin(2 * np.pi * 1250 * t)], axis=1).astype(np.float32) * 0.4
    )
    data = wav_b64(stereo, 44100, "FLAC", "PCM_24")
    decoded, _ = sf.read(io.BytesIO(base64.b64decode(data)), dtype="float32")
    mono = signal.resample_poly(decoded.mean(axis=1, dtype=np.float32).astype(np.float64), 160, 441).astype(np.float32)
    tok = AutoTokenizer.from_pretrained(ckpt)
    expected = hf_generate(hf_model, feature_extractor, tok, chat(1, "What do you hear?"), [mono])
    body = {
        "model": SERVED,
        "messages": [
            {"role": "user", "content": [audio_part(data, "flac"), {"type": "text", "text": "What do you hear?"}]}
        ],
        "temperature": 0,
        "max_tokens": MAX_NEW,
    }
    status, out = post_json(server + "/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == tok.decode(expected, skip_special_tokens=True)


def _bad_audio_requests() -> list[tuple[str, list[dict], int, str]]:
    import base64

    text = {"type": "text", "text": "What is it?"}
    short = waveform(0.5, 0)
    return [
        ("bad base64", [audio_part("!!!not base64!!!"), text], 400, "base64"),
        ("not audio", [audio_part(base64.b64encode(b"hello, no audio here" * 20).decode()), text], 400, "decoded"),
        ("declared mp3, is wav", [audio_part(wav_b64(short), "mp3"), text], 400, "declared mp3"),
        ("unknown format", [audio_part(wav_b64(short), "ogg"), text], 400, "format"),
        ("too long", [audio_part(wav_b64(waveform(21, 0), subtype="PCM_16")), text], 413, "at most 20 s"),
        ("too short", [audio_part(wav_b64(waveform(0.01, 0))), text], 400, "log-mel frames"),
        ("low rate", [audio_part(wav_b64(short[:2000], 4000)), text], 400, "sample rate"),
        ("too many audios", [audio_part(wav_b64(short))] * 3 + [text], 400, "At most 2 audio"),
        (
            "an image",
            [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}, text],
            400,
            "takes no image",
        ),
    ]


BAD_AUDIO = _bad_audio_requests()


@pytest.mark.parametrize(("name", "content", "status", "words"), BAD_AUDIO, ids=[b[0] for b in BAD_AUDIO])
def test_server_refuses_bad_audio_clearly(server: str, name: str, content: list[dict], status: int, words: str) -> None:
    from tests.server_utils import post_json

    got, out = post_json(
        server + "/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": content}]}
    )
    assert got == status, out
    assert words in out["error"]["message"] and out["error"]["type"]
    ok, _ = post_json(
        server + "/v1/chat/completions",
        {"model": SERVED, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert ok == 200


# ---- through the encoder role: E+PD and E/P/D ------------------------------------------------


@pytest.mark.parametrize(
    ("topology", "connector", "options"),
    [
        ("1e+1pd", "shm", {}),
        ("1e+1pd", "tcp", {}),
        ("1e+1pd", "fs", {}),
        pytest.param(
            "1e+1pd",
            "mooncake",
            {},
            marks=pytest.mark.skipif(
                unavailable("mooncake.store") is not None, reason="pip install 'epdserve[mooncake]'"
            ),
        ),
        ("1e+1p+1d", "shm", {}),
        ("1p+1d", "shm", {}),  # no encoder: the prefill and decode workers hold the audio tower
        # the router's other ways with media, together: audio passes through them unchanged
        ("1e+2pd", "shm", {"extra_router_args": ["--policy", "kv_aware", "--frontend-decode"]}),
    ],
    ids=["shm", "tcp", "fs", "mooncake", "e-p-d", "p-d", "kv-aware-frontend-decode"],
)
def test_topologies_answer_input_audio_as_transformers(
    ckpt: Path, hf_tokens, topology: str, connector: str, options: dict
) -> None:
    """The encoder encodes the audio (the language-model workers have no audio tower here), the
    embeddings reach them metadata-only as audio_embeds, and the answers are transformers'."""
    from transformers import AutoTokenizer

    from epdserve.up import Deployment, Topology
    from tests.server_utils import http, openai_client

    tok = AutoTokenizer.from_pretrained(ckpt)
    cases = engine_cases()
    expected = [tok.decode(hf_tokens[name], skip_special_tokens=True) for name, _, _ in cases]
    d = Deployment(
        Topology.parse(topology),
        str(ckpt),
        port=0,
        ec_connector=connector,  # type: ignore[arg-type]
        extra_pd_args=["--max-model-len", "1024", "--num-kv-blocks", "256", "--max-num-batched-tokens", "24"],
        **options,
    )
    d.start()
    try:
        client = openai_client(d.url)
        got = []
        for _, messages, audios in cases:
            content = [
                *(audio_part(wav_b64(a)) for a in audios),
                *(p for p in messages[0]["content"] if p["type"] == "text"),
            ]
            r = client.chat.completions.create(
                model=ckpt.name, messages=[{"role": "user", "content": content}], temperature=0, max_tokens=MAX_NEW
            )
            got.append(r.choices[0].message.content)
        encoder = next((r for r in d.roles if r.name == "encoder0"), None)
        metrics = http("GET", encoder.url + "/metrics")[1].decode() if encoder else ""
    finally:
        d.stop()
    assert got == expected
    if encoder is not None:  # the three audios, on the encoder
        assert 'epd_encoder_items_total{status="computed"} 3.0' in metrics


# ---- metadata-only audio_embeds --------------------------------------------------------------


def test_audio_embeds_parts_follow_the_trust_rules_of_every_embeds_part() -> None:
    import json

    from epdserve.api.errors import BadRequest
    from epdserve.api.protocol import AudioEmbedsPart, check_embeds_trust, decode_chat_request
    from epdserve.media.limits import MediaLimits

    part = {
        "type": "audio_embeds",
        "audio_embeds": {"audio_grid_thw": [1, 130, 1]},
        "uuid": "u",
        "ec_handle": {"key": "u"},
    }
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": [part]}]}).encode()
    req = decode_chat_request(body, MediaLimits())
    assert isinstance(req.media_parts()[0], AudioEmbedsPart)
    check_embeds_trust(req, internal=True, enable_mm_embeds=False)  # the router's call
    for enable in (False, True):  # a handle from a public client, inline data switched on or not
        with pytest.raises(BadRequest):
            check_embeds_trust(req, internal=False, enable_mm_embeds=enable)


def test_metadata_audio_embeds_become_media_inputs(ckpt: Path) -> None:
    import asyncio
    import base64

    import msgspec

    from epdserve.api.errors import BadRequest
    from epdserve.api.protocol import AudioEmbedsPart
    from epdserve.models.config import ModelConfig
    from epdserve.pd.embeds import MetadataEmbeds

    cfg = ModelConfig.from_pretrained(ckpt)
    embeds = MetadataEmbeds("m", cfg.text.hidden_size, prompt_layout(cfg).num_placeholders)

    def part(**fields) -> AudioEmbedsPart:
        return msgspec.convert({"type": "audio_embeds", **fields}, AudioEmbedsPart)

    got = asyncio.run(embeds(part(audio_embeds={"audio_grid_thw": [1, 130, 1]}, uuid="u", ec_handle={"key": "u"})))
    assert (got.modality, got.grid_thw, got.handle) == ("audio", (1, 130, 1), {"key": "u"})
    rows = audio_tokens(130)
    data = base64.b64encode(np.ones((rows, cfg.text.hidden_size), np.float32).tobytes()).decode()
    inline = asyncio.run(embeds(part(audio_embeds={"audio_grid_thw": [1, 130, 1], "data": data}, uuid="x")))
    assert inline.embeddings is not None and inline.embeddings.shape == (rows, cfg.text.hidden_size)
    with pytest.raises(BadRequest, match="audio_grid_thw"):
        asyncio.run(embeds(part(audio_embeds={"audio_grid_thw": [1, 5000, 1]}, uuid="u", ec_handle={"key": "u"})))


def test_the_kv_router_names_an_audio_prompts_blocks_as_the_block_manager_does(ckpt: Path) -> None:
    """kv_aware routing: before the encode the blocks before an audio are named (the audio's
    stand-in grid is one the layout accepts), after it every block, as the worker names them."""
    import msgspec

    from epdserve.api.chat_messages import template_messages
    from epdserve.api.protocol import decode_chat_request
    from epdserve.api.tokenizer import FastTokenizer
    from epdserve.common.sampling_params import SamplingParams
    from epdserve.encoder.protocol import EncodedItem
    from epdserve.engine.block_manager import BlockManager
    from epdserve.engine.core import request_from
    from epdserve.engine.inputs import InputBuilder, MediaInput
    from epdserve.engine.messages import AddRequest
    from epdserve.media.limits import MediaLimits
    from epdserve.models.config import ModelConfig
    from epdserve.router.kv_routing import PromptBlocks
    from epdserve.router.refs import media_refs

    bs = 8
    body = {
        "model": ckpt.name,
        "messages": [
            {"role": "system", "content": "You listen carefully and answer in a few words."},
            {"role": "user", "content": [audio_part(wav_b64(waveform(1.0, 3))), {"type": "text", "text": "What?"}]},
        ],
    }
    req = decode_chat_request(msgspec.json.encode(body), MediaLimits(), 100_000)
    refs = media_refs(body)
    assert [r.modality for r in refs] == ["audio"]
    grid = audio_grid(101)
    rows = audio_tokens(101)
    result = EncodedItem(
        uuid="a-1", modality="audio", grid_thw=grid, num_embeddings=rows, dtype="float32",
        shape=(rows, 64), ec_handle={}, status="computed",
    )  # fmt: skip
    blocks = PromptBlocks(ckpt)
    early = blocks.blocks(req, [("audio", None)], bs)
    known = blocks.blocks(req, [("audio", result)], bs)
    builder = InputBuilder(FastTokenizer(ckpt), ModelConfig.from_pretrained(ckpt))
    prompt = builder.build(template_messages(req), [MediaInput("a-1", "audio", grid)], None)
    engine_req = request_from(AddRequest("r", prompt.token_ids, SamplingParams(), prompt.mm_items))
    theirs = BlockManager(64, bs)._hashes_upto(engine_req, len(prompt.token_ids))
    first = prompt.mm_items[0].offset // bs
    assert first >= 2 and known.complete and known.hashes == theirs
    assert early.hashes == theirs[:first] and not early.complete
