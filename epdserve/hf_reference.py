"""The reference: Hugging Face transformers' model class of our checkpoint's architecture, greedy.

Used as the correctness oracle (our engine must produce the same tokens), by ``epdserve demo``
and by ``epdserve eval-shapes``. transformers' video processor needs torchvision, so media is
preprocessed by our own processor, which equals transformers' image processor (tested).
Placeholders are expanded one run per item, Qwen2-VL's rule: a Qwen3-VL video (one timestamped run
per frame group) is not built here; its oracle test builds transformers' inputs itself.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from epdserve.media.processor import ProcessorConfig, VisionInput, VisionProcessor

EmbedOverride = Callable[[torch.Tensor], torch.Tensor]


def model_inputs(
    input_ids: torch.Tensor, image_token_id: int, video_token_id: int, imgs: list[VisionInput], vids: list[VisionInput]
) -> dict[str, torch.Tensor]:
    """transformers' model inputs for an expanded prompt ``[1, N]`` and our preprocessed pixels."""
    mm = torch.zeros_like(input_ids)
    mm[input_ids == image_token_id] = 1
    mm[input_ids == video_token_id] = 2
    out = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "mm_token_type_ids": mm}
    if imgs:
        out["pixel_values"] = torch.from_numpy(np.concatenate([v.pixel_values for v in imgs]))
        out["image_grid_thw"] = torch.tensor([v.grid_thw for v in imgs])
    if vids:
        out["pixel_values_videos"] = torch.from_numpy(np.concatenate([v.pixel_values for v in vids]))
        out["video_grid_thw"] = torch.tensor([v.grid_thw for v in vids])
    return out


class HFReference:
    def __init__(
        self,
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        import transformers

        self.model_dir = Path(model_dir)
        self.template_kwargs = dict(template_kwargs or {})
        self.tok = transformers.AutoTokenizer.from_pretrained(self.model_dir)
        architecture = json.loads((self.model_dir / "config.json").read_text())["architectures"][0]
        model_class = getattr(transformers, architecture)
        self.model = model_class.from_pretrained(self.model_dir, dtype=dtype).eval()
        # Qwen2.5-VL: video positions follow the seconds each temporal patch spans
        self.timed_video = "second_per_grid_ts" in inspect.signature(self.model.forward).parameters
        self.proc = VisionProcessor(ProcessorConfig.from_pretrained(self.model_dir))
        cfg = self.model.config
        self.image_token_id = cfg.image_token_id
        self.video_token_id = cfg.video_token_id
        self.merge = self.proc.config.merge_size
        self._override: EmbedOverride | None = None
        self.model.model.visual.register_forward_hook(self._hook)

    def _count(self, grid_thw: tuple[int, int, int]) -> int:
        """Placeholders per item, counted here independently of the model code under test."""
        t, h, w = grid_thw
        return t * h * w // (self.merge * self.merge)

    def _hook(self, module, args, output):
        if self._override is None:
            return output
        if hasattr(output, "pooler_output"):
            output.pooler_output = self._override(output.pooler_output)
            return output
        return self._override(output)

    def inputs(
        self,
        messages: list[dict],
        images: list[Image.Image] | None = None,
        videos: list[list[Image.Image]] | None = None,
        video_seconds: list[float] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Model inputs for chat ``messages`` whose image/video parts are filled in order;
        ``video_seconds``: per video, the seconds one temporal patch spans (None: the frames stand
        for the processor's fps, as a video file without timing)."""
        prompt = self.tok.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.template_kwargs
        )
        ids = self.tok(prompt, add_special_tokens=False)["input_ids"]
        imgs = [self.proc.image(im) for im in images or []]
        vids = [self.proc.video(v) for v in videos or []]
        it_i, it_v = iter(imgs), iter(vids)
        expanded: list[int] = []
        for t in ids:
            if t == self.image_token_id:
                expanded += [t] * self._count(next(it_i).grid_thw)
            elif t == self.video_token_id:
                expanded += [t] * self._count(next(it_v).grid_thw)
            else:
                expanded.append(t)
        out = model_inputs(torch.tensor([expanded]), self.image_token_id, self.video_token_id, imgs, vids)
        if vids and self.timed_video:
            seconds = video_seconds or [self.proc.config.second_per_grid] * len(vids)
            out["second_per_grid_ts"] = torch.tensor(seconds)
        return out

    @torch.inference_mode()
    def generate_ids(
        self, inputs: dict[str, torch.Tensor], max_new_tokens: int = 32, override: EmbedOverride | None = None
    ) -> list[int]:
        self._override = override
        try:
            out = self.model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
        finally:
            self._override = None
        return out[0, inputs["input_ids"].shape[1] :].tolist()

    def answer(
        self,
        question: str,
        images: list[Image.Image] | None = None,
        video: list[Image.Image] | None = None,
        override: EmbedOverride | None = None,
    ) -> str:
        media: list[dict] = [{"type": "video"}] if video else [{"type": "image"} for _ in images or []]
        messages = [{"role": "user", "content": [*media, {"type": "text", "text": question}]}]
        inputs = self.inputs(messages, images=images, videos=[video] if video else None)
        ids = self.generate_ids(inputs, override=override)
        return str(self.tok.decode(ids, skip_special_tokens=True)).strip()
