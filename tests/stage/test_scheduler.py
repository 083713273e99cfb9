"""The batching scheduler alone: which jobs share a step, and that one bad job fails alone. No network."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import trio

from sangama_p2p.errors import ErrorCode
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.stage.config import StageConfig
from sangama_p2p.stage.compute import ComputeThread
from sangama_p2p.stage.scheduler import Job, Scheduler
from sangama_p2p.stage.sessions import SessionTable
from sangama_p2p.tensors import from_wire
from sangama_p2p.wire.messages import OpenSession, Step


def _table(ckpt):
    c = open_checkpoint(ckpt)
    model = StageModel.load(c.spec, c.source, 0, 4)
    return model, SessionTable(model, StageConfig("m", 0, 4))


def _session(table, i):
    return table.open(OpenSession(bytes([i]) * 16, "m", 0, 4, "B", None, "A", 64, 0.0, 1.0, 0, 0, False), "A", None)


def _job(session, start, tokens, step=0):
    return Job(session, Step(session.session_id, step, start, tuple(tokens), None, (), ()), 0)


def test_take_batch_is_fifo_one_job_per_session_within_limits(ckpt):
    model, table = _table(ckpt)
    a, b, c = (_session(table, i) for i in range(3))
    sched = Scheduler(model, lambda job, out: None, max_batch_sessions=2, max_batch_tokens=10)
    jobs = [_job(a, 0, [1, 2]), _job(a, 2, [3], 1), _job(b, 0, [4] * 9), _job(c, 0, [5] * 3)]
    for j in jobs:
        sched.submit(j)
    assert sched.take_batch() == [jobs[0], jobs[3]]  # a's 2nd step waits for a's 1st; b's 9 tokens do not fit
    assert sched.take_batch() == [jobs[1], jobs[2]]
    assert sched.take_batch() == []
    b.closed = True
    sched.submit(_job(b, 9, [1]))
    assert sched.take_batch() == []  # a closed session's steps are dropped


def test_one_bad_position_fails_only_its_job_and_batching_matches_alone(ckpt):
    model, table = _table(ckpt)
    a, b, c = (_session(table, i) for i in range(3))
    sched = Scheduler(model, lambda job, out: None)
    outs = sched.compute([_job(a, 0, [1, 2, 3]), _job(b, 5, [1]), _job(c, 0, [4, 5])])
    assert outs[1].error is not None and outs[1].error[0] == ErrorCode.BAD_POSITION
    assert outs[0].error is None and outs[2].error is None
    assert outs[0].batch_size == outs[2].batch_size == 2
    assert outs[0].compute_end_ns >= outs[0].compute_start_ns > 0
    assert outs[0].hidden.shape == (3, model.spec.hidden_size)
    # the same numbers as a step of that session alone
    alone = model.new_session(64)
    ref = model.forward([StepInput(alone, 0, tokens=torch.tensor([4, 5]))])
    torch.testing.assert_close(from_wire(outs[2].hidden), ref, rtol=1e-5, atol=1e-5)
    assert sched.stats.jobs == 2 and sched.stats.steps == 1


def test_worker_delivers_each_sessions_steps_in_order(ckpt):
    model, table = _table(ckpt)
    a, b = (_session(table, i) for i in range(2))
    got = []

    async def main():
        sched = Scheduler(model, lambda job, out: got.append((job.msg.session_id[0], job.msg.step, out.error)))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run)
            for step in range(3):
                sched.submit(_job(a, step, [7], step))
                sched.submit(_job(b, step, [8], step))
            with trio.fail_after(20):
                while len(got) < 6:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert [g for g in got if g[0] == 0] == [(0, 0, None), (0, 1, None), (0, 2, None)]
    assert [g for g in got if g[0] == 1] == [(1, 0, None), (1, 1, None), (1, 2, None)]


@pytest.mark.parametrize("inline_max_s", [0.0, 10.0])
def test_short_decode_steps_run_inline_and_prefills_in_the_compute_thread(ckpt, inline_max_s):
    """Once decode-like steps are known to be short, they run on the trio thread (no hand-off); the first step, any
    prefill and everything with ``inline_max_s=0`` run in the compute thread. The outputs are the same either way."""
    model, table = _table(ckpt)
    a = _session(table, 0)
    threads: list[tuple[int, bool]] = []
    got = []
    sched = Scheduler(model, lambda job, out: got.append(out), inline_max_s=inline_max_s)
    compute = sched.compute

    def spy(batch):
        threads.append((len(batch[0].msg.token_ids), threading.current_thread() is threading.main_thread()))
        return compute(batch)

    sched.compute = spy
    plan = [(0, [1]), (1, [2]), (2, [3, 4, 5] * 6), (20, [6]), (21, [7])]  # the third is a prefill (18 tokens)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run)
            for step, (start, tokens) in enumerate(plan):
                sched.submit(_job(a, start, tokens, step))
                with trio.fail_after(20):
                    while len(got) <= step:
                        await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(main)
    inline = inline_max_s > 0
    assert threads == [(1, False), (1, inline), (18, False), (1, inline), (1, inline)]
    assert all(out.error is None for out in got)
    alone = model.new_session(64)
    for start, tokens in plan:
        ref = model.forward([StepInput(alone, start, tokens=torch.tensor(tokens))])
    torch.testing.assert_close(from_wire(got[-1].hidden), ref, rtol=1e-5, atol=1e-5)


def test_a_short_step_submitted_alone_is_computed_at_once_and_others_still_batch(ckpt):
    """``submit(job, alone=True)`` computes and delivers a short step before it returns when nothing is queued or
    running; a job that is not alone, or one behind queued jobs, waits for the worker and batches with them.
    ``inline_max_s`` is far above any step's duration, so "short" does not depend on how busy the machine is (at
    the default 10 ms a loaded machine's first step times out of it and the step goes to the worker)."""
    model, table = _table(ckpt)
    a, b, c = (_session(table, i) for i in range(3))
    got: list[tuple[int, int, int]] = []
    sched = Scheduler(model, lambda job, out: got.append((job.msg.session_id[0], job.msg.step, out.batch_size)),
                      inline_max_s=1e6)

    async def main():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sched.run)
            sched.submit(_job(a, 0, [1], 0), alone=True)  # no step timed yet: goes to the worker
            assert got == []
            with trio.fail_after(20):
                while not got:
                    await trio.sleep(0.001)
            sched.submit(_job(a, 1, [2], 1), alone=True)  # short, nothing queued: computed here and now
            assert got[-1] == (0, 1, 1)
            sched.submit(_job(b, 0, [3], 0))  # not alone: queued for the worker ...
            sched.submit(_job(c, 0, [4], 0), alone=True)  # ... so this one queues behind it and batches with it
            assert len(got) == 2
            with trio.fail_after(20):
                while len(got) < 4:
                    await trio.sleep(0.001)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert got[2:] == [(1, 0, 2), (2, 0, 2)]


def test_compute_thread_runs_calls_in_order_in_one_other_thread_and_raises_their_errors():
    seen: list[tuple[int, str]] = []

    def work(i: int) -> int:
        seen.append((i, threading.current_thread().name))
        if i == 3:
            raise ValueError("three")
        return i * i

    async def main():
        worker = ComputeThread(name="test-compute")
        try:
            assert [await worker.run(work, i) for i in range(3)] == [0, 1, 4]
            with pytest.raises(ValueError, match="three"):
                await worker.run(work, 3)
            assert await worker.run(work, 4) == 16  # the thread survives an error
        finally:
            worker.stop()
        return worker

    worker = trio.run(main)
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert {name for _, name in seen} == {"test-compute"} != {threading.current_thread().name}
    worker._thread.join(timeout=5)
    assert not worker._thread.is_alive()


def test_a_cancelled_caller_waits_for_the_call_to_finish():
    """Session state must never be left half-updated: cancellation takes effect after the call, as with
    trio.to_thread.run_sync."""
    finished: list[float] = []

    def slow() -> None:
        time.sleep(0.3)
        finished.append(time.monotonic())

    async def main():
        worker = ComputeThread()
        try:
            with trio.move_on_after(0.05) as scope:
                await worker.run(slow)
            assert scope.cancelled_caught
            assert finished and time.monotonic() >= finished[0]  # it had finished before we got control back
        finally:
            worker.stop()

    trio.run(main)
