"""Checking guesses and choosing how many to make: pure functions and a small per-session policy.

The acceptance rule is the standard one of speculative sampling (Leviathan et al., Chen et al.): guess ``g_j``
drawn from the draft's distribution ``q_j`` is kept with probability ``min(1, p_j(g_j) / q_j(g_j))``; at the first
rejection the token is drawn from ``normalise(max(0, p_j - q_j))``; if every guess is kept, one more token is drawn
from ``p_k``. The emitted tokens are then distributed exactly as plain sampling from ``p``. With greedy sampling
``p`` and ``q`` are one-hot, so the rule reduces to "keep the longest prefix equal to the argmax".
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..errors import ModelError
from .sampling import SamplingParams, token_probs

__all__ = ["AcceptResult", "GuessPolicy", "accept_guesses"]


@dataclasses.dataclass(frozen=True)
class AcceptResult:
    accepted: int  # how many guesses were kept
    tokens: tuple[int, ...]  # the kept guesses plus one new token


def accept_guesses(
    logits: torch.Tensor,
    guesses: Sequence[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> AcceptResult:
    """Check ``guesses`` against target ``logits`` [k+1, V] (row j predicts the token after guess j).

    ``draft_probs`` [k, V] is the distribution each guess was drawn from (needed when sampling; ignored if greedy).
    """
    k = len(guesses)
    if logits.shape[0] != k + 1:
        raise ModelError(f"need {k + 1} rows of logits for {k} guesses, got {logits.shape[0]}")
    if params.greedy:
        best = logits.argmax(-1).tolist()
        n = 0
        while n < k and guesses[n] == best[n]:
            n += 1
        return AcceptResult(n, tuple(guesses[:n]) + (best[n],))
    if k and (draft_probs is None or draft_probs.shape[0] != k):
        raise ModelError("sampling with guesses needs the draft distribution of every guess")
    p = token_probs(logits, params)  # [k+1, V]
    for j, g in enumerate(guesses):
        q = draft_probs[j]  # type: ignore[index]
        ratio = float(p[j, g]) / max(float(q[g]), 1e-30)
        u = float(torch.rand((), generator=generator))
        if u < ratio:
            continue
        residual = (p[j] - q).clamp_min(0.0)
        total = float(residual.sum())
        dist = residual / total if total > 0 else p[j]
        tok = int(torch.multinomial(dist, 1, generator=generator))
        return AcceptResult(j, tuple(guesses[:j]) + (tok,))
    tok = int(torch.multinomial(p[k], 1, generator=generator))
    return AcceptResult(k, tuple(guesses) + (tok,))


@dataclasses.dataclass
class GuessPolicy:
    """How many guesses a session drafts next.

    Fixed: always ``max_guesses``. Adaptive: draft while the draft model's own probability of its guess is at least
    ``min_confidence``, up to a budget that grows by one after a fully accepted step and shrinks by one after a step
    that kept less than half of its guesses (never below 1, never above ``max_guesses``).
    """

    max_guesses: int
    adaptive: bool = False
    min_confidence: float = 0.4
    budget: int = 0

    def __post_init__(self) -> None:
        if self.max_guesses < 0:
            raise ModelError("max_guesses must be >= 0")
        if not self.budget:
            self.budget = max(1, self.max_guesses // 2) if self.adaptive else self.max_guesses

    def limit(self) -> int:
        return self.budget if self.adaptive else self.max_guesses

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        """Whether to keep a draft of confidence ``confidence`` as guess number ``drafted + 1``."""
        if drafted >= self.limit():
            return False
        return not self.adaptive or confidence >= self.min_confidence

    def update(self, proposed: int, accepted: int) -> None:
        if not self.adaptive or proposed == 0:
            return
        if accepted == proposed:
            self.budget = min(self.budget + 1, self.max_guesses)
        elif 2 * accepted < proposed:
            self.budget = max(self.budget - 1, 1)
