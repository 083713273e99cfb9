"""A session's positions and its rollback ring, in one place: pure arithmetic, no torch, no I/O.

Everyone who reasons about where a session stands uses these rules: the generation loop (where the next step
starts, how long a session must be: ``generation.py``, driven by the local chain and the network client), the
stage's session table (how large a ring to open, where a step continuing the last one starts) and the runtime
(which steps a session may take, which snapshot a rollback selects, what a step keeps, where the MTP layer stands).

- A step carries ``length`` positions from ``start``; the last ``n_guesses`` of its tokens are guesses (drafts of
  the last stage, to be checked). Its answer keeps ``accepted`` of them and adds one new token, so the step keeps
  ``length - n_guesses + accepted`` positions (:func:`kept`) and the next step starts after them
  (:func:`next_start`), with the new token first. Nothing else tells the stages to roll back: a start position
  behind a session rolls it back.
- Layers whose state is indexed by position (attention, the MTP layer's KV) roll back by moving the position.
  Recurrent layers (Gated DeltaNet) keep a ring of ``max_guesses + 1`` snapshots (:func:`ring_size`): a step of
  2..ring positions writes the state after each of its positions into the ring (:meth:`SessionPositions.keeps_ring`),
  and a later step that starts inside that step selects the snapshot after ``start - 1``
  (:meth:`SessionPositions.roll_back`). A one-token step keeps no snapshot, a longer prefill neither.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .errors import CapacityError, SessionStateError

__all__ = [
    "SessionPositions", "guess_room", "is_decode_step", "kept", "mtp_keep", "next_start", "ring_next", "ring_size",
    "session_length", "step_guesses",
]


def ring_size(max_guesses: int) -> int:
    """Snapshots a session that may carry ``max_guesses`` guesses keeps: one per position of a verify step."""
    return max_guesses + 1 if max_guesses else 0


def session_length(prompt: int, max_new: int, max_guesses: int) -> int:
    """Positions a session needs: the prompt, the new tokens, and room for a last verify step's guesses + 1."""
    return prompt + max_new + max_guesses + 1


def step_guesses(tokens: Sequence[int], n_guesses: int) -> tuple[int, ...]:
    """The guesses a step carries: its last ``n_guesses`` token ids."""
    return tuple(int(t) for t in tokens[len(tokens) - n_guesses:]) if n_guesses else ()


def is_decode_step(length: int, n_guesses: int) -> bool:
    """A step of one new token (plus its guesses); anything longer is a prefill, a prefill chunk or a replay."""
    return length == n_guesses + 1


def kept(length: int, n_guesses: int, accepted: int) -> int:
    """Positions of a step that stay: all but the guesses, plus the ``accepted`` guesses."""
    return length - n_guesses + accepted


def next_start(start: int, length: int, n_guesses: int, accepted: int) -> int:
    """Where the step after this one starts: after its kept positions (its first token is the new one)."""
    return start + kept(length, n_guesses, accepted)


def ring_next(start: int, length: int, n_guesses: int, tokens: Sequence[int], guesses: Sequence[int], until: int,
              stop: frozenset[int] | set[int]) -> tuple[int, tuple[int, ...]] | None:
    """The trip after one from ``start`` of ``length`` tokens (the last ``n_guesses`` guesses) answered with
    ``tokens`` (accepted guesses + the new token) and next ``guesses``: its start and tokens, as the generation loop
    would send them; None where the request ends there - the new token is the last one allowed (its position + 1
    reaches ``until``: the prompt's length + the most new tokens) or an answered token is a stop token. The last
    stage of a ring hands this trip on itself (wire ``Step.ring``), the client expects it."""
    begin = next_start(start, length, n_guesses, len(tokens) - 1)
    if begin + 1 >= until or any(t in stop for t in tokens):
        return None
    return begin, (tokens[-1], *guesses)


def guess_room(capacity: int, position: int) -> int:
    """Guesses a session can still verify once ``position`` is filled: the verify step needs the new token too."""
    return capacity - position - 1


def mtp_keep(mtp_position: int, pending: int, start: int) -> tuple[int, int]:
    """The MTP layer holds positions ``[0, mtp_position)`` plus ``pending`` accepted rows held back after them; a
    step from ``start`` rewrites everything from ``start`` on. Returns the MTP position and the pending rows kept."""
    if start > mtp_position + pending:
        raise SessionStateError(f"the MTP layer holds {mtp_position + pending} positions; step starts at {start}")
    if start <= mtp_position:
        return start, 0
    return mtp_position, min(pending, start - mtp_position)


@dataclass
class SessionPositions:
    """Where one session stands on one stage: positions held, and what its rollback ring covers.

    ``recurrent``: the session holds layers whose state is not indexed by position (a rollback into them needs a
    ring snapshot). Ring slot ``i`` holds the state after position ``ring_base + i``, for ``ring_len`` slots.
    """

    capacity: int
    ring: int = 0
    recurrent: bool = False
    position: int = 0  # positions whose effects all caches hold
    ring_base: int = -1
    ring_len: int = 0

    def check(self, start: int, length: int) -> None:
        """Validate a step over positions [start, start + length) before any state changes."""
        if length <= 0:
            raise SessionStateError("a step needs at least one position")
        if start < 0:
            raise SessionStateError(f"negative start position {start}")
        if start > self.position:
            raise SessionStateError(
                f"start position {start} is ahead of the session, which holds {self.position} positions"
            )
        if start + length > self.capacity:
            raise CapacityError(
                f"positions up to {start + length} exceed the session's capacity of {self.capacity} tokens"
            )
        if start < self.position and not self.can_roll_back_to(start):
            raise SessionStateError(
                f"cannot roll back from position {self.position} to {start}: only the last {self.ring_len} "
                "positions of the previous step are kept"
            )

    def can_roll_back_to(self, pos: int) -> bool:
        if pos == self.position:
            return True
        if not self.recurrent:
            return 0 <= pos < self.position
        # the state "after position pos-1" must be in the ring
        return self.ring_len > 0 and self.ring_base <= pos - 1 < self.ring_base + self.ring_len

    def fits_guesses(self, max_guesses: int) -> bool:
        """Whether the ring can take back any verify step of ``max_guesses`` guesses."""
        return not self.recurrent or ring_size(max_guesses) <= self.ring

    def keeps_ring(self, length: int) -> bool:
        """Whether a step of ``length`` positions writes every position's state into the ring (a 1-token step is
        never rolled back into; a step longer than the ring cannot be)."""
        return self.recurrent and self.ring >= length > 1

    def roll_back(self, pos: int) -> int | None:
        """Hold exactly positions [0, pos): returns the ring slot whose snapshot the recurrent layers must restore
        (None: nothing to restore). Snapshots after ``pos`` are stale from now on; those up to it stay valid."""
        if pos == self.position:
            return None
        if not self.can_roll_back_to(pos):
            raise SessionStateError(f"cannot roll back from position {self.position} to {pos}")
        self.position = pos
        if not self.recurrent:
            return None
        slot = pos - 1 - self.ring_base
        self.ring_len = slot + 1
        return slot

    def advance(self, start: int, length: int) -> None:
        """A step over [start, start + length) ran: the session holds its positions, and the ring covers them if the
        step kept its snapshots (:meth:`keeps_ring`), else nothing."""
        self.position = start + length
        if self.keeps_ring(length):
            self.ring_base, self.ring_len = start, length
        else:
            self.ring_base, self.ring_len = -1, 0
