"""A tiny Qwen2.5-VL: transformers' own ``Qwen2_5_VLForConditionalGeneration`` at a small size with
the real structure.

What the sizes exercise: a 4-block tower whose blocks 0 and 2 attend in windows of 112 pixels
(4 x 4 merged tokens) and blocks 1 and 3 over whole frames; the pixel bounds make every image and
video frame (140 to 224 pixels a side) span several windows, the edge ones partial. The language
model has 3 layers, GQA (4 query / 2 key-value heads), tied embeddings and a [4, 6, 6] M-RoPE
section. Videos are sampled at 1 fps (video_preprocessor_config.json), so one temporal patch spans
2 s and, at 2 tokens per second, frame groups sit 4 temporal positions apart (not the 2 a default
second per grid gives). The processor files are the hub checkpoints' (``min_pixels``/``max_pixels``).
"""

from __future__ import annotations

from pathlib import Path

from tests.checkpoints import VOCAB_SIZE, copy_tokenizer, qwen_image_processor, save_random, write_json

PATCH, MERGE, TEMPORAL = 14, 2, 2
MIN_PIXELS, MAX_PIXELS, VIDEO_MAX_PIXELS = 140 * 140, 224 * 224, 168 * 168
WINDOW = 112  # pixels: 4 merged tokens a side
FPS = 1.0  # frames per second of the sampled video frames
TOKENS_PER_SECOND = 2
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def build(out_dir: Path, seed: int) -> Path:
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = copy_tokenizer(out_dir)
    config = Qwen2_5_VLConfig(
        text_config={
            "model_type": "qwen2_5_vl_text",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "tie_word_embeddings": True,
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
        vision_config={
            "model_type": "qwen2_5_vl_vision",
            "depth": 4,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_heads": 4,
            "hidden_act": "silu",
            "in_channels": 3,
            "patch_size": PATCH,
            "spatial_merge_size": MERGE,
            "temporal_patch_size": TEMPORAL,
            "window_size": WINDOW,
            "fullatt_block_indexes": [1, 3],
            "tokens_per_second": TOKENS_PER_SECOND,
            "out_hidden_size": 128,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
    )
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    save_random(Qwen2_5_VLForConditionalGeneration(config).eval(), out_dir, seed)
    processor = qwen_image_processor(
        min_pixels=MIN_PIXELS,
        max_pixels=MAX_PIXELS,
        patch_size=PATCH,
        temporal_patch_size=TEMPORAL,
        merge_size=MERGE,
        image_mean=CLIP_MEAN,
        image_std=CLIP_STD,
        processor_class="Qwen2_5_VLProcessor",
    )
    write_json(out_dir / "preprocessor_config.json", processor)
    video = {
        **{k: v for k, v in processor.items() if k != "image_processor_type"},
        "max_pixels": VIDEO_MAX_PIXELS,
        "fps": FPS,
        "num_frames": 4,
        "video_processor_type": "Qwen2VLVideoProcessor",
    }
    write_json(out_dir / "video_preprocessor_config.json", video)
    return out_dir
