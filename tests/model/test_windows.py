"""Several guess windows in flight (issue 29): a stage's rollback ring holds the states after the positions of the last
few verify steps, so that a window cut short takes the Gated DeltaNet back into the step before it - with exactly the
state a step that never ran past it would have (the snapshots wrap round the ring's end)."""

from __future__ import annotations

import torch

from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.positions import ring_size

PROMPT = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
A, B, C = [7, 2, 5], [11, 3, 8], [9, 9, 4]  # window 1 at 8..10, window 2 at 11..13, and the trip after window 1


def _step(stage: StageModel, *steps: tuple) -> list[torch.Tensor]:
    """One forward of ``(state, start, tokens)`` steps batched together; each step's output rows."""
    out = stage.forward([StepInput(st, start, tokens=torch.tensor(toks)) for st, start, toks in steps])
    return list(out.split([len(t) for _, _, t in steps]))


def test_a_rollback_into_the_window_before_the_last_equals_a_session_that_never_ran_past_it(checkpoints):
    ck = open_checkpoint(checkpoints["made-qwen-v16"])
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    two = ring_size(2, windows=2)
    alone, batched, other = (stage.new_session(64, ring=two) for _ in range(3))
    ref = stage.new_session(64, ring=ring_size(2))
    for st in (alone, batched, other, ref):
        _step(stage, (st, 0, PROMPT.tolist()))
        _step(stage, (st, 8, A))
    _step(stage, (alone, 11, B))  # a session alone: its states go straight into its ring, wrapping round its end
    _step(stage, (batched, 11, B), (other, 11, B))  # batched: gathered, then written into each ring, wrapped
    assert alone.ring == 6 and alone.window.ring_len == 6
    want = _step(stage, (ref, 10, C))[0]  # rolls back into window 1, the only step it ran
    got = _step(stage, (alone, 10, C))[0]  # rolls back past window 2 into window 1
    got_batched = _step(stage, (batched, 10, C))[0]
    assert torch.equal(got, want) and torch.equal(got_batched, want)
    # one window's ring cannot: window 2 took the place of window 1's snapshots
    short = stage.new_session(64, ring=ring_size(2))
    for start, toks in ((0, PROMPT.tolist()), (8, A), (11, B)):
        _step(stage, (short, start, toks))
    assert not short.window.can_roll_back_to(10)
