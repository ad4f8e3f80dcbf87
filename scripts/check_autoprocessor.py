"""Check that transformers' AutoProcessor loads the embedded checkpoint (needs torchvision).

transformers' Qwen2-VL processor requires torchvision for its video processor; PyPI's torchvision
does not import beside the CPU torch this project pins, so this check runs in a separate
environment (not in CI):

    python -m venv /tmp/tv && /tmp/tv/bin/pip install torch==2.14.1 torchvision==0.29.1 transformers==5.24.0 \
        msgspec xxhash aiohttp av && /tmp/tv/bin/pip install --no-deps -e . && /tmp/tv/bin/python scripts/check_autoprocessor.py
"""

from __future__ import annotations

import sys

import numpy as np
from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

from epdserve.assets import default_model_dir
from epdserve.media.processor import ProcessorConfig, VisionProcessor
from epdserve.shapes import ShapesWorld

d = sys.argv[1] if len(sys.argv) > 1 else str(default_model_dir())
proc = AutoProcessor.from_pretrained(d)
print(type(proc).__name__, type(proc.image_processor).__name__, type(proc.video_processor).__name__)
model = Qwen2VLForConditionalGeneration.from_pretrained(d)
ours = VisionProcessor(ProcessorConfig.from_pretrained(d))
world = ShapesWorld(3)
for _ in range(8):
    s = world.sample("describe")
    img = s.scenes[0].render()
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": s.question}]}]
    text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    inp = proc(text=[text], images=[img], return_tensors="pt")
    o = ours.image(img)
    diff = float(np.abs(inp["pixel_values"].numpy() - o.pixel_values).max())
    out = model.generate(**inp, max_new_tokens=24, do_sample=False)
    answer = proc.batch_decode(out[:, inp["input_ids"].shape[1] :], skip_special_tokens=True)[0]
    print(
        f"grid {inp['image_grid_thw'].tolist()[0]} ours {list(o.grid_thw)} max|diff| {diff:.1e}  {answer!r} / {s.answer!r}"
    )
