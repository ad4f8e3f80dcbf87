"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens."""

from __future__ import annotations

import torch

from epdserve.engine.request import Request

Sampled = tuple[int, float, list[tuple[int, float]] | None]  # token, its logprob, top logprobs


def sample(logits: torch.Tensor, requests: list[Request]) -> list[Sampled]:
    """One token per row of ``logits`` [B, V] for the matching request.

    Logprobs are those of the model's own distribution (before min_tokens masking, temperature and
    truncation, as vLLM's default and transformers' raw scores) and are computed only for the
    requests that asked: a full-vocabulary log-softmax is not free. Others get NaN as their logprob.
    """
    logits = logits.float()
    want = [i for i, r in enumerate(requests) if r.params.logprobs]
    logprobs = torch.log_softmax(logits[want], dim=-1) if want else None
    for i, req in enumerate(requests):
        # end-of-sequence is not allowed before min_tokens
        if len(req.output_token_ids) < req.params.min_tokens and req.eos_token_ids:
            logits[i, list(req.eos_token_ids)] = float("-inf")
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    tokens = [0] * len(requests)
    if greedy:
        ids = logits[greedy].argmax(-1).tolist()
        for i, t in zip(greedy, ids, strict=True):
            tokens[i] = t
    for i, req in enumerate(requests):
        if not req.params.greedy:
            tokens[i] = _sample_one(logits[i], req)
    out: list[Sampled] = [(t, float("nan"), None) for t in tokens]
    if logprobs is not None:
        chosen = logprobs[torch.arange(len(want)), torch.tensor([tokens[i] for i in want])].tolist()
        for j, i in enumerate(want):
            k = requests[i].params.top_logprobs
            top = None
            if k > 0:
                vals, idx = torch.topk(logprobs[j], min(k, logprobs.shape[-1]))
                top = list(zip(idx.tolist(), vals.tolist(), strict=True))
            out[i] = (tokens[i], chosen[j], top)
    return out


def _sample_one(row: torch.Tensor, req: Request) -> int:
    p = req.params
    row = row / p.temperature
    if p.top_k and p.top_k > 0 and p.top_k < row.shape[-1]:
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        # keep the smallest set whose mass reaches top_p (always at least the top token)
        drop = cum - sorted_p >= p.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    if req.generator is None:
        req.generator = torch.Generator(device=row.device)  # multinomial needs one on its device
        if p.seed is not None:
            req.generator.manual_seed(p.seed)
        else:
            req.generator.seed()
    return int(torch.multinomial(probs, 1, generator=req.generator).item())
