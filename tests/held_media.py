"""An image held in preprocessing: a role's ``VisionProcessor.image`` that waits once entered."""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType
from typing import Any

from epdserve.media.processor import VisionInput, VisionProcessor


class HeldImages:
    """While open, each image the processor preprocesses records its size, sets ``entered`` and
    waits for ``gate``; closed, the processor is as it was."""

    def __init__(self, processor: VisionProcessor) -> None:
        self.processor, self.real = processor, processor.image
        self.gate, self.entered = threading.Event(), threading.Event()
        self.sizes: list[tuple[int, int]] = []

    def _image(self, img: Any) -> VisionInput:
        self.sizes.append(img.size)
        self.entered.set()
        self.gate.wait(10)
        return self.real(img)

    async def wait_entered(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.entered.wait, 10)

    def hold_again(self) -> None:
        self.gate.clear()
        self.entered.clear()

    def __enter__(self) -> HeldImages:
        self.processor.image = self._image  # type: ignore[method-assign]
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.gate.set()
        self.processor.image = self.real  # type: ignore[method-assign]
