"""Per-request sampling parameters (validated at the API edge, used by the sampler)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass, (0, 1]
    top_k: int = 0  # 0 or -1 means no top-k cut
    seed: int | None = None  # per-request RNG seed (reproducible sampling)
    max_tokens: int = 256  # upper bound on generated tokens
    min_tokens: int = 0  # end-of-sequence and stop strings are ignored before this many tokens
    stop: tuple[str, ...] = field(default=())  # stop strings (not included in the output)
    ignore_eos: bool = False  # keep generating past end-of-sequence tokens
    logprobs: bool = False  # return the chosen token's logprob
    top_logprobs: int = 0  # also return this many most likely tokens per position (needs logprobs)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
