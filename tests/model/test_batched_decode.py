"""Batched steps: sessions grouped into stacked Gated DeltaNet / MoE / attention work give what each gives alone."""

from __future__ import annotations

import pytest
import torch

from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.decode import Decoder, LastStep, finish_steps
from sangama_p2p.model.layers import MoE
from sangama_p2p.model.sampling import SamplingParams
from sangama_p2p.model.spec import parse_stages
from sangama_p2p.model.speculative import GuessPolicy
from sangama_p2p.model.stage import StageModel, StepInput

PROMPT_LENGTHS = (3, 9, 1, 14, 6, 21, 2, 11)


def _stage(path, batch_invariant: bool = False) -> StageModel:
    ck = open_checkpoint(path)
    return StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers, batch_invariant=batch_invariant)


def _prompts(vocab: int, seed: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in PROMPT_LENGTHS]


def test_default_mode_generate_many_equals_solo(checkpoints):
    """Mixed prompt lengths and guess settings (verify steps batched with 1-token steps): the same tokens."""
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    chain = LocalChain.load(ck, parse_stages("0:3,3:8", ck.spec.num_layers))
    prompts = [p.tolist() for p in _prompts(16)]
    settings = [0, 2, "auto", 4, 1, 0, 6, 3]
    solo = [chain.generate(p, 24, guesses=s, stop_at_eos=False) for p, s in zip(prompts, settings)]
    batched = chain.generate_many(prompts, 24, guesses=settings, stop_at_eos=False)
    assert [r.tokens for r in batched] == [r.tokens for r in solo]
    assert sum(r.guesses_accepted for r in batched) > 0, "no guess accepted: rollback inside a batch went untested"


def _run_steps(stage: StageModel, schedule: list[list[tuple[int, int, int]]], prompts, batched: bool):
    """Run ``schedule`` (per step: (session, start, length) items) batched or one session at a time.

    Tokens of a step are the prompt's own, cycled, so both runs see the same inputs. Returns the logits of every
    item, in schedule order.
    """
    states = [stage.new_session(64, ring=6) for _ in prompts]
    out = []
    for step in schedule:
        inputs = [StepInput(states[i], start, tokens=prompts[i].repeat(8)[start:start + n]) for i, start, n in step]
        if batched:
            logits = stage.logits(stage.forward(inputs))
            out.extend(torch.split(logits, [n for _, _, n in step]))
        else:
            out.extend(stage.logits(stage.forward([inp])) for inp in inputs)
    return out


def _mixed_schedule() -> list[list[tuple[int, int, int]]]:
    n = PROMPT_LENGTHS
    return [
        [(i, 0, n[i]) for i in range(8)],  # prefills of different lengths (one padded chunked group, ring sessions)
        [(0, n[0], 1), (1, n[1], 4), (2, n[2], 1), (3, n[3], 5), (4, n[4], 1), (5, n[5], 3), (6, n[6], 1),
         (7, n[7], 4)],  # 1-token steps between verify steps: groups with rows that are not consecutive
        [(0, n[0] + 1, 1), (1, n[1] + 1, 1), (2, n[2] + 1, 2), (3, n[3] + 3, 1), (4, n[4] + 1, 1),
         (5, n[5] + 1, 2), (6, n[6] + 1, 1), (7, n[7] + 4, 1)],  # rollbacks (1, 3, 5) into the verify steps' rings
        [(0, n[0] + 2, 1), (3, n[3] + 4, 1), (5, n[5] + 3, 1)],  # a subset of the sessions
    ]


def test_default_mode_mixed_steps_logits_equal_solo(checkpoints):
    stage = _stage(checkpoints["made-qwen"])
    prompts = _prompts(stage.spec.vocab_size)
    schedule = _mixed_schedule()
    solo = _run_steps(stage, schedule, prompts, batched=False)
    batched = _run_steps(stage, schedule, prompts, batched=True)
    # within 1e-5 of the logits' scale (|logit| up to ~20 here): BLAS takes other kernels for 1 row than for many,
    # so fp32 rows differ in their last bits (the per-session loops this replaced differed by as much)
    worst = max(float((a - b).abs().max() / a.abs().max()) for a, b in zip(solo, batched))
    assert worst <= 1e-5, worst
    assert all(torch.equal(a.argmax(-1), b.argmax(-1)) for a, b in zip(solo, batched))


def test_batch_invariant_mixed_steps_bit_identical(checkpoints):
    stage = _stage(checkpoints["made-qwen"], batch_invariant=True)
    prompts = _prompts(stage.spec.vocab_size)
    schedule = _mixed_schedule()
    solo = _run_steps(stage, schedule, prompts, batched=False)
    batched = _run_steps(stage, schedule, prompts, batched=True)
    assert all(torch.equal(a, b) for a, b in zip(solo, batched))


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_decode_steps_equal_alone_whatever_the_batch(checkpoints, batch_invariant):
    """One session's decode steps alone, then in batches of 2, 5 and 8 sessions: equal (bit-identical if invariant)."""
    stage = _stage(checkpoints["made-qwen"], batch_invariant=batch_invariant)
    prompts = _prompts(stage.spec.vocab_size, seed=9)
    nexts = torch.randint(0, stage.spec.vocab_size, (8, 6), generator=torch.Generator().manual_seed(1))

    def run(size: int) -> list[torch.Tensor]:
        states = [stage.new_session(64) for _ in prompts[:size]]
        for s, p in zip(states, prompts):
            stage.forward([StepInput(s, 0, tokens=p)])
        rows = []
        for j in range(nexts.shape[1]):
            h = stage.forward([StepInput(s, len(p) + j, tokens=nexts[i, j:j + 1])
                               for i, (s, p) in enumerate(zip(states, prompts))])
            rows.append(stage.logits(h)[0])  # session 0
        return rows

    alone = run(1)
    for size in (2, 5, 8):
        got = run(size)
        for a, b in zip(alone, got):
            if batch_invariant:
                assert torch.equal(a, b), size
            else:
                assert float((a - b).abs().max() / a.abs().max()) <= 1e-5, size


def test_stacked_experts_match_the_expert_loop(checkpoints):
    stage = _stage(checkpoints["made-qwen"])
    moe = stage.layers[0].ffn
    assert isinstance(moe, MoE) and moe.stacked is not None
    # the experts' weights are views of the stack: no second copy
    base = moe.stacked.gate_up_t.untyped_storage().data_ptr()
    assert all(e.gate_up.parts[0].untyped_storage().data_ptr() == base for e in moe.experts)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(37, stage.spec.hidden_size, generator=g)
    k = stage.spec.num_experts_per_tok
    top_w, top_i = torch.topk(torch.softmax(torch.randn(37, len(moe.experts), generator=g), -1), k, dim=-1)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    ref = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for s in range(k):
            ref[r] += moe.experts[int(top_i[r, s])].forward(x[r:r + 1])[0] * top_w[r, s]
    dense = moe.stacked.dense(x, top_i, top_w)
    grouped = moe.stacked.grouped(x, top_i, top_w)
    assert grouped is not None
    assert float((dense - ref).abs().max()) <= 1e-5
    assert float((grouped - ref).abs().max()) <= 1e-5
    # every row on one expert: padding would waste most of the products, so the grouped path declines
    assert moe.stacked.grouped(x, torch.zeros_like(top_i), top_w) is None
    # the whole layer with the stacked paths equals the per-expert loop
    with_stack = moe.forward(x)
    stacked, moe.stacked = moe.stacked, None
    try:
        loop = moe.forward(x)
    finally:
        moe.stacked = stacked
    assert float((with_stack - loop).abs().max()) <= 1e-5


def test_batched_steps_keep_state_memory_in_place(checkpoints, monkeypatch):
    """Several sessions with and without guesses batched for many steps: no state tensor moves, grows or is cloned."""
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    guesses = [4, 0, 2, 0, 4]
    states = [stage.new_session(160, ring=k + 1 if k else 0) for k in guesses]
    decs = [Decoder(s, SamplingParams(), GuessPolicy(k)) for s, k in zip(states, guesses)]
    tensors = [t for s in states for ls in s.layers.values() for t in vars(ls).values()]
    smallest = min(t.numel() for t in tensors)
    ptrs = [t.data_ptr() for t in tensors]
    before = [s.nbytes for s in states]
    orig_clone = torch.Tensor.clone
    big_clones = []

    def counting_clone(self, *a, **kw):
        if self.numel() >= smallest:
            big_clones.append(tuple(self.shape))
        return orig_clone(self, *a, **kw)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    starts = [0] * len(states)
    pending = [[3, 1, 2], [5, 4], [7], [1, 2, 3, 4, 5, 6, 7, 8, 9], [2, 2]]
    n_guess = [0] * len(states)
    for _ in range(60):
        if max(s + len(p) for s, p in zip(starts, pending)) >= 150:
            break
        x = stage.forward([StepInput(st, s, tokens=torch.tensor(p)) for st, s, p in zip(states, starts, pending)])
        outs = finish_steps(stage, [LastStep(d, s, p, k) for d, s, p, k in zip(decs, starts, pending, n_guess)], x)
        for i, o in enumerate(outs):
            starts[i] += len(pending[i]) - n_guess[i] + o.accepted
            pending[i], n_guess[i] = [o.tokens[-1], *o.guesses], len(o.guesses)
    assert min(d.steps for d in decs) >= 25
    assert [t.data_ptr() for t in tensors] == ptrs, "a state tensor was reallocated"
    assert [s.nbytes for s in states] == before
    assert not big_clones, f"state-sized tensors were cloned: {big_clones[:3]}"
