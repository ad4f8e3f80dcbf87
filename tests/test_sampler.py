"""Sampling controls on synthetic logits."""

from __future__ import annotations

import torch

from epdserve.common.sampling_params import SamplingParams
from epdserve.engine.request import Request
from epdserve.engine.sampler import sample


def req(**kw: object) -> Request:
    return Request("r", [1], SamplingParams(**kw), eos_token_ids=frozenset({3}))  # type: ignore[arg-type]


LOGITS = torch.tensor([[0.0, 2.0, 1.0, 5.0, -1.0]])


def token(r: Request) -> int:
    return sample(LOGITS.clone(), [r])[0][0]


def test_greedy_and_min_tokens_masks_eos() -> None:
    assert token(req(temperature=0.0)) == 3
    assert token(req(temperature=0.0, min_tokens=2)) == 1


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    for _ in range(20):
        assert token(req(temperature=1.0, top_k=1)) == 3
        assert token(req(temperature=1.0, top_p=0.01)) == 3


def test_top_k_restricts_support() -> None:
    seen = {sample(LOGITS.clone(), [req(temperature=2.0, top_k=2, seed=i)])[0][0] for i in range(200)}
    assert seen == {1, 3}


def test_seed_reproducible_and_temperature_spreads() -> None:
    a = [sample(LOGITS.clone(), [r])[0][0] for r in [req(temperature=1.5, seed=7)] for _ in range(1)]
    r1, r2 = req(temperature=1.5, seed=7), req(temperature=1.5, seed=7)
    seq1 = [sample(LOGITS.clone(), [r1])[0][0] for _ in range(30)]
    seq2 = [sample(LOGITS.clone(), [r2])[0][0] for _ in range(30)]
    assert seq1 == seq2 and seq1[0] == a[0]
    assert len(set(seq1)) > 1


def test_logprobs_only_when_asked_from_the_raw_distribution() -> None:
    raw = torch.log_softmax(LOGITS, -1)[0]
    (tok, lp, top), (tok2, lp2, top2) = sample(
        LOGITS.repeat(2, 1), [req(temperature=0.0), req(temperature=0.0, logprobs=True, top_logprobs=3, min_tokens=2)]
    )
    assert tok == 3 and lp != lp and top is None  # not asked: NaN, no top list, no log-softmax spent
    # asked: the chosen token's logprob under the model's distribution, before min_tokens masked EOS
    assert tok2 == 1 and abs(lp2 - raw[1].item()) < 1e-6
    assert top2 is not None and [t for t, _ in top2] == [3, 1, 2]
    assert all(abs(v - raw[t].item()) < 1e-6 for t, v in top2)
