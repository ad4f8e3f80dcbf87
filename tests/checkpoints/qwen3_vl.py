"""A tiny Qwen3-VL: transformers' own ``Qwen3VLForConditionalGeneration`` at a small size with the
real structure.

What the sizes exercise: a patch-16 tower of 5 blocks whose learned 8 x 8 position table is
interpolated to every other grid, DeepStack taps after blocks 1 and 3 (so the language model
receives features at its first two layers of four), an explicit LM head_dim (48) that differs from
hidden / heads (32), GQA, per-head q/k RMSNorm, and interleaved M-RoPE with a [10, 7, 7] section.
The processor settings are Qwen3-VL's (``size: {shortest_edge, longest_edge}``, mean/std 0.5),
with pixel bounds small enough for fast tests.
"""

from __future__ import annotations

from pathlib import Path

from tests.checkpoints import VOCAB_SIZE, copy_tokenizer, qwen_image_processor, save_random, write_json

PATCH, MERGE, TEMPORAL = 16, 2, 2
MIN_PIXELS, MAX_PIXELS = 64 * 64, 160 * 160


def build(out_dir: Path, seed: int) -> Path:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = copy_tokenizer(out_dir)
    config = Qwen3VLConfig(
        text_config={
            "model_type": "qwen3_vl_text",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 48,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 1000.0,
                "mrope_section": [10, 7, 7],
                "mrope_interleaved": True,
            },
            "attention_bias": False,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "model_type": "qwen3_vl_vision",
            "depth": 5,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_heads": 4,
            "hidden_act": "gelu_pytorch_tanh",
            "in_channels": 3,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "out_hidden_size": 128,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [1, 3],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.architectures = ["Qwen3VLForConditionalGeneration"]
    save_random(Qwen3VLForConditionalGeneration(config).eval(), out_dir, seed)
    processor = qwen_image_processor(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        processor_class="Qwen3VLProcessor",
    )
    write_json(out_dir / "preprocessor_config.json", processor)
    video = {
        **{k: v for k, v in processor.items() if k != "image_processor_type"},
        "fps": 2,
        "num_frames": 4,
        "video_processor_type": "Qwen3VLVideoProcessor",
    }
    write_json(out_dir / "video_preprocessor_config.json", video)
    return out_dir
