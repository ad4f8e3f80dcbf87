"""Executes one scheduled step: vision encoding where needed, the language model, sampling.

Inputs of the step are flattened: all scheduled tokens of all requests in one row batch, with
their M-RoPE positions and KV slots. Vision embeddings replace the token embeddings at the
placeholder positions that fall inside this step's chunk of each request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from epdserve.cache.embedding_cache import EmbeddingCache
from epdserve.engine.attention import KVCache, PagedAttention, SeqSlice
from epdserve.engine.config import EngineConfig
from epdserve.engine.request import MediaItem
from epdserve.engine.sampler import sample
from epdserve.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


class MediaError(RuntimeError):
    """A request's media could not be turned into embeddings (fails only that request)."""


@dataclass
class StepResult:
    sampled: dict[str, tuple[int, float]]  # request id -> (token, logprob)
    failed: dict[str, str]  # request id -> error message


class ModelRunner:
    def __init__(self, model, config: EngineConfig, dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = config
        self.dtype = dtype
        self.device = device
        lm = model.language_model
        tc = lm.config
        self.kv = KVCache(
            tc.num_hidden_layers,
            config.num_kv_blocks * config.block_size,
            tc.num_key_value_heads,
            tc.head_dim,
            dtype,
            device,
        )
        self.encoder_cache = EmbeddingCache(config.encoder_cache_bytes)
        self.hidden_size = tc.hidden_size
        bs = config.block_size
        self._offsets = torch.arange(bs)

    # ---- vision ------------------------------------------------------------------------------
    def _ensure_embeddings(self, items: list[MediaItem]) -> None:
        """Fill ``item.embeddings`` for every item: cache hit, or one batched vision forward."""
        todo: list[MediaItem] = []
        for it in items:
            if it.embeddings is not None:
                continue
            cached = self.encoder_cache.get(it.uuid)
            if cached is not None and cached.shape[0] == it.length:
                it.embeddings = cached
            elif it.pixel_values is None:
                raise MediaError(f"no embeddings and no pixels for media item {it.uuid}")
            else:
                todo.append(it)
        if not todo:
            return
        if self.model.visual is None:
            raise MediaError("this instance has no vision tower; send metadata-only media items")
        pixels = torch.cat([it.pixel_values for it in todo]).to(self.device, self.dtype)  # type: ignore[misc]
        grid = torch.tensor([it.grid_thw for it in todo], dtype=torch.long)
        emb = self.model.visual(pixels, grid)
        for it, e in zip(todo, emb.split([it.length for it in todo]), strict=True):
            it.embeddings = e
            it.pixel_values = None  # pixels are not needed again
            self.encoder_cache.put(it.uuid, e)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        failed: dict[str, str] = {}
        scheduled = []
        for s in plan.scheduled:
            req = s.request
            needed = [it for it in req.mm_items if it.offset < s.end and it.end > s.start]
            try:
                self._ensure_embeddings(needed)
            except MediaError as e:
                failed[req.request_id] = str(e)
                continue
            except Exception as e:  # a bad item must not take the batch down
                log.exception("vision encoding failed for %s", req.request_id)
                failed[req.request_id] = f"vision encoding failed: {e}"
                continue
            scheduled.append(s)
        if not scheduled:
            return StepResult({}, failed)

        lm = self.model.language_model
        ids, pos, seqs = [], [], []
        q = 0
        bs = self.config.block_size
        for s in scheduled:
            req = s.request
            ids.extend(req.token_ids(s.start, s.end))
            pos.append(req.positions(s.start, s.end))
            blocks = torch.tensor(req.block_ids, dtype=torch.long)
            slots = (blocks[:, None] * bs + self._offsets[None, :]).reshape(-1)[: s.end]
            seqs.append(SeqSlice(q, s.num_new_tokens, s.end, slots))
            q += s.num_new_tokens
        tokens = torch.tensor(ids, dtype=torch.long, device=self.device)
        embeds = lm.embed_tokens(tokens).to(self.dtype)
        for s, sl in zip(scheduled, seqs, strict=True):
            for it in s.request.mm_items:
                a, b = max(it.offset, s.start), min(it.end, s.end)
                if a < b:
                    assert it.embeddings is not None
                    rows = it.embeddings[a - it.offset : b - it.offset]
                    embeds[sl.q_start + a - s.start : sl.q_start + b - s.start] = rows.to(self.dtype)
        positions = torch.cat(pos, dim=1).to(self.device)
        attention = PagedAttention(self.kv, seqs, self.device)
        hidden = lm(embeds, positions, attention)
        sampling = [(s, sl) for s, sl in zip(scheduled, seqs, strict=True) if s.samples]
        sampled: dict[str, tuple[int, float]] = {}
        if sampling:
            rows = torch.tensor([sl.q_start + sl.q_len - 1 for _, sl in sampling], device=self.device)
            logits = lm.compute_logits(hidden[rows])
            reqs = [s.request for s, _ in sampling]
            toks, lps = sample(logits, reqs)
            for r, t, lp in zip(reqs, toks, lps, strict=True):
                sampled[r.request_id] = (t, lp)
        return StepResult(sampled, failed)
