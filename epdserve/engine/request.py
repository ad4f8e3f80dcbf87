"""A request's state inside the engine.

One progress counter per request (``num_computed_tokens``) instead of phase flags: the request
is prefilling while it is below the prompt length and decoding after. On preemption the counter
goes back to zero and the request is recomputed (its output tokens become part of the prefill).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from epdserve.common.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class MediaItem:
    """One image, video or audio inside the prompt: its placeholder run and where its embeddings come from."""

    uuid: str  # content hash (model, modality, bytes, processor kwargs)
    modality: str  # "image" | "video" | "audio"
    offset: int  # index of the first placeholder token in the prompt
    length: int  # number of placeholder tokens (= embedding rows)
    grid_thw: tuple[int, int, int]  # extent in its encoder's units: (t, h, w) patches; audio (1, mel frames, 1)
    pixel_values: torch.Tensor | None = None  # raw path: the local encoder's input (patches, or log-mel frames)
    embeddings: torch.Tensor | None = None  # metadata-only path (or after encoding): [length, hidden]
    handle: dict[str, Any] | None = None  # signed EC handle the core fetches the embeddings by
    # (prompt offset, rows) of each placeholder run when the rows are split over several (a
    # Qwen3-VL video: one per frame group); empty: one run of ``length`` at ``offset``
    runs: tuple[tuple[int, int], ...] = ()

    @property
    def end(self) -> int:
        """The position after the item's last placeholder."""
        return self.runs[-1][0] + self.runs[-1][1] if self.runs else self.offset + self.length

    def placements(self) -> list[tuple[int, int, int]]:
        """(prompt offset, first embedding row, rows) of each placeholder run, in prompt order."""
        if not self.runs:
            return [(self.offset, 0, self.length)]
        out, row = [], 0
        for offset, n in self.runs:
            out.append((offset, row, n))
            row += n
        return out


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    mm_items: list[MediaItem] = field(default_factory=list)
    mrope_positions: torch.Tensor | None = None  # [3, prompt_len] (None: text-only, 1-D positions)
    mrope_delta: int = 0
    arrival: float = 0.0
    eos_token_ids: frozenset[int] = frozenset()

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    pending_fetches: int = 0  # media items (or the KV) still being fetched by handle
    kv_produce: bool = False  # prefill instance: hand the prompt's KV on after the first token
    kv_rows: torch.Tensor | None = None  # decode instance: the prompt's KV, loaded, not yet in blocks
    # stage clock (the core's perf_counter): received (read off the channel, maybe during a step),
    # added, every fetch done, first admitted; 0 = not yet
    t_received: float = 0.0
    t_added: float = 0.0
    t_ready: float = 0.0
    t_admitted: float = 0.0
    timed: bool = False  # its first output (which carries the stage times) was made

    @property
    def ready(self) -> bool:
        """Schedulable: every embedding it needs is here."""
        return self.pending_fetches == 0

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = self.prompt_len
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """Rotary positions [3, end-start] of tokens start..end (M-RoPE rows for the prompt)."""
        p = self.prompt_len
        if self.mrope_positions is None:
            return torch.arange(start, end).expand(3, -1)
        parts = []
        if start < p:
            parts.append(self.mrope_positions[:, start : min(end, p)])
        if end > p:
            lo = max(start, p)
            parts.append(torch.arange(lo + self.mrope_delta, end + self.mrope_delta).expand(3, -1))
        return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
