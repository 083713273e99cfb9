"""What a stage checks of a step before it queues it, and the step the last stage of a ring hands on. No I/O."""

from __future__ import annotations

from ..errors import ErrorCode, SangamaError, StageError
from ..model.decode import StepOutcome
from ..model.stage import StageModel
from ..positions import ring_next
from ..wire.messages import Step
from .sessions import StageSession

__all__ = ["check_step", "ring_steps"]


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


def ring_steps(session: StageSession, m: Step, res: StepOutcome) -> list[Step]:
    """The trips the last stage hands on to the ring's first stage once ``m`` is answered with ``res``, each marked
    ``ring`` and numbered after every one handed on before: the next trip (``positions.ring_next``) - unless the
    window drafted ahead stands, which is that trip and already on its way - and the window drafted ahead past it
    (several windows in flight), where it fits the session. A window ahead that no longer stands is dropped here when
    it comes round (``ring_drop``). None at all where the request ends (the most new tokens, a stop token)."""
    dec, ahead, session.ahead = session.decoder, session.ahead, None
    nxt = ring_next(m.start_pos, len(m.token_ids), len(m.guesses), res.tokens, res.guesses, session.ring_until,
                    session.ring_stop)
    if ahead is not None and not (res.ahead_stands and nxt is not None):  # cut short, or the request ends here
        session.ring_drop.add(ahead[0])
    out: list[Step] = []
    number = max(m.step, session.ring_sent)
    if nxt is not None:
        start, ids = nxt
        if ahead is not None and res.ahead_stands and ahead[1:] == nxt:
            pass  # the window ahead is the next trip
        else:
            if ahead is not None and res.ahead_stands:  # (never: the decoder drafted it as that trip)
                session.ring_drop.add(ahead[0])
            number += 1
            out.append(Step(m.session_id, number, start, ids, None, tuple(res.guesses), (), ring=True))
        w, at = res.window_ahead, start + len(ids)
        if w and at + 1 < session.ring_until and at + len(w) <= session.state.capacity:
            number += 1
            out.append(Step(m.session_id, number, at, tuple(w), None, tuple(w[1:]), (), ring=True))
            session.ahead = (number, at, tuple(w))
    if session.ahead is None and dec is not None:
        dec.ahead = None  # nothing ahead is in flight
    session.ring_sent = number
    return out
