"""Guesses from the MTP layer, rollback without copies, and batched steps."""

from __future__ import annotations

import torch
import pytest

from sangama_p2p.errors import CapacityError, ModelError, SessionStateError, TooManyGuessesError
from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.decode import Decoder, LastStep, finish_steps
from sangama_p2p.model.sampling import SamplingParams
from sangama_p2p.model.spec import parse_stages
from sangama_p2p.model.speculative import GuessPolicy, accept_guesses
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.model.state import Segment

SPLITS = ["0:8", "0:3,3:8", "0:2,2:5,5:8"]


def _chain(path, stages: str, batch_invariant: bool = False) -> LocalChain:
    ck = open_checkpoint(path)
    return LocalChain.load(ck, parse_stages(stages, ck.spec.num_layers), batch_invariant=batch_invariant)


@pytest.mark.parametrize("name,stages", [("made-qwen", "0:2,2:5,5:8")] + [("made-qwen-v16", s) for s in SPLITS])
def test_greedy_with_guesses_equals_greedy_without(checkpoints, name, stages):
    chain = _chain(checkpoints[name], stages)
    prompt = [3, 1, 2, 0, 3, 7, 9, 2] if name.endswith("v16") else [5, 17, 42, 99, 3, 250, 7, 11]
    base = chain.generate(prompt, 64, stop_at_eos=False)
    accepted = 0
    for k in (1, 2, 3, 4, 5, 6, "auto"):
        res = chain.generate(prompt, 64, guesses=k, stop_at_eos=False)
        assert res.tokens == base.tokens, f"guesses={k}"
        assert res.guesses_proposed > 0
        accepted += res.guesses_accepted
    if name.endswith("v16"):
        assert accepted > 0, "no guess was ever accepted: the accepted path went untested"


def _drive_with_oracle_guesses(chain: LocalChain, prompt: list[int], truth: list[int], k: int, wrong_every: int):
    """Greedy decoding where the guesses are the true continuation with every ``wrong_every``-th guess corrupted."""
    stages = chain.stages
    sessions = [s.new_session(len(prompt) + len(truth) + k + 2, ring=k + 1) for s in stages]
    dec = Decoder(sessions[-1], SamplingParams(), GuessPolicy(k))
    out: list[int] = []
    start, pending, n_guess, counter = 0, list(prompt), 0, 0
    accepted_counts = set()
    while len(out) < len(truth):
        x = None
        for stage, sess in zip(stages, sessions):
            inp = StepInput(sess, start, tokens=torch.tensor(pending)) if stage.is_first else \
                StepInput(sess, start, hidden=x)
            x = stage.forward([inp])
        outcome = finish_steps(stages[-1], [LastStep(dec, start, pending, n_guess)], x)[0]
        accepted_counts.add(outcome.accepted)
        start += len(pending) - n_guess + outcome.accepted
        out.extend(outcome.tokens)
        pos = len(out)
        guesses = []
        for j in range(min(k, len(truth) - pos - 1)):
            counter += 1
            g = truth[pos + j]
            if counter % wrong_every == 0:
                g = (g + 1) % chain.spec.vocab_size
            guesses.append(g)
        pending, n_guess = [out[-1], *guesses], len(guesses)
    return out[:len(truth)], accepted_counts


@pytest.mark.parametrize("stages", SPLITS)
def test_rollback_after_partly_wrong_guesses_keeps_greedy_tokens(checkpoints, stages):
    """Guesses that are right up to a chosen point: every n in 0..k gets accepted at some step."""
    chain = _chain(checkpoints["made-qwen"], stages)
    prompt = [5, 17, 42, 99, 3, 250, 7, 11]
    truth = chain.generate(prompt, 48, stop_at_eos=False).tokens
    seen = set()
    for k, wrong_every in ((4, 3), (6, 4), (3, 2), (5, 6)):
        got, counts = _drive_with_oracle_guesses(chain, prompt, truth, k, wrong_every)
        assert got == truth, f"k={k}"
        seen |= counts
    assert seen >= set(range(0, 6)), seen


@pytest.mark.parametrize("k", [3, 5])
def test_logits_after_rollback_equal_a_clean_run(checkpoints, k):
    """After a step of k guesses with n kept, the next step equals a run that never saw the rejected tokens."""
    ck = open_checkpoint(checkpoints["made-qwen"])
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers, batch_invariant=True)
    assert stage.mtp is not None and {"linear_attention", "full_attention"} <= set(ck.spec.layer_types)
    g = torch.Generator().manual_seed(11)
    prompt = torch.randint(0, ck.spec.vocab_size, (12,), generator=g)
    step = torch.randint(0, ck.spec.vocab_size, (k + 1,), generator=g)  # [token, g1..gk]
    nxt = torch.randint(0, ck.spec.vocab_size, (1,), generator=g)
    probe_h = torch.randn(1, ck.spec.hidden_size, generator=g)
    P = len(prompt)

    def run(keep: int) -> tuple[torch.Tensor, torch.Tensor]:
        state = stage.new_session(64, ring=k + 1)
        h = stage.forward([StepInput(state, 0, tokens=prompt)])
        stage.mtp_forward(stage.final_normed(h), torch.cat([prompt[1:], step[:1]]), [Segment(state, 0, P)])
        h = stage.forward([StepInput(state, P, tokens=step[:keep])])
        # the MTP catch-up for the kept rows, as finish_steps does it
        stage.mtp_forward(stage.final_normed(h[: keep]), torch.cat([step[1:keep], nxt]), [Segment(state, P, keep)])
        logits = stage.logits(stage.forward([StepInput(state, P + keep, tokens=nxt)]))
        mtp = stage.mtp_forward(probe_h, nxt, [Segment(state, P + keep, 1)])
        return logits, mtp

    for n in range(0, k + 1):
        # dirty: the verify step saw all k guesses; the next step's start rolls back to P + n + 1
        state = stage.new_session(64, ring=k + 1)
        h = stage.forward([StepInput(state, 0, tokens=prompt)])
        stage.mtp_forward(stage.final_normed(h), torch.cat([prompt[1:], step[:1]]), [Segment(state, 0, P)])
        h = stage.forward([StepInput(state, P, tokens=step)])
        # drafts wrote speculative MTP entries beyond the accepted position
        stage.mtp_forward(stage.final_normed(h), torch.cat([step[1:], nxt]), [Segment(state, P, k + 1)])
        stage.mtp_forward(stage.final_normed(h[: n + 1]), torch.cat([step[1:n + 1], nxt]), [Segment(state, P, n + 1)])
        logits = stage.logits(stage.forward([StepInput(state, P + n + 1, tokens=nxt)]))
        mtp = stage.mtp_forward(probe_h, nxt, [Segment(state, P + n + 1, 1)])
        clean_logits, clean_mtp = run(n + 1)
        assert (logits - clean_logits).abs().max() <= 1e-5, f"n={n}"
        assert (mtp - clean_mtp).abs().max() <= 1e-5, f"n={n} (MTP layer)"


def test_batched_equals_solo_for_mixed_sessions(checkpoints):
    chain = _chain(checkpoints["made-qwen-v16"], "0:3,3:8", batch_invariant=True)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 16, (n,), generator=g).tolist() for n in (3, 9, 1, 14, 6, 21, 2, 11)]
    settings = [0, 2, "auto", 4, 1, 0, 6, 3]
    solo = [chain.generate(p, 24, guesses=s, stop_at_eos=False).tokens for p, s in zip(prompts, settings)]
    batched = chain.generate_many(prompts, 24, guesses=settings, stop_at_eos=False)
    assert [r.tokens for r in batched] == solo
    # logits of a batched step (prefills, decodes and verify rows mixed) equal one-at-a-time steps within 1e-5
    stage = chain.stages[0]
    last = chain.stages[1]
    states = [(stage.new_session(64, ring=5), last.new_session(64, ring=5)) for _ in prompts]
    rows_solo = []
    for (a, b), p in zip(states, prompts):
        h = stage.forward([StepInput(a, 0, tokens=torch.tensor(p))])
        rows_solo.append(last.logits(last.forward([StepInput(b, 0, hidden=h)])))
    states2 = [(stage.new_session(64, ring=5), last.new_session(64, ring=5)) for _ in prompts]
    h = stage.forward([StepInput(a, 0, tokens=torch.tensor(p)) for (a, _), p in zip(states2, prompts)])
    chunks = torch.split(h, [len(p) for p in prompts])
    batched_logits = last.logits(last.forward([StepInput(b, 0, hidden=c) for (_, b), c in zip(states2, chunks)]))
    assert (torch.cat(rows_solo) - batched_logits).abs().max() <= 1e-5


def test_no_state_copies_over_200_steps(checkpoints, monkeypatch):
    chain = _chain(checkpoints["made-qwen-v16"], "0:4,4:8")
    states_seen = []
    real_new = chain.stages[0].new_session

    sizes = []
    orig_clone = torch.Tensor.clone
    big_clones = []

    def counting_clone(self, *a, **kw):
        if sizes and self.numel() >= min(sizes):
            big_clones.append(tuple(self.shape))
        return orig_clone(self, *a, **kw)

    res = chain.generate([3, 1, 2], 4, guesses=4, stop_at_eos=False)  # warm up, learn state sizes
    assert res.tokens
    for stage in chain.stages:
        s = stage.new_session(240, ring=5)
        states_seen.append(s)
        for layer_state in s.layers.values():
            for t in vars(layer_state).values():
                sizes.append(t.numel())
    del real_new
    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    # drive 200 steps by hand on these sessions and check their memory never moves or grows
    ptrs = {id(t): t.data_ptr() for s in states_seen for ls in s.layers.values() for t in vars(ls).values()}
    before = [s.nbytes for s in states_seen]
    dec = Decoder(states_seen[-1], SamplingParams(), GuessPolicy(4))
    start, pending, k = 0, [3, 1, 2], 0
    for _ in range(200):
        if start + len(pending) >= 235:
            break
        x = None
        for stage, sess in zip(chain.stages, states_seen):
            inp = StepInput(sess, start, tokens=torch.tensor(pending)) if stage.is_first else \
                StepInput(sess, start, hidden=x)
            x = stage.forward([inp])
        o = finish_steps(chain.stages[-1], [LastStep(dec, start, pending, k)], x)[0]
        start += len(pending) - k + o.accepted
        pending, k = [o.tokens[-1], *o.guesses], len(o.guesses)
    assert dec.steps >= 40
    assert [s.nbytes for s in states_seen] == before
    after = {id(t): t.data_ptr() for s in states_seen for ls in s.layers.values() for t in vars(ls).values()}
    assert after == ptrs, "a state tensor was reallocated"
    assert not big_clones, f"state-sized tensors were cloned: {big_clones[:3]}"
    ring = states_seen[0]
    accounted = sum(t.numel() * t.element_size() for ls in ring.layers.values() for t in vars(ls).values())
    assert ring.nbytes == accounted == chain.stages[0].session_bytes(240, 5)


def test_typed_errors(checkpoints):
    chain = _chain(checkpoints["made-qwen"], "0:8")
    stage = chain.stages[0]
    with pytest.raises(ModelError, match="guesses must be in 0..8"):
        chain.generate([1, 2, 3], 4, guesses=9)
    with pytest.raises(ModelError, match="rollback ring"):
        Decoder(stage.new_session(32, ring=2), SamplingParams(), GuessPolicy(4))
    state = stage.new_session(32, ring=3)
    dec = Decoder(state, SamplingParams(), GuessPolicy(2))
    h = stage.forward([StepInput(state, 0, tokens=torch.arange(4))])
    with pytest.raises(TooManyGuessesError, match="at most 2"):
        finish_steps(stage, [LastStep(dec, 0, [0, 1, 2, 3], 3)], h)
    with pytest.raises(SessionStateError, match="ahead of the session"):
        stage.forward([StepInput(state, 9, tokens=torch.arange(1))])
    need = stage.session_bytes(32, 3)
    with pytest.raises(CapacityError, match="over its budget"):
        stage.new_session(32, ring=3, budget=need - 1)
    assert stage.new_session(32, ring=3, budget=need).nbytes == need


CHI2_4DOF_P001 = 18.467  # chi-square critical value, 4 degrees of freedom, p = 0.001


def _chi2(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def _first_tokens(rule, p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0)
    logits = p.log()
    counts = torch.zeros(p.shape[-1])
    for _ in range(n):
        guesses = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(q.shape[0])]
        counts[rule(logits, guesses, q, params, gen).tokens[0]] += 1
    return counts


def test_sampling_with_guesses_keeps_the_distribution():
    """First emitted token ~ p, whatever the draft q; and the test detects a rule with a 5% bias."""
    p = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10], [0.1, 0.2, 0.3, 0.2, 0.2], [0.2] * 5])
    q = torch.tensor([[0.05, 0.10, 0.15, 0.30, 0.40], [0.2] * 5])  # a poor draft: many rejections
    n = 40_000
    counts = _first_tokens(accept_guesses, p, q, n, seed=0)
    assert _chi2(counts, p[0]) < CHI2_4DOF_P001

    def biased(logits, guesses, draft, params, gen):  # emits a token drawn from a 5%-biased p
        res = accept_guesses(logits, guesses, draft, params, gen)
        if res.tokens[0] == 0 and float(torch.rand((), generator=gen)) < 0.05:
            return type(res)(0, (1,))
        return res

    assert _chi2(_first_tokens(biased, p, q, n, seed=0), p[0]) > CHI2_4DOF_P001


def test_sampling_with_guesses_through_the_model(checkpoints):
    """Temperature sampling with guesses runs end to end and is reproducible for a seed."""
    chain = _chain(checkpoints["made-qwen-v16"], "0:8")
    params = SamplingParams(temperature=0.9, seed=3)
    a = chain.generate([3, 1, 2], 32, params, guesses=3, stop_at_eos=False)
    b = chain.generate([3, 1, 2], 32, params, guesses=3, stop_at_eos=False)
    assert a.tokens == b.tokens and len(a.tokens) == 32


def test_position_keyed_seeds_are_distinct_and_sample_the_distribution():
    """Each sampled position gets its own generator seed from (seed, position): distinct for neighbouring pairs,
    and draws across seeds still follow the distribution (chi-square, as for the acceptance rule)."""
    from sangama_p2p.model.sampling import position_seed

    keys = {position_seed(s, p) for s in range(64) for p in range(64)}
    assert len(keys) == 64 * 64 and all(0 <= k < 2**63 for k in keys)
    assert position_seed(3, 9) == position_seed(3, 9)
    p = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    gen = torch.Generator()
    counts = torch.zeros(5)
    for seed in range(4000):
        gen.manual_seed(position_seed(seed, 17))
        counts[int(torch.multinomial(p, 1, generator=gen))] += 1
    assert _chi2(counts, p) < CHI2_4DOF_P001
