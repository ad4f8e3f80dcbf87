"""A tiny random-weight Qwen2-Audio: Whisper-style audio encoder (3 blocks, width 64, the real 128
mel bins and 1500 source positions, so a 30 s window fits), projector, and a 3-layer Qwen2 LM.

The chat template is the one transformers' Qwen2AudioProcessor ships (each audio part renders as
``Audio k: <|audio_bos|><|AUDIO|><|audio_eos|>``); the processor config is Qwen2-Audio's
WhisperFeatureExtractor (16 kHz, n_fft 400, hop 160, 30 s chunks).
"""

from __future__ import annotations

from pathlib import Path

from tests.checkpoints import VOCAB_SIZE, copy_tokenizer, save_random, write_json

AUDIO_TOKENS = ["<|audio_bos|>", "<|AUDIO|>", "<|audio_eos|>"]

# transformers' Qwen2AudioProcessor.default_chat_template (the hub checkpoints carry the same text)
CHAT_TEMPLATE = (
    "{% set audio_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if 'audio' in content or 'audio_url' in content or content['type'] == 'audio' %}"
    "{% set audio_count.value = audio_count.value + 1 %}"
    "Audio {{ audio_count.value }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif 'text' in content %}"
    "{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|im_start|>assistant\n"
    "{% endif %}"
)

NUM_MEL_BINS = 128
MAX_SOURCE_POSITIONS = 1500


def build(out_dir: Path, seed: int) -> Path:
    from transformers import Qwen2AudioConfig, Qwen2AudioForConditionalGeneration

    ids = copy_tokenizer(out_dir, extra_special=AUDIO_TOKENS, chat_template=CHAT_TEMPLATE)
    eos = ids["<|im_end|>"]
    pad = ids["<|endoftext|>"]
    config = Qwen2AudioConfig(
        audio_config={
            "model_type": "qwen2_audio_encoder",
            "num_mel_bins": NUM_MEL_BINS,
            "d_model": 64,
            "encoder_layers": 3,
            "encoder_attention_heads": 4,
            "encoder_ffn_dim": 128,
            "max_source_positions": MAX_SOURCE_POSITIONS,
            "activation_function": "gelu",
        },
        text_config={
            "model_type": "qwen2",
            "vocab_size": VOCAB_SIZE,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
            "tie_word_embeddings": False,
            "bos_token_id": pad,
            "eos_token_id": eos,
            "pad_token_id": pad,
        },
        audio_token_index=ids["<|AUDIO|>"],
        tie_word_embeddings=False,
    )
    model = Qwen2AudioForConditionalGeneration(config)
    save_random(model, out_dir, seed)
    write_json(
        out_dir / "preprocessor_config.json",
        {
            "chunk_length": 30,
            "dither": 0.0,
            "feature_extractor_type": "WhisperFeatureExtractor",
            "feature_size": NUM_MEL_BINS,
            "hop_length": 160,
            "n_fft": 400,
            "n_samples": 480000,
            "nb_max_frames": 3000,
            "padding_side": "right",
            "padding_value": 0.0,
            "processor_class": "Qwen2AudioProcessor",
            "return_attention_mask": True,
            "sampling_rate": 16000,
        },
    )
    return out_dir
