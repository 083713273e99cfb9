"""The last stage's part of a step: check guesses, sample, keep the MTP layer current and draft new guesses.

For a batch of sessions whose step ran through the last stage's layers (``StageModel.forward``), ``finish_steps``

1. computes logits for the rows that need them (the last ``k+1`` rows of a step with ``k`` guesses);
2. accepts the longest correct prefix of the guesses and samples one more token (``speculative.accept_guesses``);
3. runs the MTP layer over the step's accepted positions (its KV cache follows the main model's positions);
4. drafts the next guesses with the MTP layer, one row per drafting session per round.

All sessions share each matrix product; acceptance and the guess policy are per session.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..errors import ModelError, SessionStateError, TooManyGuessesError
from .sampling import SamplingParams, token_probs
from .speculative import GuessPolicy, accept_guesses
from .stage import StageModel
from .state import Segment, SessionState

__all__ = ["Decoder", "StepOutcome", "LastStep", "finish_steps"]


class Decoder:
    """Per-session decoding state on the last stage: sampling, outstanding guesses, guess policy, counters."""

    def __init__(self, state: SessionState, sampling: SamplingParams, policy: GuessPolicy) -> None:
        if policy.max_guesses + 1 > max(state.ring, 1) and state.has_linear():
            raise ModelError(
                f"{policy.max_guesses} guesses need a rollback ring of {policy.max_guesses + 1}, session has {state.ring}"
            )
        self.state = state
        self.sampling = sampling
        self.policy = policy
        self.generator = torch.Generator().manual_seed(sampling.seed)
        self.guesses: tuple[int, ...] = ()
        self.draft_probs: torch.Tensor | None = None  # [k, V] when sampling
        self.mtp_position = 0  # MTP KV holds positions [0, mtp_position) for accepted tokens
        self.proposed = 0
        self.accepted = 0
        self.steps = 0
        self.accepted_at = [0] * (policy.max_guesses + 1)  # accepted_at[j]: steps where guess j+1 was kept
        self.proposed_at = [0] * (policy.max_guesses + 1)


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    tokens: tuple[int, ...]  # accepted guesses + one new token
    accepted: int
    guesses: tuple[int, ...]  # drafts to check in the next step


@dataclasses.dataclass
class LastStep:
    """One session's step as the last stage sees it: all token ids of the step; the last ``n_guesses`` are guesses."""

    decoder: Decoder
    start: int
    tokens: Sequence[int]
    n_guesses: int


def finish_steps(stage: StageModel, items: Sequence[LastStep], hidden: torch.Tensor) -> list[StepOutcome]:
    """Finish a batched step on the last stage; ``hidden`` [N, H] are the layers' outputs, rows in item order."""
    if not stage.is_last:
        raise ModelError("finish_steps runs on the last stage")
    for it in items:
        if it.n_guesses > it.decoder.policy.max_guesses:
            raise TooManyGuessesError(
                f"a step with {it.n_guesses} guesses; the session allows at most {it.decoder.policy.max_guesses}"
            )
        if not 0 <= it.n_guesses < len(it.tokens):
            raise SessionStateError(f"{it.n_guesses} guesses in a step of {len(it.tokens)} tokens")
    lengths = [len(it.tokens) for it in items]
    if sum(lengths) != hidden.shape[0]:
        raise SessionStateError(f"{hidden.shape[0]} hidden rows for steps of {sum(lengths)} tokens")
    offsets = [sum(lengths[:i]) for i in range(len(items))]
    # 1. logits for the last k+1 rows of every step, in one product
    rows = [torch.arange(o + n - it.n_guesses - 1, o + n) for it, o, n in zip(items, offsets, lengths)]
    normed = stage.final_normed(hidden)
    logits = stage.head_logits(normed[torch.cat(rows)])
    # 2. acceptance per session
    outcomes: list[tuple[int, tuple[int, ...]]] = []
    row = 0
    for it in items:
        k = it.n_guesses
        dec = it.decoder
        guesses = tuple(int(t) for t in it.tokens[len(it.tokens) - k:]) if k else ()
        probs = None
        if k and not dec.sampling.greedy:
            if guesses != dec.guesses or dec.draft_probs is None:
                raise SessionStateError("sampled guesses must be the ones this stage drafted for the session")
            probs = dec.draft_probs
        res = accept_guesses(logits[row:row + k + 1], guesses, probs, dec.sampling, dec.generator)
        row += k + 1
        dec.steps += 1
        dec.proposed += k
        dec.accepted += res.accepted
        for j in range(k):
            dec.proposed_at[j] += 1
            dec.accepted_at[j] += j < res.accepted
        dec.policy.update(k, res.accepted)
        outcomes.append((res.accepted, res.tokens))
    # 3. + 4. keep the MTP layer current and draft
    drafts = _mtp_and_draft(stage, items, offsets, normed, outcomes)
    return [StepOutcome(tokens, acc, drafts[i]) for i, (acc, tokens) in enumerate(outcomes)]


def _mtp_and_draft(
    stage: StageModel,
    items: Sequence[LastStep],
    offsets: list[int],
    normed: torch.Tensor,
    outcomes: list[tuple[int, tuple[int, ...]]],
) -> list[tuple[int, ...]]:
    drafts: list[tuple[int, ...]] = [()] * len(items)
    if stage.mtp is None:
        for it in items:
            it.decoder.guesses, it.decoder.draft_probs = (), None
        return drafts
    active = [i for i, it in enumerate(items) if it.decoder.policy.max_guesses > 0]
    for i in set(range(len(items))) - set(active):
        items[i].decoder.guesses, items[i].decoder.draft_probs = (), None
    if not active:
        return drafts
    # catch-up: rows 0..r_last of each step, whose next token is now known
    segs, rows, nexts = [], [], []
    for i in active:
        it, (acc, tokens) = items[i], outcomes[i]
        dec = it.decoder
        if it.start > dec.mtp_position:
            raise SessionStateError(f"the MTP layer holds {dec.mtp_position} positions; step starts at {it.start}")
        r_last = len(it.tokens) - it.n_guesses - 1 + acc
        segs.append(Segment(dec.state, it.start, r_last + 1))
        rows.append(torch.arange(offsets[i], offsets[i] + r_last + 1))
        nexts.extend(list(it.tokens[1:r_last + 1]) + [tokens[-1]])
        dec.mtp_position = it.start + r_last + 1
    u = stage.mtp_forward(normed[torch.cat(rows)], torch.tensor(nexts), segs)
    ends = torch.tensor([s.length for s in segs]).cumsum(0) - 1
    cur = u[ends]  # [B, H] the MTP state of each active session's last accepted position
    positions = [items[i].decoder.mtp_position for i in active]  # next draft writes here (new token's position)
    drafting = list(range(len(active)))
    got: list[list[int]] = [[] for _ in active]
    probs: list[list[torch.Tensor]] = [[] for _ in active]
    while drafting:
        lg = stage.head_logits(cur)  # [B', V]
        conf = torch.softmax(lg, dim=-1)
        keep = []
        for b, a in enumerate(drafting):
            dec = items[active[a]].decoder
            cap_left = dec.state.capacity - positions[a] - 1  # verification needs room for token + guesses
            if len(got[a]) >= cap_left:
                continue
            if dec.sampling.greedy:
                g = int(lg[b].argmax())
            else:
                q = token_probs(lg[b], dec.sampling)
                g = int(torch.multinomial(q, 1, generator=dec.generator))
                probs[a].append(q)
            if not dec.policy.keep_drafting(len(got[a]), float(conf[b, g])):
                if probs[a] and not dec.sampling.greedy:
                    probs[a].pop()
                continue
            got[a].append(g)
            keep.append(b)
        still_b = [b for b in keep if len(got[drafting[b]]) < items[active[drafting[b]]].decoder.policy.limit()]
        if not still_b:
            break
        # one more MTP step for the sessions that keep drafting: input (their MTP state, their last guess)
        still = [drafting[b] for b in still_b]
        segs = [Segment(items[active[a]].decoder.state, positions[a] + len(got[a]) - 1, 1) for a in still]
        cur = stage.mtp_forward(cur[torch.tensor(still_b)], torch.tensor([got[a][-1] for a in still]), segs)
        drafting = still
    for a, i in enumerate(active):
        dec = items[i].decoder
        dec.guesses = tuple(got[a])
        dec.draft_probs = torch.stack(probs[a]) if (probs[a] and not dec.sampling.greedy) else None
        drafts[i] = dec.guesses
    return drafts
