"""Turning logits into tokens: pure functions that the chain, the stage and the tests call directly."""

from __future__ import annotations

import dataclasses
import math

import torch

from ..errors import ModelError

__all__ = ["SamplingParams", "position_seed", "token_probs"]


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Greedy when ``temperature`` is 0; otherwise softmax sampling at ``temperature`` within nucleus ``top_p``."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ModelError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise ModelError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """The generator seed for the draws that decide the token at ``position`` of a session seeded ``seed``
    (splitmix64 of the pair): randomness keyed by position, not by a generator's history, so a replacement last
    stage that replays a session draws what the failed one would have drawn."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def token_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution over the vocabulary for each row of ``logits`` ([..., V] -> [..., V], fp32)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs

