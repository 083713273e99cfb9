"""A failing job must never change another job's state or result (issue 15, item 4). The last stage of the tiny
Qwen3.5-MoE model (Gated DeltaNet layers, MTP drafting), sampled sessions at temperature 0.8. No network."""

from __future__ import annotations

import math

import pytest
import torch

from sangama_p2p.errors import ErrorCode, SangamaError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.stage.config import StageConfig
from sangama_p2p.stage.scheduler import Job, Outcome, Scheduler
from sangama_p2p.stage.sessions import SessionTable
from sangama_p2p.tensors import from_wire, to_wire
from sangama_p2p.wire.messages import OpenSession, Step

OTHERS = 10
STEPS = 4


class _Driver:
    """One session across the two stages: a first-stage state (made here) feeding a last-stage session."""

    def __init__(self, first: StageModel, table: SessionTable, i: int, prompt: list[int]) -> None:
        self.first, self.fstate = first, first.new_session(64, ring=3)
        msg = OpenSession(bytes([i + 1]) * 16, "m", 4, 8, None, None, "A", 64, 0.8, 1.0, 1000 + i, 2, False)
        self.session = table.open(msg, "A", None)
        self.start, self.tokens, self.guesses = 0, list(prompt), ()
        self.out: list[int] = []
        self.error: tuple[ErrorCode, str] | None = None

    def job(self, step: int, poison: float | None = None) -> Job:
        ids = tuple(self.tokens)
        hidden = self.first.forward([StepInput(self.fstate, self.start, tokens=torch.tensor(ids))])
        if poison is not None:
            hidden = hidden.clone()
            hidden[len(ids) // 2, 3] = poison
        msg = Step(self.session.session_id, step, self.start, ids, to_wire(hidden, "fp32"), self.guesses, ())
        return Job(self.session, msg, 0)

    def take(self, out) -> None:
        if out.error is not None:
            self.error = out.error
            return
        res = out.last
        self.out.extend(res.tokens)
        self.start += len(self.tokens) - len(self.guesses) + res.accepted
        self.tokens, self.guesses = [res.tokens[-1], *res.guesses], res.guesses


def _models(ckpt):
    c = open_checkpoint(ckpt)
    return StageModel.load(c.spec, c.source, 0, 4), StageModel.load(c.spec, c.source, 4, 8)


def _prompt(i: int) -> list[int]:
    return [(3 * i + j) % 16 for j in range(5 + i % 3)]


def _decoding(d: _Driver) -> tuple:
    """What a step leaves in a session's decoder besides its tokens."""
    dec = d.session.decoder
    return (dec.steps, dec.proposed, dec.accepted, tuple(dec.accepted_at), dec.mtp_position, dec.mtp_end, dec.guesses,
            dec.policy.planned, tuple(dec.policy.tried))


def _solo(first, last, i, *, decoding: bool = False):
    table = SessionTable(last, StageConfig("m", 4, 8))
    sched = Scheduler(last, lambda job, out: None)
    d = _Driver(first, table, i, _prompt(i))
    for step in range(STEPS):
        (out,) = sched.compute([d.job(step)])
        d.take(out)
    assert d.error is None
    return (d.out, _decoding(d)) if decoding else d.out


@pytest.mark.parametrize("poison", [math.nan, math.inf])
def test_non_finite_hidden_states_fail_only_their_session(ckpt, poison):
    first, last = _models(ckpt)
    want = [_solo(first, last, i) for i in range(1, OTHERS + 1)]
    table = SessionTable(last, StageConfig("m", 4, 8, max_sessions=OTHERS + 1, max_sessions_per_peer=OTHERS + 1))
    sched = Scheduler(last, lambda job, out: None)
    drivers = [_Driver(first, table, i, _prompt(i)) for i in range(OTHERS + 1)]
    bad, others = drivers[0], drivers[1:]
    for step in range(STEPS):
        live = [d for d in drivers if d.error is None]
        jobs = [d.job(step, poison if d is bad else None) for d in live]
        for d, out in zip(live, sched.compute(jobs)):
            d.take(out)
    assert bad.error is not None and bad.error[0] == ErrorCode.NON_FINITE, bad.error
    assert [d.error for d in others] == [None] * OTHERS
    assert [d.out for d in others] == want


def test_a_job_that_fails_inside_the_batched_step_changes_no_other_job(ckpt):
    """Past the receipt checks (``Scheduler._run`` directly, as if NaN arose inside the stage): the sampling of the
    poisoned session raises in the middle of the batched finish, after every session's decoder was touched. The
    retry puts every decoder back and finishes each job alone: the others still get their solo tokens."""
    first, last = _models(ckpt)
    want = [_solo(first, last, i, decoding=True) for i in range(1, OTHERS + 1)]
    table = SessionTable(last, StageConfig("m", 4, 8, max_sessions=OTHERS + 1, max_sessions_per_peer=OTHERS + 1))
    sched = Scheduler(last, lambda job, out: None)
    drivers = [_Driver(first, table, i, _prompt(i)) for i in range(OTHERS + 1)]
    bad, others = drivers[0], drivers[1:]
    drivers = [*others[:5], bad, *others[5:]]  # sessions before and after it in the batch
    for step in range(STEPS):
        live = [d for d in drivers if d.error is None]
        jobs = [d.job(step, math.nan if d is bad else None) for d in live]
        inputs = [StepInput(j.session.state, j.msg.start_pos, hidden=from_wire(j.msg.hidden)) for j in jobs]
        for d, res in zip(live, sched._run(jobs, inputs)):
            d.take(Outcome(error=(res.code, str(res))) if isinstance(res, SangamaError) else Outcome(last=res))
    assert bad.error is not None and bad.error[0] == ErrorCode.INTERNAL, bad.error
    assert [d.error for d in others] == [None] * OTHERS
    assert [(d.out, _decoding(d)) for d in others] == want
