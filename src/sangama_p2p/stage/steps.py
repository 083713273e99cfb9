"""What a stage checks of a step before it queues it, and the step the last stage of a ring hands on. No I/O."""

from __future__ import annotations

from collections.abc import Sequence

from ..errors import ErrorCode, SangamaError, StageError
from ..model.stage import StageModel
from ..positions import ring_next
from ..wire.messages import Step
from .sessions import StageSession

__all__ = ["check_step", "ring_step"]


def check_step(model: StageModel, session: StageSession, msg: Step) -> None:
    """Everything about a step that does not depend on the session's position (checked in the worker)."""
    n = len(msg.token_ids)
    if n == 0:
        raise StageError("a step needs at least one token id", ErrorCode.BAD_FRAME)
    k = len(msg.guesses)
    if k > session.max_guesses:
        raise StageError(f"{k} guesses, the session allows {session.max_guesses}", ErrorCode.TOO_MANY_GUESSES)
    if k and (k >= n or tuple(msg.token_ids[n - k:]) != msg.guesses):
        raise StageError("the step's token ids must end with its guesses", ErrorCode.BAD_FRAME)
    if model.is_first:
        if msg.hidden is not None:
            raise StageError("the first stage takes token ids, not hidden states", ErrorCode.BAD_FRAME)
        try:
            model.check_token_ids(msg.token_ids)
        except SangamaError as exc:
            raise StageError(str(exc), ErrorCode.BAD_FRAME) from exc
    else:
        h = msg.hidden
        if h is None or h.shape != (n, model.spec.hidden_size):
            shape = None if h is None else list(h.shape)
            raise StageError(f"hidden states must be [{n}, {model.spec.hidden_size}], got {shape}",
                             ErrorCode.BAD_FRAME)


def ring_step(session: StageSession, m: Step, tokens: Sequence[int], guesses: Sequence[int]) -> Step | None:
    """The trip after ``m`` (answered with ``tokens`` and next ``guesses``) that the last stage hands on to the
    ring's first stage, numbered ``m.step + 1`` and marked ``ring`` again; None where the request ends there
    (``positions.ring_next``: the most new tokens reached, or a stop token answered)."""
    nxt = ring_next(m.start_pos, len(m.token_ids), len(m.guesses), tokens, guesses, session.ring_until,
                    session.ring_stop)
    if nxt is None:
        return None
    start, ids = nxt
    return Step(m.session_id, m.step + 1, start, ids, None, tuple(guesses), (), ring=True)
