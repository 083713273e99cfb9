"""The batching scheduler: one compute worker per stage, several sessions per step.

Frames wait in a FIFO queue. When the worker is free it takes every waiting job it can batch (at most one per
session, so a session's steps run in order; at most ``max_batch_sessions`` jobs and ``max_batch_tokens`` tokens) and
runs them as ONE batched ``StageModel.forward`` in the stage's compute thread (:class:`ComputeThread`), followed on
the last stage by ``decode.finish_steps``. Positions and values are checked per job first, so one session's bad
``start_pos`` or non-finite hidden states (``NON_FINITE``) fail only that job; if the batched step still fails, each
job is retried alone, after every job's state is put back as it was (``Scheduler._run``), to find the culprit: a
failing job never changes another job's state or result.

On the last stage the end of each step also clocks the trips of sessions with ``auto`` guesses: the wall time
between the ends of a session's consecutive steps is the whole trip of the later one (``Scheduler._record_trip``,
``sessions.TripClock``), and prices its guesses (``Decoder.record_trip``).

Short steps run on the trio thread itself (``inline_max_s``): when the smoothed duration of decode-like steps is at
most that (10 ms by default) and the batch is decode-like, the hand-off to the compute thread and back costs more
than blocking the event loop for the step. Measured on the 2-core dev machine with the tiny Llama anchor (3 layers,
~2.3 ms a step): the two thread wake-ups took the stage's queue + send stamps from ~0.22 ms to ~0.62 ms a step. Long
steps (prefills, large models, big batches) still go to the compute thread, so frames keep arriving while they run.
A short step whose reader holds no more frames, arriving while nothing is queued or running, is computed by the
reader itself (``submit(job, alone=True)``): no hop to the worker task. Frames that arrive together still batch.

The worker hands each finished job to ``deliver(job, outcome)`` on the trio thread; delivery must not block (it
queues frames on the right stream).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import trio

from ..errors import ErrorCode, SangamaError, StageError
from ..model.decode import LastStep, StepOutcome, finish_steps
from ..model.stage import StageModel, StepInput
from ..tensors import from_wire, to_wire
from ..wire.messages import Step
from ..wire.tensor import Tensor
from .compute import ComputeThread
from .sessions import StageSession

__all__ = ["Job", "Outcome", "Scheduler", "measure_step"]

_DECODE_TOKENS = 16  # a step with at most this many tokens per job is decode-like (a prefill has more)


def _decode_like(jobs: list[Job]) -> bool:
    return sum(len(j.msg.token_ids) for j in jobs) <= _DECODE_TOKENS * len(jobs)


@dataclass(eq=False)
class Job:
    """One received step of one session, stamped when its frame arrived."""

    session: StageSession
    msg: Step
    recv_ns: int


@dataclass
class Outcome:
    """A job's result: ``hidden`` (middle stages, ready for the wire) or ``last`` (last stage), or an error."""

    compute_start_ns: int = 0
    compute_end_ns: int = 0
    batch_size: int = 0
    hidden: Tensor | None = None
    last: StepOutcome | None = None
    error: tuple[ErrorCode, str] | None = None


@dataclass
class _Stats:
    steps: int = 0  # batched steps run
    jobs: int = 0
    tokens: int = 0
    ewma_step_s: float = 0.0  # smoothed duration of a decode-like batched step (prefills left out)
    compute_s: float = 0.0  # seconds the batched steps took, all together
    queue_s: float = 0.0  # seconds the jobs waited between their frame's arrival and their step's start, summed


class Scheduler:
    """Queue + one compute worker. ``await run()`` in a nursery; ``submit(job)`` from the trio thread."""

    def __init__(
        self,
        model: StageModel,
        deliver: Callable[[Job, Outcome], None],
        *,
        max_batch_sessions: int = 32,
        max_batch_tokens: int = 8192,
        wire_dtype: str = "fp32",
        inline_max_s: float = 0.01,
    ) -> None:
        self.model = model
        self.deliver = deliver
        self.max_batch_sessions = max_batch_sessions
        self.max_batch_tokens = max_batch_tokens
        self.wire_dtype = wire_dtype
        self.inline_max_s = inline_max_s
        self._queue: deque[Job] = deque()
        self._wake = trio.Event()
        self.stats = _Stats()
        self.busy = False

    @property
    def queue_length(self) -> int:
        return len(self._queue) + (1 if self.busy else 0)

    def submit(self, job: Job, *, alone: bool = False) -> None:
        """Queue ``job`` for the worker. ``alone``: the caller holds no more frames; then a short step (see
        :meth:`runs_inline`) with nothing queued or running is computed and delivered here and now, which saves the
        hop to the worker task (and what the reader does before it yields: a read that finds nothing)."""
        if job.session.drops(job.msg.step):  # a window ahead that no longer stands (the last stage of a ring)
            return
        if alone and not self._queue and not self.busy and not job.session.closed and self.runs_inline([job]):
            self._step_inline([job])
            return
        self._queue.append(job)
        self._wake.set()

    def _step_inline(self, batch: list[Job]) -> None:
        self.busy = True
        try:
            outcomes = self.compute(batch)
        finally:
            self.busy = False
        for job, out in zip(batch, outcomes):
            self.deliver(job, out)

    def take_batch(self) -> list[Job]:
        """The next batch: FIFO, one job per session, within the session and token limits (never empty if queued)."""
        batch: list[Job] = []
        seen: set[int] = set()
        tokens = 0
        keep: deque[Job] = deque()
        while self._queue:
            job = self._queue.popleft()
            if job.session.closed:
                continue
            if job.session.drops(job.msg.step):  # queued before the step ahead of it showed it does not stand
                continue
            n = len(job.msg.token_ids)
            fits = len(batch) < self.max_batch_sessions and (not batch or tokens + n <= self.max_batch_tokens)
            if id(job.session) in seen or not fits:
                keep.append(job)
                continue
            seen.add(id(job.session))
            batch.append(job)
            tokens += n
        self._queue = keep
        return batch

    def runs_inline(self, batch: list[Job]) -> bool:
        """Whether ``batch`` runs on the trio thread: decode-like, and decode-like steps have taken at most
        ``inline_max_s`` (smoothed; unknown before the first one, which goes to the compute thread)."""
        ewma = self.stats.ewma_step_s
        return 0 < ewma <= self.inline_max_s and _decode_like(batch)

    async def run(self) -> None:
        """The compute worker: forever take a batch, compute it (inline or in the compute thread), deliver."""
        worker = ComputeThread()
        try:
            while True:
                if not self._queue:
                    self._wake = trio.Event()
                    await self._wake.wait()
                batch = self.take_batch()
                if not batch:
                    continue
                if self.runs_inline(batch):
                    self._step_inline(batch)
                else:
                    self.busy = True
                    try:
                        outcomes = await worker.run(self.compute, batch)
                    finally:
                        self.busy = False
                    for job, out in zip(batch, outcomes):
                        self.deliver(job, out)
                if self._queue:  # let the writers and readers run between back-to-back inline steps
                    await trio.lowlevel.checkpoint()
        finally:
            worker.stop()

    # ---- compute (compute thread, or the trio thread for short steps) ---------------------------------------
    def compute(self, batch: list[Job]) -> list[Outcome]:
        """Run ``batch`` as one step: in the compute thread, or on the trio thread for a short step (never both at
        once: a step starts only when the one before it has been delivered)."""
        outcomes = [Outcome() for _ in batch]
        ready: list[int] = []
        inputs: list[StepInput] = []
        for i, job in enumerate(batch):
            try:
                inputs.append(self._input(job))
                ready.append(i)
            except SangamaError as exc:
                outcomes[i].error = (exc.code, str(exc))
        if not ready:
            return outcomes
        t0 = time.monotonic_ns()
        results = self._run([batch[i] for i in ready], inputs)
        t1 = time.monotonic_ns()
        s = self.stats
        s.steps += 1
        s.jobs += len(ready)
        s.tokens += sum(len(batch[i].msg.token_ids) for i in ready)
        dt = (t1 - t0) / 1e9
        s.compute_s += dt
        s.queue_s += sum(max(t0 - batch[i].recv_ns, 0) for i in ready) / 1e9
        if _decode_like([batch[i] for i in ready]):
            s.ewma_step_s = dt if not s.ewma_step_s else 0.8 * s.ewma_step_s + 0.2 * dt
        for i, res in zip(ready, results):
            out = outcomes[i]
            out.compute_start_ns, out.compute_end_ns, out.batch_size = t0, t1, len(ready)
            if isinstance(res, SangamaError):
                out.error = (res.code, str(res))
            elif isinstance(res, StepOutcome):
                out.last = res
                self._record_trip(batch[i], res, t1 / 1e9)
            else:
                out.hidden = res
        return outcomes

    def _input(self, job: Job) -> StepInput:
        """The job's step input, after the checks that need the session (positions, guesses) or the values (finite
        hidden states: a NaN or Inf would otherwise fail the sampling of every session batched with it)."""
        m, state = job.msg, job.session.state
        if self.model.is_first:
            step = StepInput(state, m.start_pos, tokens=torch.tensor(m.token_ids))
        elif m.hidden is None:  # checked on receipt; kept so a gap there fails typed, not with a TypeError
            raise StageError("a later stage needs hidden states", ErrorCode.BAD_FRAME)
        else:
            # on the CPU: the finiteness check below never waits for a device
            step = StepInput(state, m.start_pos, hidden=from_wire(m.hidden))
        self.model.check_input(step)
        if job.session.decoder is not None:
            job.session.decoder.check_guesses(m.guesses)
        # NaN and Inf make the sum NaN or Inf (and so would finite values summing past 3.4e38, which no model makes).
        # Measured on the 2-core dev machine: a [1, 4096] row 1.5 us, [512, 4096] 75-130 us, where
        # torch.isfinite(x).all() took 10-25 us and 1.5-4 ms.
        if step.hidden is not None and not math.isfinite(float(step.hidden.sum())):
            raise StageError("hidden states hold NaN or Inf values", ErrorCode.NON_FINITE)
        return step

    def _run(self, jobs: list[Job], inputs: list[StepInput]) -> list[Tensor | StepOutcome | SangamaError]:
        """Results in job order; a job that fails gets its error, and never changes another job's state or result.

        A failed batched forward is retried job by job (a session rolls back by its start position; one with
        recurrent layers, whose state the failed step may have half-written, fails with INTERNAL instead). A failed
        finish (the last stage: sampling, drafting) restores every session's decoder as it was before the step
        (:class:`_DecoderSnapshot`) and finishes each job alone from the same hidden rows, which the batched
        forward computed exactly as a step alone would have.
        """
        try:
            hidden = self.model.forward(inputs)
        except Exception as exc:  # noqa: BLE001 - a torch error must fail jobs, not the worker
            if len(jobs) == 1:
                return [_failed(exc)]
            out: list[Tensor | StepOutcome | SangamaError] = []
            for job, inp in zip(jobs, inputs):
                if job.session.state.has_linear():
                    out.append(StageError(f"a batched step failed ({type(exc).__name__}: {exc}) and left this "
                                          "session's recurrent state unknown", ErrorCode.INTERNAL))
                    continue
                out.extend(self._run([job], [inp]))
            return out
        if not self.model.is_last:
            chunks = torch.split(hidden, [len(j.msg.token_ids) for j in jobs])
            return [to_wire(c, self.wire_dtype) for c in chunks]
        snapshots = [_DecoderSnapshot(j.session.decoder) for j in jobs if j.session.decoder is not None] \
            if len(jobs) > 1 else []
        try:
            return list(self._finish(jobs, hidden))
        except Exception as exc:  # noqa: BLE001
            if len(jobs) == 1:
                return [_failed(exc)]
        for snap in snapshots:
            snap.restore()
        rows = torch.split(hidden, [len(j.msg.token_ids) for j in jobs])
        out = []
        for job, row in zip(jobs, rows):
            try:
                out.extend(self._finish([job], row))
            except Exception as exc:  # noqa: BLE001
                out.append(_failed(exc))
        return out

    def _finish(self, jobs: list[Job], hidden: torch.Tensor) -> list[StepOutcome]:
        items = []
        for job in jobs:
            m, dec = job.msg, job.session.decoder
            if dec is None:
                raise StageError("the last stage's session has no decoder", ErrorCode.INTERNAL)
            items.append(LastStep(dec, m.start_pos, m.token_ids, len(m.guesses)))
        return finish_steps(self.model, items, hidden)

    @staticmethod
    def _record_trip(job: Job, res: StepOutcome, now: float) -> None:
        """Last stage, ``auto`` guesses: the session's whole trip, timed between the ends of its steps here
        (:class:`~sangama_p2p.stage.sessions.TripClock`), prices its guesses (``Decoder.record_trip``, wall clock)."""
        dec, m = job.session.decoder, job.msg
        if dec is None or not dec.policy.adaptive:
            return
        seconds = job.session.trips.lap(m.start_pos, len(m.token_ids), len(m.guesses), res.accepted, now)
        if seconds is not None:
            dec.record_trip(seconds, wall=True)



def _failed(exc: Exception) -> SangamaError:
    if isinstance(exc, SangamaError):
        return exc
    return StageError(f"step failed: {type(exc).__name__}: {exc}", ErrorCode.INTERNAL)


def _attrs(obj: Any) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, list) else v for k, v in vars(obj).items()}


class _DecoderSnapshot:
    """A last-stage session's decoding state (guesses, MTP position, held-back rows, counters, guess policy) as it
    was before a batched finish, to put back if that finish fails. Session caches need nothing: KV is indexed by
    position, and the MTP position is part of what is put back; the random generator neither, since
    ``finish_steps`` re-seeds it by position before every draw. Taken only for steps of two jobs or more; measured
    on the shared 2-core dev machine: 2.3 us a job (3.2 us with the generator's state, which is not needed)."""

    def __init__(self, dec: Any) -> None:
        self.dec = dec
        self.attrs = _attrs(dec)
        self.policy = _attrs(dec.policy)

    def restore(self) -> None:
        vars(self.dec).update(self.attrs)
        vars(self.dec.policy).update(self.policy)


def measure_step(model: StageModel, steps: int = 8) -> float:
    """Seconds of a one-token step of one fresh session, the mean of ``steps`` back to back after a warm-up one:
    the throughput announced at start. A mean, not the best: a stage held to a CPU quota (cgroups' CFS: 10 ms of
    every 100) runs a single step or three unthrottled and would announce a speed it cannot keep (measured: a stage
    at a tenth of a core was chained over a free one), while steps back to back reach the quota as real traffic
    does; on a shared machine too, the mean is what a session gets."""
    state = model.new_session(steps + 2)

    def one(i: int) -> None:
        if model.is_first:
            step = StepInput(state, i, tokens=torch.zeros(1, dtype=torch.long))
        else:
            step = StepInput(state, i, hidden=torch.zeros(1, model.spec.hidden_size, dtype=model.dtype))
        x = model.forward([step])
        if model.is_last:
            model.logits(x)

    one(0)  # warm-up: first-use allocations
    t0 = time.perf_counter()
    for i in range(1, steps + 1):
        one(i)
    return (time.perf_counter() - t0) / steps
