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


def ring_size(max_guesses: int, windows: int = 1) -> int:
    """Snapshots a session that may carry ``max_guesses`` guesses keeps: one per position of a verify step, for each
    of the ``windows`` verify steps that may be in flight at once (a window cut short rolls every stage back past
    the ones after it)."""
    return windows * (max_guesses + 1) if max_guesses else 0


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
    ring snapshot). The ring is circular: the state after position ``p`` goes to slot ``p % ring``, and it holds the
    snapshots after the last ``ring_len`` positions (written by multi-token steps back to back; a step that keeps
    none - one token, or longer than the ring - empties it). With one window of guesses in flight a rollback goes
    back into the last step only; with several (issue 29) into the ones before it too.
    """

    capacity: int
    ring: int = 0
    recurrent: bool = False
    position: int = 0  # positions whose effects all caches hold
    ring_len: int = 0  # snapshots held: after positions [position - ring_len, position)

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
                f"cannot roll back from position {self.position} to {start}: only the states after the last "
                f"{self.ring_len} positions are kept"
            )

    def can_roll_back_to(self, pos: int) -> bool:
        if pos == self.position:
            return True
        if not self.recurrent:
            return 0 <= pos < self.position
        # the state "after position pos-1" must be in the ring
        return self.position - self.ring_len <= pos - 1 < self.position

    def fits_guesses(self, max_guesses: int, windows: int = 1) -> bool:
        """Whether the ring can take back any verify step of ``max_guesses`` guesses, ``windows`` of them in flight."""
        return not self.recurrent or ring_size(max_guesses, windows) <= self.ring

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
        if not self.recurrent:
            self.position = pos
            return None
        self.ring_len -= self.position - pos
        self.position = pos
        return (pos - 1) % self.ring

    def ring_offset(self, start: int, length: int) -> int:
        """The ring slot of a step's first snapshot (the step's snapshots wrap round the ring's end)."""
        return start % self.ring if self.ring else 0

    def advance(self, start: int, length: int) -> None:
        """A step over [start, start + length) ran (from the position the session held): the session holds its
        positions, and the ring their snapshots after the ones it held if the step kept them (:meth:`keeps_ring`),
        else none."""
        self.position = start + length
        self.ring_len = min(self.ring, self.ring_len + length) if self.keeps_ring(length) else 0
