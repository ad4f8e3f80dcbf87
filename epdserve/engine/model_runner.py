"""Executes one scheduled step, in the order ``execute`` lists its steps::

    encode media ─► lay out the step ─► load remote KV ─► merge embeddings ─► forward ─► sample

Inputs of the step are flattened: all scheduled tokens of all requests in one row batch, with
their M-RoPE positions and KV slots. Vision embeddings replace the token embeddings at the
placeholder positions that fall inside this step's chunk of each request; an item split over
several placeholder runs (``MediaItem.runs``: a Qwen3-VL video's frame groups) gives each run its
own rows, in order.

A DeepStack model (Qwen3-VL) has several feature levels per embedding row, side by side
([rows, levels * H]): level 0 replaces the placeholder embeddings like any model's, level k ≥ 1 is
added to the same rows after language-model layer k-1 (``models.base.DeepStack``). Both are
row-local, so a chunk of a prompt takes exactly the levels of its own rows.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch

from epdserve.cache.embedding_cache import EmbeddingCache
from epdserve.cache.pages import in_own_pages
from epdserve.common.dtypes import torch_dtype
from epdserve.common.rates import CostRate
from epdserve.engine.attention import PagedAttention, PrefillSlice, StepLayout
from epdserve.engine.config import EngineConfig
from epdserve.engine.decode_path import choose_decode_path
from epdserve.engine.kv_cache import BlockTable, KVCache
from epdserve.engine.request import MediaItem, Request
from epdserve.engine.sampler import Sampled, sample
from epdserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from epdserve.engine.vision_slices import SlicedEncode
from epdserve.kernels.cpu_linear import row_bucket
from epdserve.kernels.ops import kernels_in_use, select_ops
from epdserve.models.base import DeepStack
from epdserve.transfer.kv import KVLayout

log = logging.getLogger(__name__)


class MediaError(RuntimeError):
    """A request's media could not be turned into embeddings (fails only that request)."""


# the model attribute holding each modality's encoder (None there: not loaded in this process);
# every item of one encoder is encoded in one forward, whose input rows it concatenates
_ENCODERS = {"image": "visual", "video": "visual", "audio": "audio"}


def _patches(it: MediaItem) -> int:
    """Patch rows of an item's pixels (0 once encoded)."""
    return 0 if it.pixel_values is None else int(it.pixel_values.shape[0])


@dataclass
class StepResult:
    sampled: dict[str, Sampled]  # request id -> (token, logprob, top logprobs)
    failed: dict[str, str]  # request id -> error message


class StepInputs(NamedTuple):
    """A step's scheduled tokens as one row batch."""

    tokens: torch.Tensor  # long [N]: every request's new tokens, in scheduling order
    positions: torch.Tensor  # long [3, N]: their M-RoPE rows (t, h, w)
    layout: StepLayout  # where each token's KV goes and what it attends


class ModelRunner:
    def __init__(self, model, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.dtype = torch_dtype(config.dtype)
        self.device = torch.device(config.device)
        lm = model.language_model
        tc = lm.config
        # the layer's elementwise ops: fused kernels where they build
        ops = lm.ops = select_ops(config.kernels, self.dtype, self.device)
        self.kernels = kernels_in_use(ops, config.kernels, self.dtype, self.device)
        if getattr(model, "visual", None) is not None:  # the vision tower rotates through them too
            model.visual.ops = ops
        self.kv = KVCache(
            tc.num_hidden_layers,
            config.num_kv_blocks,
            config.block_size,
            tc.num_key_value_heads,
            tc.head_dim,
            self.dtype,
            self.device,
        )
        self.decode = choose_decode_path(lm, ops, self.kv, config, self.dtype, self.device)
        max_blocks = -(-config.max_model_len // config.block_size)
        self.table = BlockTable(config.max_num_seqs, max_blocks, self.device)
        self.encoder_cache = EmbeddingCache(config.encoder_cache_bytes)
        self.vision_patches = 0  # patches this instance encoded itself (raw media)
        self.vision_seconds = 0.0  # and the seconds those forwards took
        self.vision_rate = CostRate()  # seconds per patch of the recent vision forwards (0: none timed yet)
        self.slicing: SlicedEncode | None = None  # a large item encoded between steps (engine.vision_slices)
        self.sliced_items = 0  # items encoded that way
        self._pauses = hasattr(getattr(model, "visual", None), "stages")  # its tower can run in slices
        self.hidden_size = tc.hidden_size
        self.vocab_size = tc.vocab_size
        self.feature_levels: int = model.config.feature_levels  # embedding width = levels x hidden_size

    @property
    def kv_bytes(self) -> int:
        """Bytes of the KV cache (on a CPU resident only as blocks are used)."""
        return sum(t.nbytes for t in (*self.kv.k, *self.kv.v))

    def kv_layout(self) -> KVLayout:
        return KVLayout(len(self.kv.k), self.kv.k[0].shape[2], self.kv.k[0].shape[3], self.config.dtype)

    def export_kv(self, req: Request) -> torch.Tensor:
        """The KV rows of the request's prompt tokens, from its blocks (on the CPU)."""
        return self.kv.read_rows(self._prompt_slots(req.block_ids, req.prompt_len)).cpu()

    def _prompt_slots(self, block_ids: list[int], n: int) -> torch.Tensor:
        bs = self.config.block_size
        pos = torch.arange(n)
        return (torch.tensor(block_ids, dtype=torch.long)[pos // bs] * bs + pos % bs).to(self.device)

    def release(self, request_id: str) -> None:
        """The request left the engine: its block-table row is free again, and the forward of its
        item encoded in slices stops."""
        self.table.release(request_id)
        if self.slicing is not None and self.slicing.owner == request_id:
            self.slicing.close()
            self.slicing = None
        if self.decode.mirror is not None:
            self.decode.mirror.forget(request_id)

    # ---- media encoders -----------------------------------------------------------------------
    @property
    def has_encoder(self) -> bool:
        """Some media encoder is loaded (raw media can be encoded here)."""
        return any(getattr(self.model, attr, None) is not None for attr in set(_ENCODERS.values()))

    def _ensure_embeddings(self, items: list[MediaItem]) -> None:
        """Fill ``item.embeddings`` for every item: cache hit, or one batched forward per encoder."""
        todo: dict[str, list[MediaItem]] = {}  # encoder attribute -> its items, in order
        first: dict[tuple, MediaItem] = {}  # one forward per distinct item of the call
        twins: list[tuple[MediaItem, MediaItem]] = []  # (item, the equal item encoded for it)
        for it in items:
            if it.embeddings is not None:
                continue
            key = (it.uuid, it.grid_thw, it.length)
            cached = self.encoder_cache.get(it.uuid)
            if cached is not None and cached.shape[0] == it.length:
                it.embeddings = cached
            elif key in first:
                twins.append((it, first[key]))
            elif it.pixel_values is None:
                raise MediaError(f"no embeddings and no pixels for media item {it.uuid}")
            elif it.modality not in _ENCODERS:
                raise MediaError(f"media item {it.uuid} has unknown modality {it.modality!r}")
            else:
                todo.setdefault(_ENCODERS[it.modality], []).append(it)
                first[key] = it
        for attr, group in todo.items():
            encoder = getattr(self.model, attr, None)
            if encoder is None:
                kinds = "/".join(sorted({it.modality for it in group}))
                raise MediaError(f"this instance has no {kinds} encoder; send metadata-only media items")
            t0 = time.perf_counter()
            values = torch.cat([it.pixel_values for it in group]).to(self.device, self.dtype)  # type: ignore[misc]
            grid = torch.tensor([it.grid_thw for it in group], dtype=torch.long, device=self.device)
            emb = encoder(values, grid)
            if attr == "visual":
                if emb.is_cuda:
                    torch.cuda.synchronize(emb.device)  # the forward's time, not its launch
                seconds = time.perf_counter() - t0
                self._timed(values.shape[0], seconds)
            self._keep(group, emb)
        for it, twin in twins:
            it.embeddings, it.pixel_values = twin.embeddings, None

    def _timed(self, patches: int, seconds: float) -> None:
        """What a raw image or video costs this instance (the router's adaptive dispatch reads it)."""
        self.vision_patches += patches
        self.vision_seconds += seconds
        self.vision_rate.add(seconds, patches)

    def _keep(self, group: list[MediaItem], emb: torch.Tensor) -> None:
        """Hand each item of ``group`` its rows of the group's embeddings, and cache them."""
        for it, e in zip(group, emb.split([it.length for it in group]), strict=True):
            it.embeddings = e
            it.pixel_values = None  # pixels are not needed again
            # a copy of its own: a view would keep the whole group's output alive in the cache
            self.encoder_cache.put(it.uuid, in_own_pages(e))

    def _needs_tower(self, it: MediaItem) -> bool:
        """The vision tower must encode ``it`` here (no embeddings, none cached, pixels at hand)."""
        return (
            it.embeddings is None
            and it.pixel_values is not None
            and _ENCODERS.get(it.modality) == "visual"
            and it.uuid not in self.encoder_cache
        )

    def sliced_item(self, req: Request, start: int) -> MediaItem | None:
        """The image of ``req`` (at or past prompt position ``start``) to encode in slices between
        steps, None when there is none: the one in progress for it, or the first whose forward would
        alone take longer than ``vision_slice_s`` at the recent rate (before any forward was timed,
        the first of its images). Slices need a tower that pauses (``stages``)."""
        job = self.slicing
        if job is not None and job.owner == req.request_id:
            return job.item
        bound = self.config.vision_slice_s
        if not bound or not self._pauses:
            return None
        rate = self.vision_rate.value
        for it in req.mm_items:
            if it.end > start and self._needs_tower(it) and (not rate or _patches(it) * rate > bound):
                return it
        return None

    @torch.inference_mode()
    def start_slices(self, req: Request, item: MediaItem) -> None:
        """Begin encoding ``item`` of ``req`` in slices (``advance_slices`` runs them)."""
        assert item.pixel_values is not None and self.slicing is None
        values = item.pixel_values.to(self.device, self.dtype)
        grid = torch.tensor([item.grid_thw], dtype=torch.long, device=self.device)
        sync = torch.cuda.synchronize if values.is_cuda else None
        stages = self.model.visual.stages(values, grid, within_blocks=True)
        self.slicing = SlicedEncode(req.request_id, item, values.shape[0], stages, sync)

    @torch.inference_mode()
    def advance_slices(self, budget_s: float) -> tuple[str, str] | None:
        """Run the next slice of the item encoded in slices; once its last stage ran, the item holds
        its embeddings. (request id, error) when its forward failed: only that request fails."""
        job = self.slicing
        assert job is not None
        try:
            emb = job.advance(budget_s)
        except MediaError as e:
            self.slicing = None
            return job.owner, str(e)
        except Exception as e:  # a bad item must not take the engine down
            self.slicing = None
            log.exception("vision encoding failed for %s", job.owner)
            return job.owner, f"vision encoding failed: {e}"
        if emb is not None:
            self.slicing = None
            self._timed(job.patches, job.seconds)
            self._keep([job.item], emb)
            self.sliced_items += 1
        return None

    def vision_cost(self, req: Request, start: int, end: int) -> float:
        """Seconds the vision tower would spend on the items of prompt positions [start, end) of
        ``req`` (those without embeddings, not cached here), at the recent rate; 0 before any
        forward was timed."""
        if not self.vision_rate.value:
            return 0.0
        items = [it for it in req.mm_items if it.offset < end and it.end > start and self._needs_tower(it)]
        return sum(_patches(it) for it in items) * self.vision_rate.value

    def _check_width(self, items: list[MediaItem]) -> None:
        """Every item's embeddings carry all of the model's feature levels (connectors and the
        front end validate them already; this guards whatever path an item took)."""
        width = self.feature_levels * self.hidden_size
        for it in items:
            if it.embeddings is not None and (it.embeddings.dim() != 2 or it.embeddings.shape[1] != width):
                raise MediaError(
                    f"media item {it.uuid} has embeddings of shape {list(it.embeddings.shape)}; this model takes "
                    f"[rows, {width}] ({self.feature_levels} feature levels of {self.hidden_size})"
                )

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput) -> StepResult:
        """Run ``plan``: a token for every request whose chunk reached its end; a request whose
        media failed is reported in ``failed`` and left out of the step."""
        scheduled, failed = self._encode_media(plan.scheduled)
        if not scheduled:
            return StepResult({}, failed)
        step = self._lay_out(scheduled)
        self._load_remote_kv(scheduled)
        embeds, deepstack = self._merge_embeddings(scheduled, step.tokens)
        hidden = self._forward(step, embeds, deepstack)
        return StepResult(self._sample(scheduled, hidden), failed)

    def _encode_media(self, scheduled: list[ScheduledRequest]) -> tuple[list[ScheduledRequest], dict[str, str]]:
        """Embeddings for every media item the step's chunks reach. Returns the requests that run
        and the errors of those whose media failed (only they fail; the step goes on)."""
        failed: dict[str, str] = {}
        needed = [[it for it in s.request.mm_items if it.offset < s.end and it.end > s.start] for s in scheduled]
        if sum(map(len, needed)) > 1:
            # the whole step's media in one forward per encoder; should some item fail it, each
            # request's items are encoded again below on their own, failing only that request
            try:
                self._ensure_embeddings([it for items in needed for it in items])
            except Exception as e:  # the request it belongs to is found, and told, below
                log.warning("encoding the step's media in one batch failed, encoding per request: %s", e)
        ready = []
        for s, items in zip(scheduled, needed, strict=True):
            req = s.request
            try:
                self._ensure_embeddings(items)
                self._check_width(items)
            except MediaError as e:
                failed[req.request_id] = str(e)
                continue
            except Exception as e:  # a bad item must not take the batch down
                log.exception("vision encoding failed for %s", req.request_id)
                failed[req.request_id] = f"vision encoding failed: {e}"
                continue
            ready.append(s)
        return ready, failed

    def _lay_out(self, scheduled: list[ScheduledRequest]) -> StepInputs:
        """The step's tokens, positions, KV slots and attention layout: each request's chunk is a
        prefill slice (SDPA) or rows attended one by one (decode tokens, short prompt chunks)."""
        ids: list[int] = []
        pos_parts: list[torch.Tensor] = []
        dec_pos: list[int] = []  # positions of decode tokens past the prompt (all three M-RoPE rows equal)
        rows, starts, ends = [], [], []
        prefills: list[PrefillSlice] = []
        dec_q: list[int] = []  # rows attended one by one: decode tokens, and short prompt chunks' tokens
        dec_rows: list[int] = []
        dec_ctx: list[int] = []
        dec_ids: list[str] = []
        dec_blocks: list[list[int]] = []
        q = 0
        for s in scheduled:
            req = s.request
            row = self.table.row(req.request_id, req.block_ids)
            rows.append(row)
            starts.append(s.start)
            ends.append(s.end)
            ids.extend(req.token_ids(s.start, s.end))
            if s.num_new_tokens == 1 and s.start >= req.prompt_len:
                dec_pos.append(s.start + req.mrope_delta)
            else:
                if dec_pos:
                    pos_parts.append(torch.tensor(dec_pos, dtype=torch.long).expand(3, -1))
                    dec_pos = []
                pos_parts.append(req.positions(s.start, s.end))
            chunk = s.num_new_tokens > 1 or s.end == 1  # of a prompt (a decode token follows its first)
            if chunk and not self.decode.attends_chunk(s.num_new_tokens, s.end):
                prefills.append(PrefillSlice(q, s.num_new_tokens, s.end, row))
            else:  # a decode token, or each token of a short chunk: one query row over its causal prefix
                dec_q.extend(range(q, q + s.num_new_tokens))
                dec_rows.extend([row] * s.num_new_tokens)
                dec_ctx.extend(range(s.start + 1, s.end + 1))
                if not chunk:  # (the mirror, kept only without kernels, holds decoding requests)
                    dec_ids.append(req.request_id)
                    dec_blocks.append(req.block_ids)
            q += s.num_new_tokens
        if dec_pos:
            pos_parts.append(torch.tensor(dec_pos, dtype=torch.long).expand(3, -1))
        dev = self.device
        t = lambda xs: torch.tensor(xs, dtype=torch.long).to(dev)  # noqa: E731
        bs = self.config.block_size
        mirror = mirror_src = None
        if self.decode.mirror is not None and dec_ids:
            mirror = self.decode.mirror.step(dec_ids, dec_blocks, dec_ctx)
            mirror_src = self.table.slots(t(dec_rows), mirror.starts, t(dec_ctx), bs)
        layout = StepLayout(
            slot_mapping=self.table.slots(t(rows), t(starts), t(ends), bs),
            prefills=prefills,
            decode_rows=t(dec_q),
            decode_table_rows=t(dec_rows),
            decode_ctx=t(dec_ctx),
            max_decode_ctx=max(dec_ctx, default=0),
            mirror=mirror,
            mirror_src=mirror_src,
            decode_only=not prefills,
        )
        positions = (torch.cat(pos_parts, dim=1) if len(pos_parts) > 1 else pos_parts[0]).to(dev)
        return StepInputs(t(ids), positions, layout)

    def _load_remote_kv(self, scheduled: list[ScheduledRequest]) -> None:
        """KV a prefill instance computed for a request goes into its blocks (once, before the
        request's first step here attends over it)."""
        for s in scheduled:
            if s.request.kv_rows is not None:
                rows_kv, s.request.kv_rows = s.request.kv_rows, None
                self.kv.write_rows(self._prompt_slots(s.request.block_ids, rows_kv.shape[0]), rows_kv)

    def _merge_embeddings(
        self, scheduled: list[ScheduledRequest], tokens: torch.Tensor
    ) -> tuple[torch.Tensor, DeepStack | None]:
        """Token embeddings [N, H] with the media embeddings over the placeholder rows of this
        step's chunks, and a DeepStack model's further levels for those rows."""
        dev = self.device
        embeds = self.model.language_model.embed_tokens(tokens).to(self.dtype)
        hsize, levels = self.hidden_size, self.feature_levels
        stack_rows: list[torch.Tensor] = []  # DeepStack: the batch rows of this step's placeholders
        stack_feats: list[torch.Tensor] = []  # and their levels 1.. ([rows, (levels - 1) * H])
        q = 0
        for s in scheduled:
            for it in s.request.mm_items:
                for offset, row, n in it.placements():
                    a, b = max(offset, s.start), min(offset + n, s.end)
                    if a < b:
                        assert it.embeddings is not None
                        rows_e = it.embeddings[row + a - offset : row + b - offset]
                        embeds[q + a - s.start : q + b - s.start] = rows_e[:, :hsize].to(dev, self.dtype)
                        if levels > 1:
                            stack_rows.append(torch.arange(q + a - s.start, q + b - s.start))
                            stack_feats.append(rows_e[:, hsize:])
            q += s.num_new_tokens
        if not stack_rows:
            return embeds, None
        feats = torch.cat(stack_feats).to(dev, self.dtype).view(-1, levels - 1, hsize).transpose(0, 1)
        return embeds, DeepStack(torch.cat(stack_rows).to(dev), feats)

    def _forward(self, step: StepInputs, embeds: torch.Tensor, deepstack: DeepStack | None) -> torch.Tensor:
        """The language model over the step's rows: final-normed hidden states [N, H]."""
        attention = PagedAttention(self.kv, self.table, step.layout, self.decode)
        hidden: torch.Tensor = self.model.language_model(embeds, step.positions, attention, deepstack)
        return hidden

    def _sample(self, scheduled: list[ScheduledRequest], hidden: torch.Tensor) -> dict[str, Sampled]:
        """A token for each request whose chunk reached its last token, from its last row."""
        last_rows, sampling = [], []
        q = 0
        for s in scheduled:
            q += s.num_new_tokens
            if s.samples:
                last_rows.append(q - 1)
                sampling.append(s.request)
        sampled: dict[str, Sampled] = {}
        if sampling:
            # at a bounded set of row counts (the last row repeated), as the layers' matmuls run
            padded = last_rows + last_rows[-1:] * (row_bucket(len(last_rows)) - len(last_rows))
            rows = torch.tensor(padded, dtype=torch.long).to(self.device)
            logits = self.model.language_model.compute_logits(hidden[rows])[: len(last_rows)]
            for r, out in zip(sampling, sample(logits, sampling), strict=True):
                sampled[r.request_id] = out
        return sampled
