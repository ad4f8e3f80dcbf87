"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, min_tokens."""

from __future__ import annotations

import torch

from epdserve.engine.request import Request


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` [B, V] for the matching request; returns ids and logprobs."""
    logits = logits.float()
    for i, req in enumerate(requests):
        # end-of-sequence is not allowed before min_tokens
        if len(req.output_token_ids) < req.params.min_tokens and req.eos_token_ids:
            logits[i, list(req.eos_token_ids)] = float("-inf")
    logprobs = torch.log_softmax(logits, dim=-1)
    greedy = [i for i, r in enumerate(requests) if r.params.greedy]
    tokens = [0] * len(requests)
    if greedy:
        ids = logits[greedy].argmax(-1).tolist()
        for i, t in zip(greedy, ids, strict=True):
            tokens[i] = t
    for i, req in enumerate(requests):
        if req.params.greedy:
            continue
        tokens[i] = _sample_one(logits[i], req)
    chosen = logprobs[torch.arange(len(requests)), torch.tensor(tokens)].tolist()
    return tokens, chosen


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
        req.generator = torch.Generator()
        if p.seed is not None:
            req.generator.manual_seed(p.seed)
        else:
            req.generator.seed()
    return int(torch.multinomial(probs, 1, generator=req.generator).item())
