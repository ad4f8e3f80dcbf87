"""Memory accounting (``epdserve.memory``): the figures of known shapes, worked out here from the
published configs' fields by hand, the KV blocks a budget leaves, refusals that name the numbers;
and a real ``serve`` that refuses a budget too small or sizes its KV cache from one."""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from epdserve.assets import default_model_dir
from epdserve.common.units import format_bytes, parse_bytes
from epdserve.config_flags import add_flags, values
from epdserve.engine.config import EngineConfig
from epdserve.launcher import free_port, start_role, stop, wait_healthy
from epdserve.memory import (
    MemoryBudgetError,
    RoleMemory,
    available_memory,
    encoder_memory,
    engine_memory,
    host_memory,
    kv_block_bytes,
    largest_item,
    lm_step_bytes,
    max_item_patches,
    parameter_count,
    resident_bytes,
    vision_forward_bytes,
    vision_paused_bytes,
)
from epdserve.models.config import ModelConfig
from epdserve.plan.host import fit, topology_memory
from epdserve.up import Topology
from tests.checkpoints.published import published_config
from tests.server_utils import counter, http


def qwen2_vl_2b() -> ModelConfig:
    return ModelConfig.from_dict(published_config("qwen2_vl")[0])


def test_byte_sizes_parse_with_units_and_print_for_people() -> None:
    assert parse_bytes("4GiB") == 4 * 1024**3
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1.5g") == 1_500_000_000
    assert parse_bytes("4096") == 4096
    for bad in ("", "GiB", "-1GiB", "4 parsecs", "1,5G"):
        with pytest.raises(ValueError, match="not a byte size"):
            parse_bytes(bad)
    assert format_bytes(4 * 1024**3) == "4.00 GiB"
    assert format_bytes(3 * 1024**2 // 2) == "1.5 MiB"
    assert format_bytes(12) == "12 B"


def test_the_kv_cache_memory_flag_takes_units_and_refuses_nonsense() -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_flags(parser, EngineConfig, ["kv_cache_memory", "memory_fraction"])
    args = parser.parse_args(["--kv-cache-memory", "4GiB"])
    config = EngineConfig(**values(args, ["kv_cache_memory", "memory_fraction"]))
    assert config.kv_cache_memory == 4 << 30 and type(config.kv_cache_memory) is int and config.sized_by_memory
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--kv-cache-memory", "lots"])
    with pytest.raises(ValueError, match="not both"):
        EngineConfig(kv_cache_memory=1 << 30, memory_fraction=0.5)
    with pytest.raises(ValueError, match="memory_fraction"):
        EngineConfig(memory_fraction=1.5)
    # a budget sizes the blocks later: the fixed count's check does not apply
    assert EngineConfig(num_kv_blocks=1, memory_fraction=0.5).max_model_len == 4096


def test_kv_block_of_qwen2_vl_2b() -> None:
    # 28 layers x 16 tokens x 2 KV heads x head 1536/12 = 128 x (K and V) x 2 bytes
    assert kv_block_bytes(qwen2_vl_2b().text, 16, 2) == 28 * 16 * 2 * 128 * 2 * 2 == 458_752


def test_weights_are_the_parameters_of_the_parts_loaded() -> None:
    cfg = published_config("qwen2_vl")[0]
    t, v = cfg["text_config"], cfg["vision_config"]
    h, i, layers, vocab = t["hidden_size"], t["intermediate_size"], t["num_hidden_layers"], t["vocab_size"]
    q = h  # 12 heads x 128
    kv = t["num_key_value_heads"] * h // t["num_attention_heads"]
    per_layer = (h * q + q) + 2 * (h * kv + kv) + q * h + 3 * h * i + 2 * h  # q/k/v with bias, o, MLP, 2 norms
    language = vocab * h + layers * per_layer + h  # tied lm_head: the embedding once; final norm
    e, m = v["embed_dim"], v["embed_dim"] * v["mlp_ratio"]
    block = 2 * 2 * e + (e * 3 * e + 3 * e) + (e * e + e) + (e * m + m) + (m * e + e)  # 2 LayerNorms, attn, MLP
    merged = 4 * e
    merger = 2 * e + (merged * merged + merged) + (merged * h + h)
    vision = 3 * 2 * 14 * 14 * e + v["depth"] * block + merger  # patch conv without bias
    model = qwen2_vl_2b()
    assert parameter_count(model, frozenset({"language"})) == language
    assert parameter_count(model, frozenset({"vision"})) == vision
    assert language + vision == 2_208_985_600  # Qwen2-VL-2B-Instruct's published 2.21 B


@pytest.mark.parametrize("family", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_weights_count_what_transformers_builds(family: str, tmp_path: Path) -> None:
    import transformers

    from tests.checkpoints import write_json

    cfg = published_config(family)[0]
    write_json(tmp_path / "config.json", cfg)
    with torch.device("meta"):
        hf = getattr(transformers, cfg["architectures"][0])(transformers.AutoConfig.from_pretrained(tmp_path))
    expected = sum(p.numel() for p in hf.parameters())
    assert parameter_count(ModelConfig.from_dict(cfg), frozenset({"language", "vision"})) == expected


def test_largest_step_and_largest_image_of_qwen2_vl_2b() -> None:
    model = qwen2_vl_2b()
    # one decoder layer's rows at 1024 tokens: residual, norm, down (3 x 1536), q 1536, k+v 512,
    # attention out 1536, gate+up+act 3 x 8960 — in bfloat16
    rows = 1024 * (3 * 1536 + 1536 + 512 + 1536 + 3 * 8960) * 2
    scores = 12 * 1024 * 4096 * 4  # float32, 12 heads over a 4096-token context
    logits = 64 * 151936 * 4
    assert lm_step_bytes(model.text, 1024, 64, 4096, 2) == rows + scores + logits == 312_049_664
    # the published max_pixels: 12845056 / 14² = 65536 patches; a 4-frame video of 768 x 28² pixels
    # a frame is 2 temporal groups of 3072
    vision = model.vision_config
    assert max_item_patches(vision, 12845056, 768 * 28 * 28, 4) == 65536
    assert max_item_patches(vision, 3136, 768 * 28 * 28, 4) == 6144
    assert max_item_patches(vision, 3136, 768 * 28 * 28, 0) == 16
    # per patch: residual, norm and proj (3 x 1280) and the MLP's 5120 twice in bfloat16; the pixels
    # (3 x 2 x 14 x 14), rotary cos+sin (2 x 80) and rotated q+k (2 x 1280) in float32
    per_patch = (3 * 1280 + 2 * 5120) * 2 + (1176 + 2 * 80 + 2 * 1280) * 4
    assert vision_forward_bytes(vision, 65536, 2) == 65536 * per_patch
    # paused within a block's attention: the residual, rotated q and k, v and the heads attended
    # (5 x 1280) and input rows (1176) in bfloat16, cos+sin (2 x 80) in float32; a language-model
    # role with the tower holds one beside its largest forward
    assert vision_paused_bytes(vision, 65536, 2) == 65536 * ((5 * 1280 + 1176) * 2 + 2 * 80 * 4)
    pd = engine_memory(model, **_engine(model, num_kv_blocks=256))
    assert pd.vision == vision_forward_bytes(vision, 65536, 2) + vision_paused_bytes(vision, 65536, 2)
    unsliced = engine_memory(model, **_engine(model, num_kv_blocks=256, sliced=False))  # --vision-slice-s 0
    assert unsliced.vision == vision_forward_bytes(vision, 65536, 2)


def _engine(model: ModelConfig, **kw) -> dict:
    base = dict(
        role="pd",
        dtype="bfloat16",
        block_size=16,
        max_num_batched_tokens=1024,
        max_num_seqs=64,
        max_model_len=4096,
        encoder_cache_bytes=256 << 20,
        item_patches=65536,
        vision=True,
        decode_mirror=False,
        weights=4_000_000_000,
    )
    return {**base, **kw}


def test_a_budget_leaves_the_kv_cache_what_the_rest_does_not_take() -> None:
    model = qwen2_vl_2b()
    block = 458_752
    fixed = engine_memory(model, **_engine(model, num_kv_blocks=256))
    assert fixed.kv_blocks == 256 and fixed.kv_cache == 256 * block
    assert fixed.embeddings == (65536 // 4 + 1024) * 1536 * 2  # the largest image's tokens and a step's
    assert fixed.encoder_cache == 256 << 20 and fixed.decode_mirror == 0
    budget = fixed.fixed + 1000 * block + 123
    planned = engine_memory(model, **_engine(model, budget=budget))
    assert planned.kv_blocks == 1000 and planned.total <= budget
    exact = engine_memory(model, **_engine(model, kv_cache_memory=3 << 30))
    assert exact.kv_blocks == (3 << 30) // block and exact.kv_cache == exact.kv_blocks * block
    assert "KV cache" in exact.line() and f"({exact.kv_blocks} blocks)" in exact.line()
    mirrored = engine_memory(model, **_engine(model, num_kv_blocks=256, decode_mirror=True))
    assert mirrored.decode_mirror == 64 * 4096 * block // 16
    text_only = engine_memory(model, **_engine(model, num_kv_blocks=256, vision=False))
    assert text_only.vision == 0 and text_only.embeddings == fixed.embeddings


def test_a_configuration_that_cannot_fit_is_refused_naming_the_figures() -> None:
    model = qwen2_vl_2b()
    with pytest.raises(MemoryBudgetError, match=r"pd: .* before any KV cache exceeds the memory budget 1\.00 GiB"):
        engine_memory(model, **_engine(model, budget=1 << 30))
    fixed = engine_memory(model, **_engine(model, num_kv_blocks=256)).fixed
    with pytest.raises(
        MemoryBudgetError, match=r"KV cache of 100 blocks .* cannot hold one request of max_model_len 4096"
    ):
        engine_memory(model, **_engine(model, budget=fixed + 100 * 458_752))
    with pytest.raises(MemoryBudgetError, match="cannot hold one request"):
        engine_memory(model, **_engine(model, kv_cache_memory=1 << 20))


def test_an_encoder_counts_its_largest_forward() -> None:
    model = qwen2_vl_2b()
    enc = encoder_memory(model, dtype="bfloat16", encode_token_budget=8192, encoder_cache_bytes=0, item_patches=65536)
    assert enc.vision == vision_forward_bytes(model.vision_config, 65536, 2)
    assert enc.embeddings == 65536 // 4 * 1536 * 2
    assert enc.kv_blocks == 0 and enc.total == enc.weights + enc.vision + enc.embeddings
    with pytest.raises(MemoryBudgetError, match="encoder: needs"):
        encoder_memory(
            model, dtype="bfloat16", encode_token_budget=8192, encoder_cache_bytes=0, item_patches=16, budget=1 << 20
        )


def test_the_media_a_role_holds_for_its_tower_is_counted_at_its_bound() -> None:
    model = qwen2_vl_2b()
    item = 65536 * 1176 * 4  # the largest image's float32 patches
    for bound in (64 << 20, 1 << 30):
        pd = engine_memory(model, **_engine(model, num_kv_blocks=256, pending_media=bound))
        enc = encoder_memory(
            model,
            dtype="bfloat16",
            encode_token_budget=8192,
            encoder_cache_bytes=0,
            item_patches=65536,
            pending_media=bound,
        )
        assert pd.pending_media == enc.pending_media == max(bound, item)  # one item is always let through
        assert f"pending media {format_bytes(max(bound, item))}" in pd.line()
        assert enc.total == enc.weights + enc.vision + enc.embeddings + enc.pending_media
    # what preprocessing the largest item holds (its decoded frames and resized copies beside its
    # patches), where that is more than both
    held = item + (600 << 20)
    pd = engine_memory(model, **_engine(model, num_kv_blocks=256, pending_media=64 << 20, item_bytes=held))
    assert pd.pending_media == held
    tower_less = engine_memory(model, **_engine(model, num_kv_blocks=256, pending_media=1 << 30, vision=False))
    decode = engine_memory(model, **_engine(model, role="decode", num_kv_blocks=256, pending_media=1 << 30))
    assert tower_less.pending_media == decode.pending_media == 0  # no pixels ever reach them


def test_the_largest_item_is_read_from_the_checkpoints_processor() -> None:
    """The account's largest item: the processor's largest image or video, and what decoding and
    preprocessing it from the largest canvas a client may send holds."""
    from epdserve.media.limits import MediaLimits
    from epdserve.media.processor import ProcessorConfig, VisionProcessor

    model = ModelConfig.from_pretrained(default_model_dir())
    proc = ProcessorConfig.from_pretrained(default_model_dir())
    patches, held = largest_item(default_model_dir(), model)
    assert patches == max_item_patches(model.vision_config, proc.max_pixels, proc.video_max_pixels, proc.video_frames)
    side = math.isqrt(MediaLimits().max_image_pixels)
    video = VisionProcessor(proc).footprint("video", proc.video_frames, side, side)
    assert held == max(video, VisionProcessor(proc).footprint("image", 1, side, side))
    assert held > patches * model.vision_config.patch_dim * 4  # a 4096-px frame decodes to more than its patches


def test_available_memory_is_some_of_the_machine() -> None:
    assert 0 < available_memory("cpu") <= host_memory()


# ---- a real serve --------------------------------------------------------------------------------


def test_serve_with_a_budget_below_its_weights_exits_at_once_naming_the_numbers() -> None:
    started = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "epdserve.cli", "serve", "--port", str(free_port()), "--memory-fraction", "0.000001"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert time.monotonic() - started < 60
    last = r.stderr.strip().splitlines()[-1]
    assert "MemoryBudgetError: pd: " in last and "exceeds the memory budget" in last
    assert "weights 28.6 MiB" in last and "KiB budget" in last
    assert "Traceback" not in r.stderr


def metric_values(base: str, wait_s: float = 0.0) -> dict[str, float]:
    """Every sample on ``base``'s ``/metrics``, by its name with labels as exported; ``wait_s``:
    how long the role may take to start answering."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            status, body = http("GET", base + "/metrics")
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    assert status == 200
    samples = (line.rsplit(" ", 1) for line in body.decode().splitlines() if line and not line.startswith("#"))
    return {name: float(value) for name, value in samples}


def test_a_router_states_what_it_holds_and_refuses_a_bound_past_the_memory_free() -> None:
    """The router's account (``router.memory``): its request bodies and, decoding media itself, its
    decode threads' items and pixel slab; one past the memory free exits at once, naming it."""
    command = [
        sys.executable,
        "-m",
        "epdserve.cli",
        "router",
        "--port",
        str(free_port()),
        "--pds",
        "http://127.0.0.1:9",
    ]
    too_large = format_bytes(2 * host_memory()).replace(" ", "")
    r = subprocess.run([*command, "--max-inflight-body-bytes", too_large], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert "router: needs" in r.stderr and "request bodies" in r.stderr and "free (router memory:" in r.stderr
    proc = subprocess.Popen(
        [*command, "--max-inflight-body-bytes", "8MiB", "--frontend-decode", "--frontend-decode-workers", "3"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stderr is not None
        line = next(line for line in proc.stderr if "router memory:" in line)
        scraped = metric_values(f"http://127.0.0.1:{command[5]}", 30)  # serving, its worker unreachable
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    model_dir = default_model_dir()
    _, item_bytes = largest_item(model_dir, ModelConfig.from_pretrained(model_dir))
    assert f"pending media {format_bytes(3 * item_bytes)}, request bodies 8.0 MiB, connector " in line
    # the account as metrics, beside what the router holds now
    assert scraped['epd_router_memory_planned_bytes{part="request_bodies"}'] == 8 << 20
    assert scraped['epd_router_memory_planned_bytes{part="pending_media"}'] == 3 * item_bytes
    assert 0 < scraped["epd_router_memory_resident_bytes"] < 4 << 30


def test_serve_with_a_kv_cache_memory_has_that_many_blocks(tmp_path: Path) -> None:
    model = ModelConfig.from_pretrained(default_model_dir())
    t = model.text
    block = 2 * t.num_hidden_layers * 16 * t.num_key_value_heads * (t.hidden_size // t.num_attention_heads) * 4
    blocks = (40 << 20) // block
    log = tmp_path / "serve.log"
    port = free_port()
    proc = start_role(["serve", "--port", str(port), "--kv-cache-memory", "40MiB"], log_path=str(log))
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        assert counter(url, "kv_blocks_free") == blocks
        scraped, front_end = metric_values(url), resident_bytes(proc.pid)
    finally:
        stop(proc)
    lines = [line for line in log.read_text().splitlines() if "pd memory:" in line]
    assert len(lines) == 1, log.read_text()
    assert f"KV cache {format_bytes(blocks * block)} ({blocks} blocks)" in lines[0]
    # the account the core started under, as metrics, beside what the role's two processes hold
    assert scraped['epd_memory_planned_bytes{part="kv_cache"}'] == blocks * block
    total = scraped['epd_memory_planned_bytes{part="total"}']
    assert format_bytes(int(total)) == lines[0].rsplit("total ", 1)[1].strip()
    assert scraped["epd_memory_resident_bytes"] > front_end > 0  # the engine core's process counted too


def test_a_decode_role_counts_no_media() -> None:
    model = qwen2_vl_2b()
    decode = engine_memory(model, **_engine(model, role="decode", num_kv_blocks=256))
    assert decode.vision == decode.embeddings == decode.encoder_cache == 0
    assert decode.weights == 4_000_000_000 and decode.kv_blocks == 256
    # a vision tower loaded all the same still weighs
    counted = {"vision": True, "weights": None}
    with_tower = engine_memory(model, **_engine(model, role="decode", num_kv_blocks=256, **counted))
    without = engine_memory(model, **_engine(model, role="decode", num_kv_blocks=256, **{**counted, "vision": False}))
    assert with_tower.weights - without.weights == 665_271_296 * 2 and with_tower.vision == 0


def test_a_host_holds_the_fewer_of_its_memory_and_its_cores() -> None:
    model = qwen2_vl_2b()
    pd = engine_memory(model, **_engine(model, num_kv_blocks=256))
    enc = encoder_memory(model, dtype="bfloat16", encode_token_budget=8192, encoder_cache_bytes=0, item_patches=16)
    fits = fit({"pd": pd, "encoder": enc}, memory=3 * pd.total + 1, cores=16)
    assert (fits[0].name, fits[0].by_memory, fits[0].instances) == ("pd", 3, 3)
    assert fits[1].by_memory == (3 * pd.total + 1) // enc.total and fits[1].instances == min(fits[1].by_memory, 16)
    assert fit({"pd": pd}, memory=10 * pd.total, cores=2)[0].instances == 2
    router = RoleMemory(role="router", weights=0, request_bodies=1 << 20)
    accounts = {"encoder": enc, "pd (vision tower)": pd, "prefill": pd, "decode": pd, "router": router}
    assert topology_memory(Topology.parse("2e+1pd"), accounts) == 2 * enc.total + pd.total + router.total
    assert topology_memory(Topology.parse("1e+1p+2d"), accounts) == enc.total + 3 * pd.total + router.total
    assert topology_memory(Topology.parse("aggregated"), accounts) == pd.total  # no router in front


def test_plan_memory_prints_how_many_of_each_role_fit() -> None:
    r = subprocess.run(
        [
            *(sys.executable, "-m", "epdserve.cli", "plan", "--memory", "--model", str(default_model_dir())),
            *("--host-memory", "3GiB", "--host-cores", "3", "--num-kv-blocks", "512"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "host: 3.00 GiB, 3 cores"
    pd = next(line for line in lines if line.strip().startswith("pd (vision tower)"))
    account = next(line for line in lines if line.strip().startswith("pd memory:"))
    assert "KV cache 64.0 MiB (512 blocks)" in account  # 512 blocks of 128 KiB
    total = parse_bytes(account.rsplit("total ", 1)[1].replace(" ", ""))
    assert f"-> {min(3, (3 << 30) // total)} instances" in " ".join(pd.split())


def test_up_plan_and_each_role_count_the_same_bytes() -> None:
    """One accounting: what ``up``'s size check sums for each role is what the role states and
    checks at start-up, and what ``plan --memory`` shows for it."""
    from epdserve.encoder.config import EncoderConfig
    from epdserve.engine.memory import plan_encoder, plan_engine
    from epdserve.plan.host import roles
    from epdserve.router.frontend_decode import FrontendDecodeConfig
    from epdserve.router.memory import account_router
    from epdserve.sizing import PROCESS_BYTES, ROUTER_PROCESS_BYTES, Settings, accounts_here, check_fit
    from epdserve.transfer.config import ECConfig
    from epdserve.transfer.factory import producer_bytes

    model_dir = default_model_dir()
    engine = {"dtype": "float32", "num_kv_blocks": 256, "max_model_len": 1024, "max_num_batched_tokens": 512}
    engine["max_pending_media_bytes"] = 80 << 20
    engine["vision_slice_s"] = 0  # no forward paused between steps: nothing counted for one
    engine["max_inflight_body_bytes"] = 96 << 20
    encoder = {"dtype": "float32", "max_pending_media_bytes": 80 << 20}  # as up hands the flags to both
    encoder["max_inflight_body_bytes"] = 96 << 20
    frontend = {"enabled": True, "workers": 3}  # the router decodes media itself
    settings = Settings(engine, encoder, frontend, ec_connector="shm", kv_connector="tcp")
    fit = check_fit(model_dir, settings, 2, {"prefill": 1, "decode": 3}, True, accounts_here, router=True)
    config = EngineConfig(**engine)  # type: ignore[arg-type]
    enc = EncoderConfig(model=model_dir)
    shm, tcp = producer_bytes(ECConfig()), producer_bytes(ECConfig(connector="tcp"))
    assert shm and tcp == ECConfig().tcp_bytes
    started = {
        "encoder": plan_encoder(
            model_dir, "float32", "cpu", enc.encode_token_budget, enc.encoder_cache_bytes, 80 << 20, 96 << 20, shm
        ),
        "prefill": plan_engine(model_dir, config, "prefill", True, tcp),
        "decode": plan_engine(model_dir, config, "decode", True),
        "router": account_router(model_dir, 96 << 20, FrontendDecodeConfig(**frontend)),  # type: ignore[arg-type]
    }
    assert {r.memory.role: (r.count, r.memory) for r in fit.roles} == {
        "encoder": (2, started["encoder"]),
        "prefill": (1, started["prefill"]),
        "decode": (3, started["decode"]),
        "router": (1, started["router"]),
    }
    assert started["encoder"].connector == shm and started["prefill"].connector == tcp
    assert started["decode"].connector == 0  # a decode instance only reads handed-on KV
    _, item_bytes = largest_item(model_dir, ModelConfig.from_pretrained(model_dir))
    assert started["router"].pending_media == 3 * item_bytes and started["router"].connector == shm
    accounts = 2 * started["encoder"].total + started["prefill"].total + 3 * started["decode"].total
    # and each process's interpreter (with torch, but for the router's)
    assert fit.need_bytes == accounts + started["router"].total + 6 * PROCESS_BYTES + ROUTER_PROCESS_BYTES
    planned = roles(model_dir, config)  # plan's connectors: shm, as up's by default
    assert planned["encoder"] == started["encoder"]
    assert planned["prefill"] == plan_engine(model_dir, config, "prefill", True, shm)
    assert planned["router"] == account_router(model_dir, 96 << 20, FrontendDecodeConfig())
    assert planned["decode"] == plan_engine(model_dir, config, "decode", False)  # plan's decode: no tower
    assert started["encoder"].request_bodies == started["decode"].request_bodies == 96 << 20
    assert "request bodies 96.0 MiB" in started["decode"].line()
