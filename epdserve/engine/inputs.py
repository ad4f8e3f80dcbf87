"""From chat messages with media to an engine request's prompt.

The chat template renders one placeholder token per media item; each is expanded here to the
item's embedding count, taken from its grid by the model's ``PromptLayout`` (which may write an item
out as several runs with text between them: Qwen3-VL's timestamped video frame groups) — pixels or
metadata alone give the same prompt and the same rotary positions. This is front-end code: it builds the
engine's wire messages with numpy and never imports torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from epdserve.engine.messages import MediaSpec, WireTensor
from epdserve.models.base import ExpandsMedia, Expansion
from epdserve.models.config import ModelConfig
from epdserve.models.registry import prompt_layout


class PromptError(ValueError):
    """The messages and media do not make a valid prompt (a client error)."""


@dataclass(frozen=True)
class MediaInput:
    """A media item ready for the engine: identity, layout, and pixels or embeddings."""

    uuid: str
    modality: str  # "image" | "video" | "audio"
    grid_thw: tuple[int, int, int]  # extent in its encoder's units: (t, h, w) patches; audio (1, mel frames, 1)
    pixel_values: np.ndarray | None = None  # encoder input: patches [P, patch_dim], or log-mel frames [F, mels]
    embeddings: WireTensor | None = None  # [rows, hidden] by value (a client's own, inline)
    handle: dict[str, Any] | None = None  # signed EC handle: the engine core fetches the embeddings
    second_per_grid: float | None = None  # a video's seconds per temporal patch (None: the model's default)


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    mm_items: list[MediaSpec]
    mrope_positions: np.ndarray | None  # int64 [rows, len(token_ids)]
    mrope_delta: int


# apply_chat_template's own arguments: a request cannot change them through chat_template_kwargs
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class InputBuilder:
    def __init__(self, tokenizer, config: ModelConfig) -> None:
        self.tok = tokenizer
        self.config = config
        self.layout = prompt_layout(config)
        self.placeholder = {
            "image": config.image_token_id,
            "video": config.video_token_id,
            "audio": config.audio_token_id,
        }
        # placeholder token -> its modality, for the kinds this model has a token for
        self.modality_of = {token: kind for kind, token in self.placeholder.items() if token is not None}

    def num_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        try:
            return self.layout.num_placeholders(grid_thw)
        except ValueError as e:
            raise PromptError(f"invalid grid_thw {list(grid_thw)}: {e}") from None

    def _expand(self, m: MediaInput, token: int, rows: int) -> Expansion:
        """The tokens one placeholder becomes: ``rows`` placeholders in a row, unless the model's
        layout writes the item out otherwise (Qwen3-VL's timestamped frame groups)."""
        if not isinstance(self.layout, ExpandsMedia):
            return Expansion([token] * rows, [(0, rows)])
        encode = lambda text: list(self.tok.encode(text, add_special_tokens=False))  # noqa: E731
        try:
            out = self.layout.expand(m.modality, m.grid_thw, encode, m.second_per_grid)
        except ValueError as e:
            raise PromptError(f"invalid {m.modality} {list(m.grid_thw)}: {e}") from None
        if sum(k for _, k in out.runs) != rows:  # the layout's own invariant: one row per placeholder
            raise PromptError(f"the prompt layout placed {sum(k for _, k in out.runs)} of {rows} rows")
        return out

    def render(
        self, messages: list[dict], template_kwargs: Mapping[str, Any] | None = None, max_tokens: int | None = None
    ) -> list[int]:
        """Chat template → token ids (one placeholder token per media item).

        ``template_kwargs`` are extra variables for the template (e.g. ``add_vision_id``); they may
        not override how the prompt is rendered. ``max_tokens``: a prompt rendering to more tokens
        raises the tokenizer's ``TooManyTokens`` at the cost of that many (placeholders count one).
        """
        kwargs = dict(template_kwargs or {})
        reserved = RESERVED_TEMPLATE_KWARGS.intersection(kwargs)
        if reserved:
            raise PromptError(f"chat_template_kwargs may not set {sorted(reserved)}")
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        except Exception as e:
            raise PromptError(f"could not apply the chat template: {e}") from e
        if max_tokens is not None:
            return list(self.tok.encode_within(text, max_tokens))
        return list(self.tok.encode(text, add_special_tokens=False))

    def build(
        self,
        messages: list[dict],
        media: list[MediaInput],
        template_kwargs: Mapping[str, Any] | None = None,
        max_tokens: int | None = None,
    ) -> Prompt:
        ids = self.render(messages, template_kwargs, max_tokens)
        expanded: list[int] = []
        items: list[MediaSpec] = []
        pending = iter(media)
        seen = 0
        for t in ids:
            modality = self.modality_of.get(t)
            if modality is None:
                expanded.append(t)
                continue
            if modality not in self.config.modalities:
                raise PromptError(f"{modality} is not supported for this architecture ({self.config.architecture})")
            m = next(pending, None)
            seen += 1
            if m is None or m.modality != modality:
                raise PromptError("the media parts do not match the prompt's placeholders")
            n = self.num_tokens(m.grid_thw)
            if m.embeddings is not None and m.embeddings.shape[0] != n:
                raise PromptError(f"embeddings have {m.embeddings.shape[0]} rows, grid {list(m.grid_thw)} needs {n}")
            tokens, runs = self._expand(m, t, n)
            at = len(expanded)
            pixels = WireTensor.of(m.pixel_values) if m.pixel_values is not None else None
            split = tuple((at + o, k) for o, k in runs) if len(runs) > 1 else ()
            spec = MediaSpec(m.uuid, modality, at + runs[0][0], n, m.grid_thw, pixels, m.embeddings, m.handle, split)
            items.append(spec)
            expanded += tokens
        if seen != len(media):
            raise PromptError(f"{len(media)} media items but {seen} placeholders in the prompt")
        grids_i = [it.grid_thw for it in items if it.modality == "image"]
        grids_v = [it.grid_thw for it in items if it.modality == "video"]
        if grids_v:  # (layouts of models without video need not take the seconds)
            seconds = [m.second_per_grid for m in media if m.modality == "video"]
            pos, delta = self.layout.positions(expanded, grids_i, grids_v, video_second_per_grid=seconds)
        else:
            pos, delta = self.layout.positions(expanded, grids_i, grids_v)
        return Prompt(expanded, items, pos, delta)
