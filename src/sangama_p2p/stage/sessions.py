"""The stage's session table: who owns each session, what it may send, and the memory all sessions hold. No I/O.

Ownership: a session belongs to the peer that opened it (its authenticated libp2p peer id, which must equal the
``client_id`` it claims). Steps are accepted from the owner, and from the one upstream stage the owner named in
``OpenSession.prev_hop`` (on the first stage: the last stage named in ``OpenSession.ring``, which hands each next
trip on itself); any other peer is refused with ``NOT_OWNER``, even one that learnt the session id (every stage of
the chain knows it). The first stage of a chain (its range starts at layer 0) takes token ids from the
client only, so it refuses an ``OpenSession`` that names a ``prev_hop``.

Memory: every session's caches are preallocated at open and counted against ``StageConfig.memory_budget``; a
session that does not fit, or one over ``max_sessions``, is refused with ``CAPACITY`` before anything is allocated.

Fairness: one peer holds at most ``StageConfig.sessions_per_peer`` sessions (``CAPACITY``, "per-peer quota"), and a
session with no step for ``session_idle_s`` is freed by :meth:`SessionTable.expire_idle`; its id is remembered (the
last ``EXPIRED_KEPT``) so that its owner coming back is told ``EXPIRED`` rather than ``UNKNOWN_SESSION``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from .. import clock
from ..errors import CapacityError, ErrorCode, StageError
from ..model.constraint import TokenConstraint
from ..model.decode import Decoder
from ..model.sampling import SamplingParams
from ..model.speculative import GuessPolicy
from ..model.stage import StageModel
from ..model.state import SessionState
from ..positions import is_decode_step, next_start, ring_size
from ..wire.messages import OpenSession
from .config import StageConfig, default_memory_budget

__all__ = ["SessionTable", "StageSession", "TripClock"]

EXPIRED_KEPT = 4096  # ids of expired sessions remembered for their owners' next frame
GAP_FACTOR = 4.0  # a cycle this many times longer than the one before it was a pause, not a trip


class TripClock:
    """The last stage's view of a session's trips, on its own monotonic clock (pure bookkeeping, no I/O).

    The wall time between finishing (answering) a session's step and finishing its next step is the whole trip
    that carried the next step: the return hop, the client, the other stages and their hops and queues, and this
    stage's queue and compute. :meth:`lap` returns that time for a step that is a trip of the steady decode loop,
    and ``None`` where the interval is something else or has nothing to compare with: the first step of the
    session; a prefill or prefill chunk; a step whose start position does not continue the previous step (a
    replay or rollback: the session was not just waiting for its own previous answer); the first decode step after
    any of these (it also carries the client's start-up work; its cycle is kept only as the reference for the next
    one); and a cycle more than ``GAP_FACTOR`` times the one before it (the client paused; a lasting slowdown is
    taken from the next cycle on, since each cycle is compared with the one just before it).
    """

    def __init__(self, gap_factor: float = GAP_FACTOR) -> None:
        self.gap_factor = gap_factor
        self.last_end: float | None = None  # when the previous step finished
        self.next_start: int | None = None  # where a step continuing it starts
        self.last_cycle: float | None = None  # the previous step's cycle, if it was a decode step continuing one

    def lap(self, start: int, tokens: int, guesses: int, accepted: int, now: float) -> float | None:
        """A step of ``tokens`` token ids (the last ``guesses`` of them guesses) starting at ``start`` finished at
        ``now`` with ``accepted`` guesses kept: the seconds of its trip, or ``None`` if the interval is no trip."""
        decode = is_decode_step(tokens, guesses)
        cycle = None
        if decode and self.last_end is not None and start == self.next_start:
            cycle = now - self.last_end
        out = None
        if cycle is not None and self.last_cycle is not None and 0 < cycle <= self.gap_factor * self.last_cycle:
            out = cycle
        self.last_cycle = cycle
        self.last_end = now
        self.next_start = next_start(start, tokens, guesses, accepted)
        return out


@dataclass(eq=False)
class StageSession:
    """One open session on this stage. ``reply`` is the owner's stream (results and errors go there)."""

    session_id: bytes
    owner: str
    reply: Any
    next_hop: str | None
    state: SessionState
    decoder: Decoder | None  # the last stage's sampling / guess state
    max_guesses: int
    nbytes: int
    upstream: str | None = None  # the peer the owner named to feed this session (OpenSession.prev_hop)
    # the ring (OpenSession.ring): on the first stage, the last stage, which may step it too; on the last stage, the
    # first stage, to which it hands each next trip of a Step marked ring while the trip is below ring_until and
    # no answered token is in ring_stop
    ring: str | None = None
    ring_until: int = 0
    ring_stop: frozenset[int] = frozenset()
    # the last stage of a ring with several windows in flight: the highest step number it handed on, the window
    # handed on ahead of the next trip (number, start, tokens), and the numbers of windows that no longer stand
    # (dropped here unseen when they come round)
    ring_sent: int = 0
    ahead: tuple[int, int, tuple[int, ...]] | None = None
    ring_drop: set[int] = field(default_factory=set)
    source: tuple[str, ...] = ()  # the owner's address and network (net.addrs.source_keys), counted like its id
    closed: bool = False
    last_active: float = field(default_factory=clock.now)  # opened or last stepped (monotonic s)
    trips: TripClock = field(default_factory=TripClock)  # the last stage's trip times, for ``auto`` guesses


    def drops(self, step: int) -> bool:
        """Whether step ``step`` is a window ahead that no longer stands (the last stage of a ring), to be dropped
        unseen; it is forgotten then (each such number comes round once)."""
        if step not in self.ring_drop:
            return False
        self.ring_drop.discard(step)
        return True


class SessionTable:
    """Open sessions of one stage, with ownership checks and memory accounting."""

    def __init__(self, model: StageModel, config: StageConfig, fingerprint: str | None = None) -> None:
        self.model = model
        self.config = config
        self.fingerprint = fingerprint  # this stage's checkpoint (None: not known, sessions' fingerprints unchecked)
        self.sessions: dict[bytes, StageSession] = {}
        # the sessions' cache budget: configured, or from the device's free memory now that the weights are loaded
        self.memory_budget = (config.memory_budget if config.memory_budget is not None
                              else default_memory_budget(getattr(model, "device", None)))
        self.used_bytes = 0
        self.per_peer: dict[str, int] = {}  # owner -> sessions open
        self.per_source: dict[str, int] = {}  # "address A" / "network N" -> sessions open from there
        self.expired: OrderedDict[bytes, str] = OrderedDict()  # expired session id -> its owner

    @property
    def free_sessions(self) -> int:
        """Sessions of ``typical_session_length`` positions (no guesses) the stage could still open."""
        per = max(self.model.session_bytes(min(self.config.typical_session_length, self._max_len()), 0), 1)
        by_memory = (self.memory_budget - self.used_bytes) // per
        return max(0, min(self.config.max_sessions - len(self.sessions), by_memory))

    def _max_len(self) -> int:
        return min(self.config.max_session_length, self.model.spec.max_position_embeddings)

    def open(self, msg: OpenSession, peer: str, reply: Any, constraint: TokenConstraint | None = None,
             source: tuple[str, ...] = ()) -> StageSession:
        """Validate ``msg`` from ``peer`` (at ``source``: its address and network, net.addrs.source_keys) and
        allocate the session; raises :class:`StageError` with a code. ``constraint``: the grammar of
        ``msg.grammar``, compiled by the caller (it may take a thread's while)."""
        self.admit(msg, peer, source)
        if (msg.grammar is not None) != (constraint is not None):
            raise StageError("a grammar needs its compiled constraint", ErrorCode.INTERNAL)
        return self._allocate(msg, peer, reply, constraint, source)

    def admit(self, msg: OpenSession, peer: str, source: tuple[str, ...] = ()) -> None:
        """Every check :meth:`open` makes before it allocates (a grammar is compiled only for a session that passes
        them: a peer over its quota costs the stage no compile)."""
        cfg, model = self.config, self.model
        if msg.client_id != peer:
            raise StageError(f"client_id {msg.client_id} is not the sending peer {peer}", ErrorCode.NOT_OWNER)
        old = self.sessions.get(msg.session_id)
        if old is not None:
            code = ErrorCode.BAD_FRAME if old.owner == peer else ErrorCode.NOT_OWNER
            raise StageError("a session with this id is already open", code)
        if msg.model_id != cfg.model_id:
            raise StageError(f"this stage serves {cfg.model_id!r}, not {msg.model_id!r}", ErrorCode.WRONG_MODEL)
        if msg.fingerprint is not None and self.fingerprint is not None and msg.fingerprint != self.fingerprint:
            raise StageError(f"this stage serves checkpoint {self.fingerprint}, not {msg.fingerprint} (its record "
                             "lies or is stale)", ErrorCode.WRONG_MODEL)
        if (msg.start, msg.end) != (model.start, model.end):
            raise StageError(
                f"this stage serves layers {model.start}:{model.end}, not {msg.start}:{msg.end}", ErrorCode.WRONG_MODEL
            )
        if model.is_last != (msg.next_hop is None):
            what = "the last stage answers the client (next_hop must be empty)" if model.is_last else (
                "a stage before the last needs a next_hop")
            raise StageError(what, ErrorCode.BAD_FRAME)
        if model.is_first and msg.prev_hop is not None:
            raise StageError("the first stage takes token ids from its client only (prev_hop must be empty)",
                             ErrorCode.BAD_FRAME)
        if msg.grammar is not None and not model.is_last:
            raise StageError("only the last stage holds output to a grammar (grammar must be empty)",
                             ErrorCode.BAD_FRAME)
        if msg.ring is not None and not (model.is_first or model.is_last):
            raise StageError("only the first and the last stage close the ring (ring must be empty)",
                             ErrorCode.BAD_FRAME)
        if msg.max_guesses > cfg.max_guesses:
            raise StageError(f"at most {cfg.max_guesses} guesses per step here", ErrorCode.TOO_MANY_GUESSES)
        if msg.max_guesses and model.is_last and model.mtp is None:
            raise StageError("this model has no MTP layer to draft guesses", ErrorCode.TOO_MANY_GUESSES)
        if not 0 < msg.max_length <= self._max_len():
            raise StageError(f"max_length must be in 1..{self._max_len()}, got {msg.max_length}", ErrorCode.CAPACITY)
        if len(self.sessions) >= cfg.max_sessions:
            raise StageError(f"stage is full: {len(self.sessions)} sessions open", ErrorCode.CAPACITY)
        if self.per_peer.get(peer, 0) >= cfg.sessions_per_peer:
            raise StageError(f"per-peer quota: {peer} already holds {cfg.sessions_per_peer} sessions here",
                             ErrorCode.CAPACITY)
        for key, quota in zip(source, (cfg.sessions_per_address, cfg.sessions_per_network)):
            if self.per_source.get(key, 0) >= quota:  # keys are free: one host minting them gets no more
                raise StageError(f"per-{key.split()[0]} quota: {key.split()[1]} already holds {quota} sessions here "
                                 "(whatever peer ids opened them)", ErrorCode.CAPACITY)

    def _allocate(self, msg: OpenSession, peer: str, reply: Any, constraint: TokenConstraint | None,
                  source: tuple[str, ...]) -> StageSession:
        model = self.model
        ring = ring_size(msg.max_guesses, msg.windows)
        need = model.session_bytes(msg.max_length, ring)
        left = self.memory_budget - self.used_bytes
        try:
            state = model.new_session(msg.max_length, ring=ring, budget=left)
        except CapacityError as exc:
            raise StageError(f"stage memory is full: {exc}", ErrorCode.CAPACITY) from exc
        decoder = None
        if model.is_last:
            sampling = SamplingParams(msg.temperature, msg.top_p, msg.seed)
            decoder = Decoder(state, sampling, GuessPolicy(msg.max_guesses, msg.adaptive_guesses),
                              top_logprobs=msg.top_logprobs, constraint=constraint,
                              windows=msg.windows if msg.ring is not None else 1)
        session = StageSession(msg.session_id, peer, reply, msg.next_hop, state, decoder, msg.max_guesses, need,
                               upstream=msg.prev_hop, source=source, ring=msg.ring, ring_until=msg.ring_until,
                               ring_stop=frozenset(msg.ring_stop))
        self.sessions[msg.session_id] = session
        self.used_bytes += need
        self._count(session, +1)
        self.expired.pop(msg.session_id, None)
        return session

    def lookup(self, session_id: bytes) -> StageSession:
        session = self.sessions.get(session_id)
        if session is None:
            if session_id in self.expired:
                raise StageError(f"the session was freed after {self.config.session_idle_s:g} s without a step",
                                 ErrorCode.EXPIRED)
            raise StageError("no such session on this stage", ErrorCode.UNKNOWN_SESSION)
        return session

    def authorize_step(self, session_id: bytes, peer: str) -> StageSession:
        """The session if ``peer`` may step it (owner, the upstream stage the owner named, or on the first stage the
        last stage that closes the ring); raises NOT_OWNER/UNKNOWN_SESSION."""
        session = self.lookup(session_id)
        if peer == session.owner or peer == session.upstream or (peer == session.ring and self.model.is_first):
            session.last_active = clock.now()
            return session
        if session.upstream is None:
            raise StageError("only the client that opened the session may step it", ErrorCode.NOT_OWNER)
        raise StageError("the session is fed by another peer", ErrorCode.NOT_OWNER)

    def close(self, session_id: bytes, peer: str) -> StageSession:
        """Free a session; only its owner (or its upstream stage) may."""
        session = self.lookup(session_id)
        if peer not in (session.owner, session.upstream):
            raise StageError("only the client that opened the session may close it", ErrorCode.NOT_OWNER)
        self._drop(session)
        return session

    def drop_reply_stream(self, reply: Any) -> list[StageSession]:
        """The owner's stream ended: free every session that answered on it."""
        gone = [s for s in self.sessions.values() if s.reply is reply]
        for s in gone:
            self._drop(s)
        return gone

    def expire_idle(self, now: float | None = None) -> list[StageSession]:
        """Free every session with no step for ``session_idle_s`` (``now``: a ``clock.now()`` reading)."""
        now = clock.now() if now is None else now
        gone = [s for s in self.sessions.values() if now - s.last_active >= self.config.session_idle_s]
        for s in gone:
            self._drop(s)
            self.expired[s.session_id] = s.owner
            while len(self.expired) > EXPIRED_KEPT:
                self.expired.popitem(last=False)
        return gone

    def drop_all(self) -> None:
        for s in list(self.sessions.values()):
            self._drop(s)

    def _drop(self, session: StageSession) -> None:
        if self.sessions.pop(session.session_id, None) is not None:
            session.closed = True
            self.used_bytes -= session.nbytes
            self._count(session, -1)

    def _count(self, session: StageSession, delta: int) -> None:
        """Count ``session`` in (+1) or out (-1) of its owner's, address's and network's quotas."""
        for counts, key in ((self.per_peer, session.owner), *((self.per_source, k) for k in session.source)):
            left = counts.get(key, 0) + delta
            if left > 0:
                counts[key] = left
            else:
                counts.pop(key, None)
