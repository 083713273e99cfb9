"""The cost-aware guess policy (pure), the held-back MTP catch-up, and the dense multi-token MoE path."""

from __future__ import annotations

import pytest
import torch

from sangama_p2p.errors import ModelError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.decode import PENDING_MAX, Decoder, LastStep, finish_steps
from sangama_p2p.model.layers import MoE
from sangama_p2p.model.mtp import MTP_KEY
from sangama_p2p.model.sampling import SamplingParams
from sangama_p2p.model.spec import parse_stages
from sangama_p2p.model.speculative import GuessPolicy
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.model.chain import LocalChain


def _feed(policy: GuessPolicy, steps: int, kept_of: dict[int, int], cost: dict[int, float]) -> list[int]:
    """Run ``steps`` planned steps: a plan of k keeps ``kept_of[k]`` guesses and costs ``cost[k]`` seconds."""
    plans = []
    for _ in range(steps):
        k = policy.plan()
        plans.append(k)
        policy.update(k, min(kept_of.get(k, 0), k))
        policy.observe_cost(k, cost[k])
    return plans


def test_fixed_policy_always_plans_its_maximum():
    p = GuessPolicy(4)
    assert [p.plan() for _ in range(5)] == [4] * 5
    p.update(4, 1)
    assert p.limit() == 4 and p.keep_drafting(3, 0.0) and not p.keep_drafting(4, 1.0)


def test_auto_starts_plain_and_picks_the_best_rate():
    # a plain step 1.0 s; guessing at all costs 1.4 s more (an overhead-bound model), each guess 0.1 s; the first 3
    # guesses are always kept, the 4th never
    cost = {0: 1.0, **{k: 1.4 + 0.1 * k for k in range(1, 7)}}
    p = GuessPolicy(6, adaptive=True)
    plans = _feed(p, 60, {k: min(k, 3) for k in range(7)}, cost)
    assert plans[:3] == [0, 0, 0], "the first steps measure a plain step"
    e = p.expected_tokens()
    assert e[3] == pytest.approx(4.0, abs=0.35) and e[1] < e[2] < e[3]
    # steady state: 3 guesses (4 tokens for 1.7 s) beats both 0 (1 per 1 s) and deeper plans (no more kept)
    # (now and then one deeper plan re-checks the 4th guess, and one plain step every 16 re-measures cost(0))
    assert plans[-20:].count(3) >= 15 and set(plans[-20:]) <= {0, 3, 4} and plans[-20:].count(0) <= 2, plans[-20:]


def test_auto_stays_plain_when_guesses_do_not_pay_and_probes_with_backoff():
    # every guess step costs 2.2x a plain step and keeps about half a guess: guessing loses
    cost = {0: 1.0, **{k: 2.2 + 0.05 * k for k in range(1, 7)}}
    p = GuessPolicy(6, adaptive=True, probe_every=8)
    plans = _feed(p, 200, {k: 1 if k else 0 for k in range(7)}, cost)
    guessing = [i for i, k in enumerate(plans) if k]
    assert len(guessing) / len(plans) < 0.15, plans
    late = [i for i in guessing if i > 100]
    assert late, "probes continue, so that guessing can resume"
    gaps = [b - a for a, b in zip(late, late[1:]) if b - a > 1]
    assert gaps and min(gaps) >= 16, f"probes back off while they do not pay: {gaps}"


def test_auto_resumes_guessing_when_the_text_becomes_predictable():
    cost = {0: 1.0, **{k: 1.6 + 0.05 * k for k in range(1, 7)}}
    p = GuessPolicy(6, adaptive=True, probe_every=8)
    plans = _feed(p, 60, {k: 0 for k in range(7)}, cost)  # nothing is ever kept
    assert plans[-20:].count(0) >= 17, plans
    plans = _feed(p, 80, {k: k for k in range(7)}, cost)  # now every guess is kept
    assert sum(1 for k in plans[-20:] if k >= 4) >= 15, plans


def test_costs_extrapolate_from_measured_steps():
    p = GuessPolicy(6, adaptive=True)
    assert p.step_costs() == pytest.approx([1.0 + 0.1 * k for k in range(7)])  # the prior, nothing measured
    p.observe_cost(0, 2.0)
    p.observe_cost(2, 4.0)
    p.observe_cost(4, 4.4)
    c = p.step_costs()
    assert c[0] == 1.0 and c[2] == pytest.approx(2.0) and c[4] == pytest.approx(2.2)
    assert c[6] == pytest.approx(2.4) and c[1] == pytest.approx(1.9)  # the line through k = 2 and 4
    p.observe_cost(0, 100.0)  # a descheduled step: clamped to twice the average, then a slow rise
    assert p.cost[0] == pytest.approx(2.0 + 0.1 * (4.0 - 2.0))
    p.observe_cost(0, 1.0)  # the load went away: a fast drop
    assert p.cost[0] == pytest.approx(2.2 - 0.5 * (2.2 - 1.0))
    with pytest.raises(ModelError):
        GuessPolicy(-1)
    with pytest.raises(ModelError):
        GuessPolicy(2, adaptive=True, decay=0.0)


def test_acceptance_estimates_follow_the_positions():
    p = GuessPolicy(4, adaptive=True)
    for _ in range(50):
        p.update(4, 1)  # guess 1 always kept, guess 2 never
    c = p.acceptance()
    assert c[0] > 0.9 and c[1] < 0.2
    assert p.expected_tokens()[4] < 2.2


def _drive(stage: StageModel, dec: Decoder, prompt: list[int], n: int, plan=None) -> tuple[list[int], int]:
    """Greedy decoding of ``n`` steps through one whole-model stage; ``plan(i)`` forces the policy's choices.

    Returns the tokens and the start position of the next step."""
    start, pending, k, out = 0, list(prompt), 0, []
    for i in range(n):
        if plan is not None:
            dec.policy.plan = lambda i=i: plan(i)  # type: ignore[method-assign]
            dec.policy.planned = plan(i)
        h = stage.forward([StepInput(dec.state, start, tokens=torch.tensor(pending))])
        o = finish_steps(stage, [LastStep(dec, start, pending, k)], h)[0]
        start += len(pending) - k + o.accepted
        out.extend(o.tokens)
        pending, k = [o.tokens[-1], *o.guesses], len(o.guesses)
    return out, start


def test_held_back_catch_up_fills_the_mtp_cache_like_every_step(checkpoints):
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    # batch-invariant numerics: a row's numbers do not depend on how many rows its step had, so the two schedules
    # (a 64-row catch-up vs one row at a time, 1-token vs 3-token verify steps) must agree to rounding
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers, batch_invariant=True)
    prompt = [3, 1, 2, 0, 3, 7]
    steps = PENDING_MAX + 20
    ref = Decoder(stage.new_session(3 * steps + 16, ring=3), SamplingParams(), GuessPolicy(2))
    ref_tokens, _ = _drive(stage, ref, prompt, steps)
    # plain steps (rows held back, flushed at PENDING_MAX rows), guesses, plain again, guesses again
    flush = PENDING_MAX + 6

    def plan(i: int) -> int:
        return 0 if i < flush or flush + 6 <= i < flush + 10 else 2

    lazy = Decoder(stage.new_session(3 * steps + 16, ring=3), SamplingParams(), GuessPolicy(2, adaptive=True))
    got, nxt = _drive(stage, lazy, prompt, steps, plan)
    n = min(len(got), len(ref_tokens))
    assert got[:n] == ref_tokens[:n], "guesses never change greedy tokens"
    assert lazy.proposed > 0 and lazy.mtp_end == nxt and not lazy.pending_tokens
    # the MTP KV of every position the lazy session has run equals the one caught up step by step
    pos = min(lazy.mtp_position, ref.mtp_position)
    assert pos > PENDING_MAX
    kv_lazy, kv_ref = lazy.state.layers[MTP_KEY], ref.state.layers[MTP_KEY]
    assert (kv_lazy.k[..., :pos, :] - kv_ref.k[..., :pos, :]).abs().max() <= 1e-5
    assert (kv_lazy.v[..., :pos, :] - kv_ref.v[..., :pos, :]).abs().max() <= 1e-5


def test_plain_auto_steps_run_no_mtp_work(checkpoints, monkeypatch):
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    calls = []
    real = stage.mtp_forward
    monkeypatch.setattr(stage, "mtp_forward", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    dec = Decoder(stage.new_session(3 * PENDING_MAX + 8, ring=3), SamplingParams(), GuessPolicy(2, adaptive=True))
    _, nxt = _drive(stage, dec, [3, 1, 2], 3 * PENDING_MAX, plan=lambda i: 0)
    # one multi-row catch-up per PENDING_MAX held rows, nothing in between
    assert calls and all(c >= PENDING_MAX for c in calls) and len(calls) <= 3
    assert dec.guesses == () and dec.proposed == 0 and dec.mtp_end == nxt


def test_local_chain_feeds_step_costs_to_auto(checkpoints):
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    chain = LocalChain.load(ck, parse_stages("0:4,4:8", ck.spec.num_layers))
    seen = []
    real = GuessPolicy.observe_cost

    def spy(self, k, s):
        seen.append((k, s))
        real(self, k, s)

    GuessPolicy.observe_cost = spy  # type: ignore[method-assign]
    try:
        res = chain.generate([3, 1, 2], 40, guesses="auto", stop_at_eos=False)
    finally:
        GuessPolicy.observe_cost = real  # type: ignore[method-assign]
    assert res.guesses_proposed > 0
    assert {k for k, _ in seen} >= {0} and any(k > 0 for k, _ in seen)
    assert all(s > 0 for _, s in seen)


def test_record_trip_takes_the_drafting_on_the_clock_of_the_trip(checkpoints, monkeypatch):
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    dec = Decoder(stage.new_session(64, ring=3), SamplingParams(), GuessPolicy(2, adaptive=True))
    # drafting's CPU time (thread_time) stands still while its wall time runs: the two clocks must stay apart
    import sangama_p2p.model.decode as decode

    monkeypatch.setattr(decode.time, "thread_time", lambda: 5.0)
    _drive(stage, dec, [3, 1, 2], 4, plan=lambda i: 2)
    assert dec.checked == 2 and dec.draft_s == (0.0, 0.0) and all(w > 0 for w in dec.draft_wall_s)
    dec.caught_up = (False, False)
    dec.draft_s, dec.draft_wall_s = (0.01, 0.02), (0.1, 0.3)
    dec.record_trip(1.0)  # LocalChain: CPU time of the trip, drafting in CPU time
    assert dec.policy.cost[2] == pytest.approx(1.0 + 0.01 - 0.02)
    dec.policy.cost[2] = None
    dec.record_trip(1.0, wall=True)  # the network's last stage: wall time of the cycle, drafting in wall time
    assert dec.policy.cost[2] == pytest.approx(1.0 + 0.1 - 0.3)


@pytest.mark.parametrize("rows", [1, 2, 5, 9])
def test_dense_moe_equals_the_expert_loop(checkpoints, rows):
    ck = open_checkpoint(checkpoints["made-qwen"])
    stage = StageModel.load(ck.spec, ck.source, 0, 1)
    moe = stage.layers[0].ffn
    assert isinstance(moe, MoE) and moe.stacked is not None
    x = torch.randn(rows, ck.spec.hidden_size, generator=torch.Generator().manual_seed(rows))
    dense = moe.forward(x)
    stacked, moe.stacked = moe.stacked, None
    try:
        loop = moe.forward(x)
    finally:
        moe.stacked = stacked
    assert (dense - loop).abs().max() <= 1e-5
    # the experts' weights are views of the stacks: nothing is held twice
    assert moe.experts[1].down.data_ptr() == stacked.down_t[1].data_ptr()


def test_sampling_with_auto_guesses_runs_end_to_end(checkpoints):
    """Temperature sampling with the cost-aware policy: plain stretches hold the MTP rows back, guesses resume."""
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    chain = LocalChain.load(ck, parse_stages("0:8", ck.spec.num_layers))
    res = chain.generate([3, 1, 2], 48, SamplingParams(temperature=0.9, seed=3), guesses="auto", stop_at_eos=False)
    assert len(res.tokens) == 48 and all(0 <= t < ck.spec.vocab_size for t in res.tokens)
    assert res.guesses_proposed > 0


def test_auto_climbs_past_a_deeper_plan_measured_once_too_dear():
    # the first step with 2 guesses was slow (a page fault, a busy neighbour): measured once at 5x its cost, k=2
    # looks worse than k=1 and would never be measured again; now and then a plan one deeper re-measures it
    cost = {0: 1.0, 1: 1.4, 2: 1.5, 3: 1.6, 4: 1.7}
    p = GuessPolicy(4, adaptive=True, probe_every=8)
    _feed(p, 3, {}, cost)  # the plain steps first
    p.observe_cost(2, 7.5)
    plans = _feed(p, 120, {k: k for k in range(5)}, cost)  # every guess is kept
    assert sum(1 for k in plans[-20:] if k >= 3) >= 15, plans
