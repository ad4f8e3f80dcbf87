"""Random-weight checkpoints at the published sizes of the smallest deployed Qwen VLMs: every
width, depth, head count, vocabulary, rope setting and processor bound of the hub's
``config.json`` / ``preprocessor_config.json``, with seeded noise for weights. Their answers are
noise; what they cost to load, encode, prefill and decode is the real model's.

==================  =========================  ===============================================
``--size``          family                     published checkpoint
==================  =========================  ===============================================
``2b``              ``qwen2_vl``               Qwen/Qwen2-VL-2B-Instruct
``3b``              ``qwen2_5_vl``             Qwen/Qwen2.5-VL-3B-Instruct
``2b``              ``qwen3_vl``               Qwen/Qwen3-VL-2B-Instruct
==================  =========================  ===============================================

The values are the hub files' (written from them here: nothing is downloaded); transformers'
config classes supply only the fields those files leave to their defaults (docs/memory.md lists
which is which). ``layers`` / ``vision_depth`` truncate the depth and keep every width, for tests
and quick runs of the real shapes.

Weights are made in bfloat16 directly: the model is built on the meta device, given empty
bfloat16 storage and each tensor filled in place from its own generator (seeded by the seed and
the tensor's name), so a 2B model never has a float32 copy and the result does not depend on the
order tensors are visited. Matrices get a standard deviation of ``1 / sqrt(fan_in)`` (activations
keep their scale through the depth, attention stays soft), embeddings ``EMBED_STD`` (transformers'
``initializer_range``: small enough that the layers, not the input token, decide the next token),
norm scales ``1 ± 0.1``.

The tokenizer is the embedded model's BPE, laid out as Qwen's: its 420 tokens, then unreachable
filler tokens (`` t<id>``: a random model's output reads as words, not as nothing) up to Qwen's
first special token at 151,643, the family's special tokens at their published ids, and an
embedding of the published 151,936 rows.
"""

from __future__ import annotations

import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from epdserve.assets import default_model_dir
from epdserve.training.build import SPECIAL_TOKENS
from tests.checkpoints import INIT_STD, qwen_image_processor, write_json

EMBED_STD = 0.02  # of the (tied) embedding
SIZES = {"qwen2_vl": "2b", "qwen2_5_vl": "3b", "qwen3_vl": "2b"}  # family -> its published size here
VOCAB_SIZE = 151936  # embedding rows of every Qwen2/2.5/3-VL checkpoint
FIRST_SPECIAL = 151643  # <|endoftext|>: Qwen's special tokens follow the BPE vocabulary from here
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
SPECIAL = SPECIAL_TOKENS  # Qwen2-VL's special tokens in id order from FIRST_SPECIAL (the embedded tokenizer's)
IDS = {t: FIRST_SPECIAL + i for i, t in enumerate(SPECIAL)}
TOKEN_IDS = {
    "bos_token_id": IDS["<|endoftext|>"],
    "eos_token_id": IDS["<|im_end|>"],
}
MEDIA_IDS = {
    "image_token_id": IDS["<|image_pad|>"],
    "video_token_id": IDS["<|video_pad|>"],
    "vision_start_token_id": IDS["<|vision_start|>"],
    "vision_end_token_id": IDS["<|vision_end|>"],
}


def _patch14_processor(processor_class: str) -> dict[str, Any]:
    """The published image processor of Qwen2-VL and Qwen2.5-VL (14-pixel patches, CLIP's statistics)."""
    return qwen_image_processor(
        min_pixels=3136,
        max_pixels=12845056,
        patch_size=14,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        processor_class=processor_class,
    )


def qwen2_vl_2b() -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen2-VL-2B-Instruct: (config.json, preprocessor_config.json)."""
    text = {
        "model_type": "qwen2_vl_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 28,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    }
    vision = {
        "model_type": "qwen2_vl_vision",
        "depth": 32,
        "embed_dim": 1280,
        "hidden_size": 1536,  # the merger's output: the language model's width
        "hidden_act": "quick_gelu",
        "mlp_ratio": 4,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    }
    config = {"architectures": ["Qwen2VLForConditionalGeneration"], "model_type": "qwen2_vl"}
    config |= {"text_config": text, "vision_config": vision, "tie_word_embeddings": True, **MEDIA_IDS}
    return config, _patch14_processor("Qwen2VLProcessor")


def qwen2_5_vl_3b() -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen2.5-VL-3B-Instruct: (config.json, preprocessor_config.json)."""
    text = {
        "model_type": "qwen2_5_vl_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 2048,
        "intermediate_size": 11008,
        "num_hidden_layers": 36,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "rms_norm_eps": 1e-6,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 70,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    }
    vision = {
        "model_type": "qwen2_5_vl_vision",
        "depth": 32,
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "out_hidden_size": 2048,
        "hidden_act": "silu",
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
    }
    config = {"architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl"}
    config |= {"text_config": text, "vision_config": vision, "tie_word_embeddings": True, **MEDIA_IDS}
    return config, _patch14_processor("Qwen2_5_VLProcessor")


def qwen3_vl_2b() -> tuple[dict[str, Any], dict[str, Any]]:
    """Qwen3-VL-2B-Instruct: (config.json, preprocessor_config.json)."""
    text = {
        "model_type": "qwen3_vl_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000.0,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": True,
        **TOKEN_IDS,
    }
    vision = {
        "model_type": "qwen3_vl_vision",
        "depth": 24,
        "hidden_size": 1024,
        "intermediate_size": 4096,
        "num_heads": 16,
        "hidden_act": "gelu_pytorch_tanh",
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 2048,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [5, 11, 17],
    }
    config = {"architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl"}
    config |= {"text_config": text, "vision_config": vision, "tie_word_embeddings": True, **MEDIA_IDS}
    processor = qwen_image_processor(
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        processor_class="Qwen3VLProcessor",
    )
    return config, processor


PUBLISHED = {"qwen2_vl": qwen2_vl_2b, "qwen2_5_vl": qwen2_5_vl_3b, "qwen3_vl": qwen3_vl_2b}


def published_config(family: str, layers: int = 0, vision_depth: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """``family``'s published (config, processor config), its depths cut to ``layers`` language
    layers / ``vision_depth`` vision blocks where given (0: the published depth). A cut tower keeps
    only the full-attention and DeepStack block indexes that still exist."""
    if family not in PUBLISHED:
        raise ValueError(f"no published size of {family!r}; known: {', '.join(PUBLISHED)}")
    config, processor = PUBLISHED[family]()
    text, vision = config["text_config"], config["vision_config"]
    if layers:
        if not 1 <= layers <= text["num_hidden_layers"]:
            raise ValueError(f"layers must be 1..{text['num_hidden_layers']}, got {layers}")
        text["num_hidden_layers"] = layers
        if "max_window_layers" in text:
            text["max_window_layers"] = min(text["max_window_layers"], layers)
    if vision_depth:
        if not 1 <= vision_depth <= vision["depth"]:
            raise ValueError(f"vision_depth must be 1..{vision['depth']}, got {vision_depth}")
        vision["depth"] = vision_depth
        for key in ("fullatt_block_indexes", "deepstack_visual_indexes"):
            if key in vision:
                kept = [i for i in vision[key] if i < vision_depth]
                vision[key] = kept or [vision_depth - 1]  # a tower keeps one block of each kind
    if "deepstack_visual_indexes" in vision:  # DeepStack adds level k after LM layer k-1
        vision["deepstack_visual_indexes"] = vision["deepstack_visual_indexes"][: text["num_hidden_layers"]]
    return config, processor


def bound_pixels(processor: dict[str, Any], max_pixels: int) -> dict[str, Any]:
    """``processor`` with its images' largest area lowered to ``max_pixels`` (Qwen2-VL's and
    Qwen2.5-VL's ``max_pixels``; Qwen3-VL's ``size.longest_edge``, an area despite its name). A
    serving machine smaller than the published bound wants this: a larger image is resized down
    rather than encoded at up to 12.8 megapixels, and vLLM's encoder instance, which encodes the
    largest item at start-up, finishes starting."""
    size = processor.get("size")
    low, high = (
        (size["shortest_edge"], size["longest_edge"]) if size else (processor["min_pixels"], processor["max_pixels"])
    )
    if not low <= max_pixels <= high:
        raise ValueError(f"max_pixels must be {low}..{high} (the processor's published bounds), got {max_pixels}")
    return processor | ({"size": size | {"longest_edge": max_pixels}} if size else {"max_pixels": max_pixels})


def build_published(
    family: str, out_dir: Path, seed: int = 0, layers: int = 0, vision_depth: int = 0, max_pixels: int = 0
) -> Path:
    """Write ``family``'s published-size checkpoint (bfloat16 safetensors, tokenizer, chat
    template, generation and processor configs) into ``out_dir``; ``max_pixels``: its images
    bounded to that area (``bound_pixels``; 0: the published bound)."""
    import transformers

    config_json, processor = published_config(family, layers, vision_depth)
    if max_pixels:
        processor = bound_pixels(processor, max_pixels)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / "config.json", config_json)
    config = transformers.AutoConfig.from_pretrained(out_dir)
    model_class = getattr(transformers, config_json["architectures"][0])
    with torch.device("meta"):
        model = model_class(config).to(torch.bfloat16)
    model.to_empty(device="cpu")  # ties break here: re-tied before filling, so the shared tensor fills once
    model.tie_weights()
    fill(model, seed)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="2GB")
    del model
    write_tokenizer(out_dir)
    write_json(out_dir / "preprocessor_config.json", processor)
    write_json(out_dir / "video_preprocessor_config.json", video_processor(family, processor))
    eos = [IDS["<|im_end|>"], IDS["<|endoftext|>"]]
    generation = {"bos_token_id": IDS["<|endoftext|>"], "eos_token_id": eos, "pad_token_id": IDS["<|endoftext|>"]}
    write_json(out_dir / "generation_config.json", {**generation, "do_sample": False})
    return out_dir


def video_processor(family: str, processor: dict[str, Any]) -> dict[str, Any]:
    """The video processor's settings: the image processor's, with the frame bounds of
    transformers' video processor classes (``Qwen2VLVideoProcessor``: 128 to 768 merged tokens of
    28 pixels a frame; ``Qwen3VLVideoProcessor``: of 32 pixels), at 2 frames per second."""
    video = {k: v for k, v in processor.items() if k not in ("image_processor_type", "size")}
    if family == "qwen3_vl":
        bounds = {"size": {"shortest_edge": 128 * 32 * 32, "longest_edge": 768 * 32 * 32}}
        return video | bounds | {"video_processor_type": "Qwen3VLVideoProcessor", "fps": 2.0}
    bounds = {"min_pixels": 128 * 28 * 28, "max_pixels": 768 * 28 * 28}
    return video | bounds | {"video_processor_type": "Qwen2VLVideoProcessor", "fps": 2.0}


def fill(model: torch.nn.Module, seed: int) -> None:
    """Every parameter in place from a generator of its own (see the module docstring)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            leaf = name.split(".")[-2] if "." in name else name
            norm = "norm" in leaf or leaf.startswith("ln")
            if norm and p.dim() == 1 and name.endswith("weight"):
                p.normal_(1.0, 0.1, generator=g)
            elif p.dim() == 1:
                p.normal_(0.0, 0.1, generator=g)
            elif "embed_tokens" in name or "lm_head" in name or "pos_embed" in name:
                p.normal_(0.0, EMBED_STD, generator=g)
            else:
                fan_in = math.prod(p.shape[1:])
                p.normal_(0.0, min(INIT_STD, fan_in**-0.5), generator=g)


def write_tokenizer(out_dir: Path) -> None:
    """The embedded model's tokenizer in Qwen's id layout (module docstring), its chat template."""
    src = default_model_dir()
    tok = json.loads((src / "tokenizer.json").read_text())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    for i in range(len(vocab), FIRST_SPECIAL):
        vocab["\u0120t" + str(i)] = i  # Ġ: byte-level BPE's space
    if len(vocab) != FIRST_SPECIAL:
        raise ValueError("a filler token collides with the embedded vocabulary")
    added = []
    for entry in tok["added_tokens"]:
        added.append({**entry, "id": IDS[entry["content"]]})
    tok["added_tokens"] = added
    cfg["added_tokens_decoder"] = {str(e["id"]): {k: v for k, v in e.items() if k != "id"} for e in added}
    cfg["model_max_length"] = 32768
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    (out_dir / "chat_template.json").write_text((src / "chat_template.json").read_text())
