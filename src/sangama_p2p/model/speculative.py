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
    # the draws are made on the CPU, with the CPU generator seeded per position (model/sampling.position_seed):
    # torch draws with a CPU generator on CPU tensors only, so a CUDA last stage sampled nothing; and the same
    # probabilities then give the same tokens on every device
    p = token_probs(logits, params).float().cpu()  # [k+1, V]
    drafts = draft_probs.float().cpu() if k else None  # type: ignore[union-attr]
    for j, g in enumerate(guesses):
        q = drafts[j]  # type: ignore[index]
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


class GuessPolicy:
    """How many guesses a session drafts next.

    Fixed (``adaptive=False``): always ``max_guesses``.

    Adaptive (``auto``): the number ``k`` in ``0..max_guesses`` that maximises the expected tokens per second,
    ``E(k) / cost(k)``, where

    - ``E(k) = 1 + sum_{j<=k} prod_{i<=j} c_i`` from ``c_j``, the measured rate at which guess ``j`` is kept when
      guesses ``1..j-1`` were (counts that decay by ``decay`` per step where position j is checked, and 5x slower
      where it is not, so the policy follows the text and slowly comes back to positions it stopped trying);
    - ``cost(k)`` is the measured time of a step that carried ``k`` guesses, drafting included
      (:meth:`observe_cost`: an exponential average that follows drops faster than rises, since load only adds). A ``k`` not yet measured is extrapolated from the measured ones
      (the mean cost per guess over measured ``k``), or, with no measurement, from ``prior_cost_per_guess`` (a
      fraction of a plain step: small, because a guess only adds rows to a step whose time is mostly fixed costs).

    ``k = 0`` wins when nothing pays; then after ``probe_every`` plain steps (doubling up to 4x while probes do not
    pay) the policy probes for two steps with one guess (the cheapest probe), so that acceptance and cost stay
    measured and guessing resumes when the text becomes predictable; while guessing, one plain step every
    ``2 * probe_every`` keeps ``cost(0)`` current, and one step a guess deeper than the best, halfway between,
    re-measures a deeper plan (one slow first reading would otherwise rule it out for good) and the next position's
    acceptance. The first three steps are plain (they measure ``cost(0)``).
    ``min_confidence`` > 0 also stops drafting at a guess whose own draft probability is below it (off by
    default: the costs and acceptance rates above are then measured per drafted rather than per planned guess, and
    ``E(k)`` overestimates what a plan of k yields). The choice never changes greedy
    tokens (guesses only decide how many tokens a step may keep); with sampling it changes which random numbers are
    drawn, so timing-driven choices make a seeded sampled run reproducible only with a fixed number of guesses.
    """

    def __init__(self, max_guesses: int, adaptive: bool = False, *, min_confidence: float = 0.0,
                 decay: float = 0.9, cost_smoothing: float = 0.2, prior_cost_per_guess: float = 0.1,
                 probe_every: int = 8) -> None:
        if max_guesses < 0:
            raise ModelError("max_guesses must be >= 0")
        if not 0 < decay <= 1 or not 0 < cost_smoothing <= 1 or probe_every < 1 or prior_cost_per_guess < 0:
            raise ModelError("decay and cost_smoothing must be in (0, 1], probe_every >= 1, prior cost >= 0")
        self.max_guesses = max_guesses
        self.adaptive = adaptive
        self.min_confidence = min_confidence
        self.decay = decay
        self.cost_smoothing = cost_smoothing
        self.prior_cost_per_guess = prior_cost_per_guess
        self.probe_every = probe_every
        # decayed counts: tried[j] steps where guess j+1 was checked (guesses 1..j kept), kept[j] where it was kept
        self.tried = [0.0] * max_guesses
        self.kept = [0.0] * max_guesses
        self.cost: list[float | None] = [None] * (max_guesses + 1)  # seconds per step carrying k guesses
        self.planned = max_guesses if not adaptive else 0  # auto: measure a plain step first
        self._since_probe = 0
        self._plain_first = 3
        self._guessing = 0
        self._probe_left = 0
        self._probe_every = probe_every

    def limit(self) -> int:
        """The most guesses to draft for the next step (the plan of the last :meth:`plan` call)."""
        return self.planned if self.adaptive else self.max_guesses

    def keep_drafting(self, drafted: int, confidence: float) -> bool:
        """Whether to keep a draft of confidence ``confidence`` as guess number ``drafted + 1``."""
        if drafted >= self.limit():
            return False
        return not self.wants_confidence or confidence >= self.min_confidence

    @property
    def wants_confidence(self) -> bool:
        """Whether :meth:`keep_drafting` looks at the draft's probability of its guess."""
        return self.adaptive and self.min_confidence > 0

    def update(self, proposed: int, accepted: int) -> None:
        """Record a checked step: ``accepted`` of its ``proposed`` guesses were kept."""
        if not self.adaptive or proposed == 0:
            return
        checked = min(accepted + 1, proposed)
        for j in range(self.max_guesses):
            # a position checked now forgets at ``decay``; one not checked keeps its estimate longer
            d = self.decay if j < checked else self.decay ** 0.2
            self.tried[j] *= d
            self.kept[j] *= d
        for j in range(checked):
            self.tried[j] += 1.0
            self.kept[j] += j < accepted

    def observe_cost(self, guesses: int, seconds: float) -> None:
        """A step that carried ``guesses`` guesses took ``seconds``, its drafting included."""
        if not 0 <= guesses <= self.max_guesses or not seconds > 0:
            return
        old = self.cost[guesses]
        if old is None:
            self.cost[guesses] = seconds
            return
        # a busy machine only ever adds time (descheduling, shared caches): follow drops fast, rises slowly, and
        # clamp one outlier
        rate = min(2.5 * self.cost_smoothing, 1.0) if seconds < old else 0.5 * self.cost_smoothing
        self.cost[guesses] = old + rate * (min(seconds, 2.0 * old) - old)

    def acceptance(self) -> list[float]:
        """Estimated ``c_j``: guess j kept given 1..j-1 kept; a position with few measurements leans on the one
        before (one pseudo-observation at its rate), so deeper plans get tried once shallow guesses are kept."""
        out, prev = [], 0.5
        for t, k in zip(self.tried, self.kept):
            prev = (k + prev) / (t + 1.0)
            out.append(prev)
        return out

    def expected_tokens(self) -> list[float]:
        """``E(k)`` for k = 0..max_guesses."""
        out, run, total = [1.0], 1.0, 1.0
        for c in self.acceptance():
            run *= c
            total += run
            out.append(total)
        return out

    def step_costs(self) -> list[float]:
        """``cost(k)`` relative to a plain step: measured where known, elsewhere from a line through the measured
        ``k > 0`` (a fixed cost of drafting at all, the catch-up of the MTP layer, plus a cost per guess); with
        one measured ``k``, the prior cost per guess from it."""
        base = self.cost[0]
        known = [(k, c) for k, c in enumerate(self.cost) if k and c is not None]
        if base is None:  # no plain step measured: the prior alone, scaled to the cheapest measured step
            if not known:
                return [1.0 + self.prior_cost_per_guess * k for k in range(self.max_guesses + 1)]
            k0, c0 = min(known, key=lambda kc: kc[1])
            base = c0 / (1.0 + self.prior_cost_per_guess * k0)
        per_guess = self.prior_cost_per_guess * base
        if len(known) >= 2:  # least squares through the measured k > 0
            mk = sum(k for k, _ in known) / len(known)
            mc = sum(c for _, c in known) / len(known)
            var = sum((k - mk) ** 2 for k, _ in known)
            per_guess = max(sum((k - mk) * (c - mc) for k, c in known) / var, 0.0)
        fixed = max(sum(c - per_guess * k for k, c in known) / len(known), base) if known else base
        return [(c if c is not None else (fixed + per_guess * k if k else base)) / base
                for k, c in enumerate(self.cost)]

    def plan(self) -> int:
        """Choose how many guesses to draft for the next step (adaptive); returns :meth:`limit`."""
        if not self.adaptive:
            return self.max_guesses
        if self.max_guesses == 0:
            self.planned = 0
            return 0
        if self._plain_first:  # measure plain steps first
            self._plain_first -= 1
            self.planned = 0
            return 0
        rate = [e / c for e, c in zip(self.expected_tokens(), self.step_costs())]
        best = max(range(len(rate)), key=lambda k: (rate[k], -k))
        if best == 0:
            self._since_probe += 1
            if self._since_probe >= self._probe_every:  # probe for two steps: the first pays the held-back catch-up
                best, self._probe_left = 1, 1  # one guess: the cheapest probe, and it measures the first position
                self._probe_every = min(2 * self._probe_every, 4 * self.probe_every)  # back off while nothing pays
            elif self._probe_left:
                best, self._probe_left = self.planned, 0
        else:
            self._probe_every = self.probe_every
            self._guessing += 1
            if self._guessing >= 2 * self.probe_every:  # one plain step now and then: keep cost(0) current
                best, self._guessing = 0, 0
            elif self._guessing == self.probe_every and best < self.max_guesses:
                best += 1  # and one step a guess deeper: re-measures a deeper plan's cost and the next acceptance
        if best:
            self._since_probe = 0
        self.planned = best
        return best
