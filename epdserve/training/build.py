"""Create an untrained Qwen2-VL checkpoint directory: tokenizer, chat template, processor, config.

Everything is built offline: a byte-level BPE tokenizer learned from the shapes-world phrases
with Qwen2-VL's special tokens appended, Qwen2-VL's chat template, and a tiny Qwen2-VL config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from epdserve.shapes import ORDINALS, QUESTION_KIND, ShapesWorld

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

# Qwen2-VL's chat template (as published with the Qwen2-VL checkpoints), with its vision ids on
# unless the caller passes add_vision_id=False: "Picture 2: " before the second image names it, so
# "Describe the second image." and "Which image has ...?" bind by content instead of by counting
# images through positions (which a 4-layer model learns too slowly; see docs/embedded-model.md).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id is not defined or add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id is not defined or add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2's pre-tokenizer split pattern.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_LAYERS = 4  # language-model decoder layers of a new model
VOCAB_SIZE = 512  # model vocabulary (BPE tokens + specials, padded)
BPE_SIZE = 420


def _corpus(seed: int, n: int) -> list[str]:
    world = ShapesWorld(seed)
    template_words = ["You are a helpful assistant.", "system", "user", "assistant", "Picture", "Video"]
    lines = template_words * 50 + [f"the {o}" for o in ORDINALS]
    qtypes = list(QUESTION_KIND)
    for i in range(n):
        s = world.sample(qtypes[i % len(qtypes)])
        lines += [s.question, s.answer]
    return lines


def build_tokenizer(out_dir: Path, seed: int = 0) -> dict[str, int]:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=_regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(seed, 3000), trainer=trainer)
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    if tok.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens > {VOCAB_SIZE}")
    tok.save(str(out_dir / "tokenizer.json"))
    ids: dict[str, int] = {s: tok.token_to_id(s) or 0 for s in SPECIAL_TOKENS}
    added = [
        {
            "id": ids[s],
            "content": s,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for s in SPECIAL_TOKENS
    ]
    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "processor_class": "Qwen2VLProcessor",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
        "errors": "replace",
        "split_special_tokens": False,
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "additional_special_tokens": [s for s in SPECIAL_TOKENS if s not in ("<|endoftext|>", "<|im_end|>")],
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}, indent=2))
    return ids


def _regex(pattern: str):
    from tokenizers import Regex

    return Regex(pattern)


PROCESSOR = {
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True,
    "do_normalize": True,
    "do_resize": True,
    "do_convert_rgb": True,
    "rescale_factor": 1 / 255,
    "resample": 3,
}


def build_config(ids: dict[str, int], layers: int = DEFAULT_LAYERS) -> dict:
    text = {
        "model_type": "qwen2_vl_text",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "max_window_layers": layers,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10.0, "mrope_section": [8, 12, 12]},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "tie_word_embeddings": True,
    }
    vision = {
        "model_type": "qwen2_vl",
        "depth": 4,
        "embed_dim": 128,
        "hidden_size": 256,
        "num_heads": 4,
        "mlp_ratio": 2,
        "in_channels": 3,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "hidden_act": "quick_gelu",
    }
    return {
        "architectures": ["Qwen2VLForConditionalGeneration"],
        "model_type": "qwen2_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "tie_word_embeddings": True,
    }


def build_untrained(out_dir: Path, seed: int = 0, layers: int = DEFAULT_LAYERS) -> None:
    """Write a complete, randomly initialised checkpoint directory (``layers`` language-model layers)."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    out_dir.mkdir(parents=True, exist_ok=True)
    ids = build_tokenizer(out_dir, seed)
    torch.manual_seed(seed)
    cfg = Qwen2VLConfig(**build_config(ids, layers))
    model = Qwen2VLForConditionalGeneration(cfg)
    model.save_pretrained(out_dir)
    write_processor_files(out_dir, ids)


def write_processor_files(out_dir: Path, ids: dict[str, int]) -> None:
    pp = dict(PROCESSOR, image_processor_type="Qwen2VLImageProcessor", processor_class="Qwen2VLProcessor")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(pp, indent=2))
    vp = dict(PROCESSOR, video_processor_type="Qwen2VLVideoProcessor", processor_class="Qwen2VLProcessor", num_frames=4)
    (out_dir / "video_preprocessor_config.json").write_text(json.dumps(vp, indent=2))
    gen = {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
        "do_sample": False,
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2))
