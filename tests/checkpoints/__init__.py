"""Small random-weight checkpoints of real architectures, built offline from transformers' own
classes: the oracle for model families whose weights cannot be downloaded here.

Each family module (``qwen2_5_vl``, ``qwen3_vl``, ``qwen2_audio``) has ``build(out_dir, seed)``
which writes a complete checkpoint directory (config, safetensors, tokenizer, chat template,
processor configs) with the real config's structure at a tiny size. The tokenizer is the embedded
model's (a 420-token BPE with Qwen's special tokens), extended by the tokens a family adds.
``scripts/build_checkpoint.py`` is the command-line entry; tests build into a temporary directory.
"""

from __future__ import annotations

import importlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch

from epdserve.assets import default_model_dir

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen2_audio")
VOCAB_SIZE = 512  # rows of the embedding: the tokenizer's 420 + special tokens, rounded up
INIT_STD = 0.15  # large enough that greedy logits have clear winners (no ties across kernels)


def build(family: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write ``family``'s checkpoint into ``out_dir`` (created) and return it."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    module = importlib.import_module(f"tests.checkpoints.{family}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path: Path = module.build(out, seed)
    # save_pretrained writes a generation config of its own (one eos); the tokenizer's, with both
    # of its end tokens, is the one every family's chat template ends turns with
    shutil.copy(default_model_dir() / "generation_config.json", path / "generation_config.json")
    return path


def copy_tokenizer(
    out_dir: Path, extra_special: list[str] | None = None, chat_template: str | None = None
) -> dict[str, int]:
    """The embedded model's tokenizer files into ``out_dir``, with ``extra_special`` tokens appended
    after its own; returns every special token's id (``build`` adds its generation config)."""
    src = default_model_dir()
    tok = json.loads((src / "tokenizer.json").read_text())
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    next_id = max(t["id"] for t in tok["added_tokens"]) + 1
    for content in extra_special or []:
        entry = {
            "id": next_id,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        tok["added_tokens"].append(entry)
        cfg["added_tokens_decoder"][str(next_id)] = {k: v for k, v in entry.items() if k != "id"}
        next_id += 1
    if next_id > VOCAB_SIZE:
        raise ValueError(f"{next_id} tokens do not fit a vocabulary of {VOCAB_SIZE}")
    if chat_template is not None:  # tokenizer_config.json's template wins over chat_template.json
        cfg["chat_template"] = chat_template
    (out_dir / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False))
    template = chat_template
    if template is None:
        shutil.copy(src / "chat_template.json", out_dir / "chat_template.json")
    else:
        (out_dir / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    return {t["content"]: int(t["id"]) for t in tok["added_tokens"]}


def randomize(model: torch.nn.Module, seed: int, std: float = INIT_STD) -> None:
    """Seeded normal weights (norm scales near one), replacing transformers' near-zero init, so a
    tiny model's outputs depend on every weight and its greedy argmax has margin."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            norm = "norm" in name or "ln" in name.split(".")[-2]
            if norm and p.dim() == 1 and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * noise)
            elif norm and name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(std * noise)


def save_random(model: torch.nn.Module, out_dir: Path, seed: int) -> None:
    """``model`` with seeded random weights (``randomize``), saved as safetensors in ``out_dir``."""
    randomize(model, seed)
    model.save_pretrained(out_dir, safe_serialization=True)


def qwen_image_processor(**fields: Any) -> dict[str, Any]:
    """A Qwen-VL ``preprocessor_config.json``: the settings every family shares, then ``fields``."""
    return {
        "do_rescale": True,
        "do_normalize": True,
        "do_resize": True,
        "do_convert_rgb": True,
        "rescale_factor": 1 / 255,
        "resample": 3,
        "image_processor_type": "Qwen2VLImageProcessor",
        **fields,
    }


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2))
