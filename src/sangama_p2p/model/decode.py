"""The last stage's part of a step: check guesses, sample, keep the MTP layer current and draft new guesses.

For a batch of sessions whose step ran through the last stage's layers (``StageModel.forward``), ``finish_steps``

1. computes logits for the rows that need them (the last ``k+1`` rows of a step with ``k`` guesses);
2. accepts the longest correct prefix of the guesses and samples one more token (``speculative.accept_guesses``);
3. runs the MTP layer over the step's accepted positions (its KV cache follows the main model's positions);
4. drafts the next guesses with the MTP layer, one row per drafting session per round.

All sessions share each matrix product; acceptance and the guess policy are per session. A session whose policy
plans no guesses holds its accepted rows back (``Decoder.pending``) and runs them through the MTP layer in one
multi-row step when it drafts again or holds ``PENDING_MAX`` of them: a plain step then costs no MTP work.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Sequence

import torch

from ..errors import ModelError, SessionStateError, TooManyGuessesError
from ..positions import guess_room, is_decode_step, kept, mtp_keep, ring_size, step_guesses
from .constraint import TokenConstraint
from .head import SPAN_NATS
from .sampling import SamplingParams, position_seed, token_probs
from .speculative import GuessPolicy, accept_guesses
from .stage import StageModel
from .state import Segment, SessionState

__all__ = ["Decoder", "PENDING_MAX", "StepOutcome", "LastStep", "finish_steps", "token_logprobs"]

PENDING_MAX = 64  # accepted rows a session that drafts nothing may hold back from the MTP layer


class Decoder:
    """Per-session decoding state on the last stage: sampling, outstanding guesses, guess policy, counters."""

    def __init__(self, state: SessionState, sampling: SamplingParams, policy: GuessPolicy, *,
                 top_logprobs: int | None = None, constraint: TokenConstraint | None = None,
                 windows: int = 1) -> None:
        if not state.window.fits_guesses(policy.max_guesses, windows):
            raise ModelError(f"{policy.max_guesses} guesses in {windows} windows need a rollback ring of "
                             f"{ring_size(policy.max_guesses, windows)}, session has {state.ring}")
        self.state = state
        self.sampling = sampling
        self.policy = policy
        self.top_logprobs = top_logprobs  # None: no log-probabilities; n: each token's and its n best alternatives'
        if constraint is not None and policy.max_guesses:
            raise ModelError("a session held to a grammar drafts no guesses")
        self.constraint = constraint  # the grammar the sampled tokens follow, or None
        self.generator = torch.Generator().manual_seed(sampling.seed)
        self.guesses: tuple[int, ...] = ()
        self.draft_probs: torch.Tensor | None = None  # [k, V] when sampling
        self.mtp_position = 0  # MTP KV holds positions [0, mtp_position) for accepted tokens
        # accepted positions [mtp_position, mtp_position + len(pending_tokens)) not yet run through the MTP layer:
        # their normed hidden rows (views of the step's output) and the token after each
        self.pending_hidden: list[torch.Tensor] = []
        self.pending_tokens: list[int] = []
        self.checked: int | None = None  # guesses the last step checked; None if it was not a decode step
        self.draft_s = (0.0, 0.0)  # seconds on the MTP layer in the step before the last one, and in the last one
        self.draft_wall_s = (0.0, 0.0)  # the same on the wall clock (for drivers that time trips on the wall)
        self.caught_up = (False, False)  # whether those included rows held back from earlier steps
        self.proposed = 0
        self.accepted = 0
        self.steps = 0
        self.accepted_at = [0] * (policy.max_guesses + 1)  # accepted_at[j]: steps where guess j+1 was kept
        self.proposed_at = [0] * (policy.max_guesses + 1)
        # several windows in flight (greedy, fixed guesses only): after a step whose guesses were all kept, draft
        # one more window past the next one - its first token the guess of what that step's new token will be -
        # for the ring to hand on before the next one is checked. ``ahead``: the tokens of that window, while it is
        # in flight ([first, *guesses]); ``forced``: the draft chain goes through these tokens first (the guesses
        # of the window in flight), then drafts freely
        self.windows = windows if sampling.greedy and not policy.adaptive and policy.max_guesses else 1
        self.ahead: tuple[int, ...] | None = None
        self.forced: tuple[int, ...] = ()
        self.extra = 0  # free drafts wanted past the guesses: 1 + the guesses of the window ahead
        self.drafted: tuple[int, ...] = ()  # the free drafts of the last step (the guesses, then the window ahead)

    @property
    def mtp_end(self) -> int:
        """The position after the last accepted one the MTP layer knows of (run or pending)."""
        return self.mtp_position + len(self.pending_tokens)

    def record_trip(self, seconds: float, *, wall: bool = False) -> None:
        """The time of the whole trip (every stage and the finish) that carried this session's last step.

        By default ``seconds`` is the calling thread's CPU time (``time.thread_time``, as the drafting here is timed:
        steadier than wall time on a shared machine); that is what ``LocalChain`` reports, the compute of every
        stage in one thread. With ``wall=True`` it is wall time (``time.perf_counter``/``monotonic``) and the
        drafting is taken on the wall clock too, so the two never mix: the network's last stage reports the wall
        time between finishing the session's previous step and finishing this one, a whole cycle (its own compute,
        the return hop, the client, the other stages, the hops and the queues), which no CPU clock can see.

        The cost of a step with g guesses is the drafting of them (in the trip before) plus its own trip minus the
        drafting done in it; the policy weighs guesses against it. Drivers that cannot time the whole trip skip
        this and the policy keeps its prior costs.
        """
        if self.checked is not None and not self.caught_up[0]:  # a held-back catch-up is no steady-state cost
            before, last = self.draft_wall_s if wall else self.draft_s
            self.policy.observe_cost(self.checked, before + seconds - last)

    def check_guesses(self, guesses: tuple[int, ...]) -> None:
        """Sampled guesses are checked against the draft distribution they were drawn from, so they must be the ones
        this stage drafted (greedy guesses may be anyone's: they are checked against the argmax)."""
        if guesses and not self.sampling.greedy and (guesses != self.guesses or self.draft_probs is None):
            raise SessionStateError("sampled guesses must be the ones this stage drafted for the session")

    def roll_back(self, start: int) -> None:
        """A step from ``start``: forget the MTP layer's positions and held-back rows from ``start`` on (the step
        rewrites them; :func:`~sangama_p2p.positions.mtp_keep`)."""
        self.mtp_position, keep = mtp_keep(self.mtp_position, len(self.pending_tokens), start)
        if keep == 0:
            self.pending_hidden, self.pending_tokens = [], []
        elif keep < len(self.pending_tokens):
            rows = torch.cat(self.pending_hidden)[:keep]
            self.pending_hidden, self.pending_tokens = [rows], self.pending_tokens[:keep]


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    tokens: tuple[int, ...]  # accepted guesses + one new token
    accepted: int
    guesses: tuple[int, ...]  # drafts to check in the next step
    # per token (when the session asked): its log-probability and the top ones, (logprob, top ids, top logprobs)
    logprobs: tuple[tuple[float, tuple[int, ...], tuple[float, ...]], ...] = ()
    # several windows in flight: whether the window drafted ahead of this step (Decoder.ahead) stands - every guess
    # kept and its first token the new one, so it is the next step and ``guesses`` are its guesses (None: none was
    # ahead) - and the window drafted now past the next step ([first, *guesses]; empty: none)
    ahead_stands: bool | None = None
    window_ahead: tuple[int, ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int
                   ) -> tuple[tuple[float, tuple[int, ...], tuple[float, ...]], ...]:
    """For each token ``tokens[j]`` chosen from ``logits[j]`` ([len(tokens), V]): its natural-log probability under
    the model (float32 log-softmax of the raw logits: before temperature and top-p, as OpenAI reports them) and the
    ``top`` highest ones, best first."""
    lp = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)  # [T, V]
    chosen = lp.gather(-1, torch.tensor(tokens, dtype=torch.long).unsqueeze(-1)).squeeze(-1).clamp(max=0.0)
    vals, ids = lp.topk(top, dim=-1) if top else (lp[:, :0], lp[:, :0].long())
    vals = vals.clamp(max=0.0)
    return tuple((float(c), tuple(i), tuple(v)) for c, i, v in zip(chosen.tolist(), ids.tolist(), vals.tolist()))


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
    normed = stage.final_normed(hidden)
    if len(items) == 1:
        wanted = normed[lengths[0] - items[0].n_guesses - 1:]
    else:
        wanted = normed[torch.cat([torch.arange(o + n - it.n_guesses - 1, o + n)
                                   for it, o, n in zip(items, offsets, lengths)])]
    logits = stage.head_logits(wanted, _spans([it.decoder for it in items], [it.n_guesses + 1 for it in items]))
    # 2. acceptance per session
    outcomes: list[tuple[int, tuple[int, ...]]] = []
    stands: list[bool | None] = []
    logprobs: list[tuple[tuple[float, tuple[int, ...], tuple[float, ...]], ...]] = []
    row = 0
    for it in items:
        k = it.n_guesses
        dec = it.decoder
        guesses = step_guesses(it.tokens, k)
        dec.check_guesses(guesses)
        probs = dec.draft_probs if k and not dec.sampling.greedy else None
        if not dec.sampling.greedy:  # this step's draws (acceptance, new token, drafts) keyed by where they start
            dec.generator.manual_seed(position_seed(dec.sampling.seed, it.start + len(it.tokens) - k))
        scored = logits[row:row + k + 1]
        if dec.constraint is not None:  # k == 0: the grammar follows the step's tokens, then decides the next one
            dec.constraint.follow(it.start, it.tokens)
            scored = _constrained(stage, wanted[row:row + 1], scored, dec)
        res = accept_guesses(scored, guesses, probs, dec.sampling, dec.generator)
        scores = () if dec.top_logprobs is None else token_logprobs(logits[row:row + k + 1], res.tokens,
                                                                    dec.top_logprobs)
        row += k + 1
        dec.steps += 1
        dec.proposed += k
        dec.accepted += res.accepted
        for j in range(k):
            dec.proposed_at[j] += 1
            dec.accepted_at[j] += j < res.accepted
        dec.policy.update(k, res.accepted)
        dec.checked = k if is_decode_step(len(it.tokens), k) else None
        outcomes.append((res.accepted, res.tokens))
        logprobs.append(scores)
        stands.append(_plan_ahead(dec, k, res.accepted, res.tokens[-1]))
    # 3. + 4. keep the MTP layer current and draft
    drafts = _mtp_and_draft(stage, items, offsets, normed.to(stage.dtype), outcomes)  # (the MTP computes in the stage's dtype)
    out = []
    for i, (acc, tokens) in enumerate(outcomes):
        dec = items[i].decoder
        guesses, ahead = drafts[i], ()
        if stands[i]:  # the window in flight is the next step: its guesses stand, the new drafts go past it
            guesses, ahead = dec.forced, dec.drafted
        elif dec.extra:
            guesses, ahead = drafts[i][:dec.policy.max_guesses], drafts[i][dec.policy.max_guesses:]
        if len(ahead) < 2:  # a window needs its first token and at least one guess
            ahead = ()
        dec.guesses, dec.ahead, dec.forced, dec.extra = guesses, ahead or None, (), 0
        out.append(StepOutcome(tokens, acc, guesses, logprobs[i], stands[i], ahead))
    return out


def _plan_ahead(dec: Decoder, k: int, accepted: int, new: int) -> bool | None:
    """Whether the window ``dec`` drafted ahead stands once a step with ``k`` guesses kept ``accepted`` of them and
    drew ``new`` (None: none was ahead), and what this step's drafting must do for the windows in flight: go through
    that window's guesses first (``forced``), and draft one more window past it (``extra``) after a step whose
    guesses were all kept (when guesses are mostly wrong, windows ahead would be cut short: none)."""
    was, dec.forced, dec.extra = dec.ahead, (), 0
    stands = None if was is None else (accepted == k > 0 and new == was[0])
    if stands:
        dec.forced = was[1:]
    if dec.windows > 1 and k and accepted == k:
        dec.extra = 1 + dec.policy.max_guesses
    return stands


def _mtp_and_draft(
    stage: StageModel,
    items: Sequence[LastStep],
    offsets: list[int],
    normed: torch.Tensor,
    outcomes: list[tuple[int, tuple[int, ...]]],
) -> list[tuple[int, ...]]:
    drafts: list[tuple[int, ...]] = [()] * len(items)
    for it in items:
        dec = it.decoder
        dec.guesses, dec.draft_probs = (), None
        dec.draft_s, dec.caught_up = (dec.draft_s[1], 0.0), (dec.caught_up[1], False)
        dec.draft_wall_s = (dec.draft_wall_s[1], 0.0)
    if stage.mtp is None:
        return drafts
    t0, w0 = time.thread_time(), time.perf_counter()
    # catch-up: rows 0..r_last of each step (their next token is now known), plus the rows held back before
    segs, parts, nexts, run, plans = [], [], [], [], []
    for i, it in enumerate(items):
        dec = it.decoder
        if dec.policy.max_guesses == 0:
            continue
        dec.roll_back(it.start)
        acc, tokens = outcomes[i]
        r_last = kept(len(it.tokens), it.n_guesses, acc) - 1
        rows = normed[offsets[i]:offsets[i] + r_last + 1]  # [r_last + 1, H]
        earlier = bool(dec.pending_tokens) or dec.checked is None  # rows held back before, or the prompt's
        dec.pending_hidden.append(rows)
        dec.pending_tokens.extend([*it.tokens[1:r_last + 1], tokens[-1]])
        k = dec.policy.plan()
        if k == 0 and len(dec.pending_tokens) < PENDING_MAX:
            continue  # nothing to draft: hold the rows back
        dec.caught_up = (dec.caught_up[0], earlier)  # a catch-up of more than this step's rows: not a step's cost
        segs.append(Segment(dec.state, dec.mtp_position, len(dec.pending_tokens)))
        parts.extend(dec.pending_hidden)
        nexts.extend(dec.pending_tokens)
        dec.mtp_position = dec.mtp_end
        dec.pending_hidden, dec.pending_tokens = [], []
        run.append(i)
        plans.append(k)
    if not run:
        return drafts
    u = stage.mtp_forward(torch.cat(parts), torch.tensor(nexts), segs)
    live = [a for a, k in enumerate(plans) if k > 0]  # indices into run
    if live:
        row_ends = list(itertools.accumulate(s.length for s in segs))
        ends = [row_ends[a] - 1 for a in live]
        # [B, H] the MTP state of each drafting session's last accepted position
        cur = u[ends[0]:ends[0] + 1] if len(ends) == 1 else u[torch.tensor(ends)]
        _draft(stage, [items[run[a]].decoder for a in live], cur)
        for a in live:
            drafts[run[a]] = items[run[a]].decoder.guesses
    spent, spent_wall = time.thread_time() - t0, time.perf_counter() - w0
    for i in run:
        dec = items[i].decoder
        dec.draft_s = (dec.draft_s[0], spent)
        dec.draft_wall_s = (dec.draft_wall_s[0], spent_wall)
    return drafts


def _draft(stage: StageModel, decs: list[Decoder], cur: torch.Tensor) -> None:
    """Draft guesses autoregressively with the MTP layer for ``decs``, from their MTP states ``cur`` [B, H]."""
    positions = [d.mtp_position for d in decs]  # the first draft round writes here (the new token's position)
    got: list[list[int]] = [[] for _ in decs]
    probs: list[list[torch.Tensor]] = [[] for _ in decs]
    live = list(range(len(decs)))
    while live:
        lg = stage.head_logits(cur, _spans([decs[a] for a in live], [1] * len(live)))  # [B', V]
        best = lg.argmax(-1).tolist()
        # the draft's own probability of its guess, only where a policy looks at it: no full-vocabulary softmax
        lse = torch.logsumexp(lg, -1).tolist() if any(decs[a].policy.wants_confidence for a in live) \
            else None
        keep = []
        for b, a in enumerate(live):
            dec = decs[a]
            free = len(got[a]) - len(dec.forced)
            if len(got[a]) >= guess_room(dec.state.capacity, positions[a]):
                continue
            if free < 0:  # the guesses of the window in flight (greedy): the chain goes through them
                g, q = dec.forced[len(got[a])], None
            elif dec.sampling.greedy:
                g, q = best[b], None
            else:
                q = token_probs(lg[b], dec.sampling).float().cpu()  # drawn on the CPU (its generator's device)
                g = int(torch.multinomial(q, 1, generator=dec.generator))
            conf = math.exp(float(lg[b, g]) - lse[b]) if lse is not None else 1.0
            if free >= 0 and not _keep(dec, free, conf):
                continue
            got[a].append(g)
            if q is not None:
                probs[a].append(q)
            keep.append(b)
        still_b = [b for b in keep if len(got[live[b]]) < _chain(decs[live[b]])]
        if not still_b:
            break
        # one more MTP step for the sessions that keep drafting: input (their MTP state, their last guess)
        still = [live[b] for b in still_b]
        segs = [Segment(decs[a].state, positions[a] + len(got[a]) - 1, 1) for a in still]
        if len(still_b) < len(live):
            cur = cur[torch.tensor(still_b)]
        cur = stage.mtp_forward(cur, torch.tensor([got[a][-1] for a in still]), segs)
        live = still
    for a, dec in enumerate(decs):
        dec.guesses = dec.drafted = tuple(got[a][len(dec.forced):])
        dec.draft_probs = torch.stack(probs[a]) if probs[a] else None


def _keep(dec: Decoder, free: int, confidence: float) -> bool:
    """Whether ``dec`` keeps its free draft number ``free + 1``: past a window in flight, the ``extra`` drafts of
    the window after it; else the policy's guesses, then the ``extra`` drafts of a window past them."""
    if dec.forced:
        return free < dec.extra
    limit = dec.policy.limit()
    return dec.policy.keep_drafting(free, confidence) if free < limit else free < limit + dec.extra


def _chain(dec: Decoder) -> int:
    """How long ``dec``'s draft chain runs: through the guesses of the window in flight and then the window past it,
    or the guesses (and the window past them) of the policy."""
    if dec.forced:
        return len(dec.forced) + dec.extra
    return dec.policy.limit() + dec.extra


def _constrained(stage: StageModel, normed: torch.Tensor, logits: torch.Tensor, dec: Decoder) -> torch.Tensor:
    """A constrained session's scores ``[1, V]``: -inf for every token its grammar does not allow next, and the allowed
    ones near the best allowed recomputed in float32 (the head refined only those near the best of all)."""
    assert dec.constraint is not None
    allowed = dec.constraint.allowed(logits.shape[-1])
    if stage.exact_head is not None:  # the others sink to the row's lowest score: never candidates, same bounds
        spans = None if dec.sampling.greedy else torch.tensor([SPAN_NATS * dec.sampling.temperature])
        logits = stage.exact_head.logits(normed.float(), torch.where(allowed, logits, logits.amin()), spans)
    return logits.masked_fill(~allowed, float("-inf"))


def _spans(decs: Sequence[Decoder], rows: Sequence[int]) -> torch.Tensor | None:
    """For each logits row (``rows[i]`` of them for ``decs[i]``), how far below the top its logits are recomputed in
    float32 (model/head.py): 0 for a greedy session; None when every session is greedy."""
    if all(d.sampling.greedy for d in decs):
        return None
    return torch.tensor([0.0 if d.sampling.greedy else SPAN_NATS * d.sampling.temperature
                         for d, n in zip(decs, rows) for _ in range(n)])
