"""A chain session: the same session id opened on every stage of a route, stepped trip by trip.

The client sends ``OpenSession`` to every stage itself (each stage learns its next hop; the last one answers the
client), then each trip is one ``Step`` to the first stage and one ``StepResult`` back from the last. Anything else
ends the trip with a typed failure:

* :class:`ChainBroken` - a stream to a stage ended, a stage reported that its next hop failed, or the trip timed
  out. The caller probes every stage of the chain (a peer that failed one stream may still be alive, and one that
  did not may be dead), excludes those that do not answer and ``misbehaving`` peers, re-routes and replays (see ``generate.py``). A decode trip times out early, after ``stall_factor`` x the session's smoothed
  decode trip time (at least ``stall_floor`` s, at most ``step_timeout``), once three decode trips were measured:
  a stage that accepted the session and then swallows its steps costs about a second, not ``step_timeout``. Such a
  timeout names the route's peers as ``stalled`` (the caller avoids them where it can). With the ring closed, a
  failed hand-on (the last stage's link to the first lost a frame, or a trip it handed on never came round) raises
  it with ``ring`` set: the caller goes on through itself, blaming nobody.
* :class:`~sangama_p2p.errors.StageError` (with ``code`` and ``peer``) - a stage refused the request (capacity,
  wrong model, bad position...).
* :class:`NonFiniteHidden` (a ``StageRefused`` with code ``NON_FINITE``) - a stage refused hidden states holding NaN
  or Inf; ``producer`` is the stage before it, which computed them (the transport tries once without it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import trio

from .. import clock
from ..errors import ChainBroken, ErrorCode, NonFiniteHidden, SangamaError, StageRefused
from ..net.stage_stream import describe_stage_stream
from ..positions import is_decode_step, ring_next, step_guesses
from ..wire.messages import CloseSession, ErrorMessage, OpenSession, SessionOpened, Step, StepResult
from .links import Delivery, Link, LinkLost, LinkPool
from .routing import RouteCandidate

__all__ = ["ChainBroken", "ChainSession", "NonFiniteHidden", "SessionParams", "StageRefused", "check_result"]


def check_result(res: StepResult, sent: Sequence[int], n_guesses: int, peer: str) -> None:
    """A last stage's answer must keep a prefix of the guesses it was sent, plus exactly one new token, and as many
    next guesses as the session allows at most; anything else is a misbehaving peer (raises ChainBroken)."""
    guesses = step_guesses(sent, n_guesses)
    k = len(res.tokens) - 1
    if not 0 <= k <= n_guesses or tuple(res.tokens[:k]) != guesses[:k]:
        raise ChainBroken(f"{peer} answered tokens {list(res.tokens)} for guesses {list(guesses)}",
                          misbehaving=frozenset({peer}))


# codes meaning "this peer cannot serve the session right now" (another peer might)
RETRYABLE = frozenset({ErrorCode.CAPACITY, ErrorCode.OVERLOADED, ErrorCode.WRONG_MODEL, ErrorCode.INTERNAL})


@dataclass(frozen=True)
class SessionParams:
    """What every stage of a chain is told when the session opens."""

    model_id: str
    client_id: str
    max_length: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_guesses: int = 0
    adaptive_guesses: bool = False
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's and its n best alternatives'
    # the last stage samples only what this grammar (llguidance's JSON form) allows from position grammar_start on
    grammar: str | None = None
    grammar_start: int = 0
    # the ring (0: none): the last stage hands each next trip of a step sent with ``ring`` on to the first stage
    # itself while the new token's position + 1 < ring_until (the prompt + the most new tokens) and no answered
    # token is in ring_stop; the first stage echoes each to the client (what enters the chain)
    ring_until: int = 0
    ring_stop: tuple[int, ...] = ()
    windows: int = 1  # guess windows the ring may have in flight (the last stage drafts ahead; greedy, fixed guesses)


class ChainSession:
    """One session on one route. ``await open()``, then ``await step(...)`` per trip, then ``await close()``."""

    def __init__(self, pool: LinkPool, route: Sequence[RouteCandidate], params: SessionParams, *,
                 open_timeout: float, step_timeout: float, stall_factor: float = 0.0,
                 stall_floor: float = 1.0) -> None:
        self.pool = pool
        self.route = list(route)
        self.params = params
        self.session_id = os.urandom(16)
        self.open_timeout = open_timeout
        self.step_timeout = step_timeout
        self.stall_factor = stall_factor
        self.stall_floor = stall_floor
        self.decode_trip_s: float | None = None  # smoothed decode trip time on this route
        self._decode_trips = 0
        self.links: list[Link] = []
        self.fingerprint: str | None = None  # the checkpoint fingerprint the route was chosen for
        self._send, self._recv = trio.open_memory_channel[Delivery](math.inf)
        # the ring: the trip its last stage hands on next, the first stage's echoes of what it was handed (by step
        # number), and when the last answer came
        self.ring_trip: tuple[int, tuple[int, ...], tuple[int, ...]] | None = None  # (start, tokens, guesses)
        self._echoes: dict[int, Step] = {}
        self._answered_at = 0.0
        self._last_answer = -1  # the step number of the last answer taken
        self._answers: dict[int, StepResult] = {}  # answers that came in before their trip was asked for
        self._ring_stop = frozenset(params.ring_stop)

    @property
    def peers(self) -> list[str]:
        return [o.peer_id for o in self.route]

    async def open(self) -> None:
        """Open the session on every stage (concurrently); raise ChainBroken or StageRefused on failure."""
        p = self.params
        links: list[Link | None] = [None] * len(self.route)

        async def connect(i: int, offer: RouteCandidate) -> None:
            try:
                links[i] = await self.pool.get(offer.peer_id, offer.addrs)
            except SangamaError as exc:
                raise ChainBroken(f"cannot reach {offer.peer_id}: {exc}") from exc

        with trio.move_on_after(self.open_timeout) as scope:
            await _gather([lambda i=i, o=o: connect(i, o) for i, o in enumerate(self.route)])
        if scope.cancelled_caught:
            slow = sorted(o.peer_id for o, link in zip(self.route, links) if link is None)
            raise ChainBroken(f"connecting took over {self.open_timeout} s (not reached: {', '.join(slow)})")
        self.links = [link for link in links if link is not None]
        for link in self.links:
            link.subscribe(self.session_id, self._send)
        for i, (offer, link) in enumerate(zip(self.route, self.links)):
            nxt = self.route[i + 1].peer_id if i + 1 < len(self.route) else None
            prev = self.route[i - 1].peer_id if i else None
            ring = None  # the first stage hears from the last, the last hands on to the first
            if p.ring_until and (nxt is None or prev is None):
                ring = self.route[0 if nxt is None else -1].peer_id
            last = nxt is None
            msg = OpenSession(self.session_id, p.model_id, offer.start, offer.end, nxt, prev, p.client_id,
                              p.max_length, float(p.temperature), float(p.top_p), p.seed, p.max_guesses,
                              p.adaptive_guesses, p.top_logprobs, p.grammar if last else None,
                              p.grammar_start if last else 0, self.fingerprint or None, ring,
                              p.ring_until if last and ring else 0, p.ring_stop if last and ring else (),
                              p.windows if p.ring_until else 1)
            await self._send_to(link, msg)
        waiting = set(self.peers)
        with trio.move_on_after(self.open_timeout):
            while waiting:
                peer, msg = await self._recv.receive()
                if isinstance(msg, SessionOpened):
                    waiting.discard(peer)
                else:
                    self._fail(peer, msg)
        if waiting:
            raise ChainBroken(f"no answer to OpenSession from {sorted(waiting)}")

    async def step(self, step: int, start: int, token_ids: Sequence[int], n_guesses: int,
                   ring: bool = False) -> tuple[StepResult, float]:
        """One trip; returns the last stage's result and the trip time in seconds on this clock. ``ring``: the last
        stage hands the trip after this one on to the first stage itself (the session's ``ring_until`` must be set);
        that trip, and each after it, is then only waited for here - it must be the very one the ring hands on (the
        generation loop's next trip). The last stage numbers the trips it hands on (past any window it drafted ahead
        that did not stand), so such a trip's answer is the first one numbered past the last answer, and it is taken
        once the first stage's echo of that number shows the trip the answers lead to."""
        guesses = step_guesses(token_ids, n_guesses)
        want = (start, tuple(token_ids), guesses)
        handed, self.ring_trip = self.ring_trip, None
        if handed is not None and handed != want:
            raise ChainBroken(f"trip {step} is not the one the ring hands on (from {handed[0]}): the session cannot "
                              "take it")
        ring = ring or handed is not None  # a trip the ring handed on is one too: the ring goes on after it
        hand_on = ring and len(self.route) > 1  # the last stage sends on to the first: a link the client cannot see
        if handed is None:
            t0 = clock.now()
            await self._send_to(self.links[0], Step(self.session_id, step, start, tuple(token_ids), None, guesses,
                                                    (), ring=ring))
        else:
            t0 = self._answered_at  # the ring went on when the last answer left the last stage
        after = self._last_answer  # a handed-on trip's answer is numbered past this
        decode = is_decode_step(len(token_ids), n_guesses)
        limit = self.trip_deadline(decode)
        got_result: StepResult | None = None
        with trio.move_on_after(limit):
            while True:
                if got_result is None and (got_result := self._take_answer(step if handed is None else None, after)):
                    self._check(got_result, token_ids, n_guesses)
                if got_result is not None and (handed is None or got_result.step in self._echoes):
                    if handed is not None:
                        self._echoed(got_result.step, want)
                    return self._answered(got_result, start, token_ids, n_guesses, ring, decode, t0)
                peer, got = await self._recv.receive()
                if isinstance(got, Step) and got.ring and peer == self.route[0].peer_id:
                    if got.step > after:
                        self._echoes[got.step] = got
                    continue
                if isinstance(got, StepResult):
                    if peer != self.route[-1].peer_id:
                        raise ChainBroken(f"{peer} is not the last stage but answered a step",
                                          misbehaving=frozenset({peer}))
                    if got.step > after:  # (the ring may run ahead of what was read: later answers wait here)
                        self._answers[got.step] = got
                    continue  # else a late answer to an earlier trip
                if isinstance(got, ErrorMessage) and got.step is not None and (
                        got.step != step if handed is None else got.step <= after):
                    continue  # about an earlier trip
                self._fail(peer, got, hand_on)
        if got_result is not None:  # the hand-on never reached the first stage, or its echo never reached us
            raise ChainBroken(f"the first stage {self.route[0].peer_id} did not show trip {got_result.step}, which "
                              f"the ring handed on, in {limit:.2f} s", ring=True)
        if handed is not None:  # a trip the ring handed on, never answered: its link may have died silently, or a
            # stage swallowed it (a black hole): the ring goes off, and the chain is avoided where another exists
            raise ChainBroken(f"trip {step}, which the ring handed on, was not answered in {limit:.2f} s", ring=True,
                              stalled=frozenset(self.peers))
        if limit < self.step_timeout:
            raise ChainBroken(f"trip {step} stalled: no answer in {limit:.2f} s (decode trips take "
                              f"{self.decode_trip_s:.3f} s here)", stalled=frozenset(self.peers))
        raise ChainBroken(f"trip {step} took over {self.step_timeout} s")

    def _take_answer(self, number: int | None, after: int) -> StepResult | None:
        """The answer numbered ``number`` that came in (None: the first one numbered past ``after``, a trip the
        ring handed on), if it did; answers up to ``after`` are forgotten."""
        for old in [n for n in self._answers if n <= after]:
            del self._answers[old]
        if number is None:
            number = min(self._answers, default=None)  # type: ignore[arg-type]
        return self._answers.pop(number, None) if number is not None else None

    def _check(self, got: StepResult, token_ids: Sequence[int], n_guesses: int) -> None:
        """The last stage's answer must be one its trip allows (raises ChainBroken; that the last stage sent it is
        checked as it comes in)."""
        peer = self.route[-1].peer_id
        check_result(got, token_ids, n_guesses, peer)
        if self.params.top_logprobs is not None and (
                len(got.logprobs) != len(got.tokens) or any(
                    len(s.top_ids) != self.params.top_logprobs for s in got.logprobs)):
            raise ChainBroken(f"{peer} answered without the {self.params.top_logprobs} logprobs asked for",
                              misbehaving=frozenset({peer}))
        if len(got.guesses) > self.params.max_guesses:
            raise ChainBroken(f"{peer} drafted {len(got.guesses)} guesses", misbehaving=frozenset({peer}))

    def _echoed(self, number: int, want: tuple[int, tuple[int, ...], tuple[int, ...]]) -> None:
        """The first stage's echo of trip ``number``, handed on by the ring, must be the trip the loop wants: else
        the last stage handed on another (or the first stage says so falsely) - both are left out."""
        got = self._echoes.pop(number)
        for old in [n for n in self._echoes if n < number]:
            del self._echoes[old]
        if (got.start_pos, got.token_ids, got.guesses) != want:
            first, last = self.route[0].peer_id, self.route[-1].peer_id
            raise ChainBroken(f"the ring handed on tokens {list(got.token_ids)} from {got.start_pos} as trip {number} "
                              f"where the answers lead to {list(want[1])} from {want[0]} ({last} handed it on to "
                              f"{first})", misbehaving=frozenset({first, last}))

    def _answered(self, got: StepResult, start: int, token_ids: Sequence[int], n_guesses: int, ring: bool,
                  decode: bool, t0: float) -> tuple[StepResult, float]:
        """A trip's checked answer: its time, and the trip the ring hands on after it (if any)."""
        now = clock.now()
        trip_s, self._answered_at, self._last_answer = now - t0, now, got.step
        if decode:
            self._decode_trips += 1
            old = self.decode_trip_s
            self.decode_trip_s = trip_s if old is None else 0.7 * old + 0.3 * trip_s
        p = self.params
        if ring:
            nxt = ring_next(start, len(token_ids), n_guesses, got.tokens, got.guesses, p.ring_until,
                            self._ring_stop)
            if nxt is not None:
                self.ring_trip = (nxt[0], nxt[1], tuple(got.guesses))
        return got, trip_s

    def link_kinds(self) -> list[str]:
        """What carries the stream to each stage of the route, in order (``net.stage_stream.describe_stage_stream``:
        ``lane``, ``direct``, ``relayed via <id>``, with the hole-punch moves)."""
        return [describe_stage_stream(link.fs) for link in self.links]

    def trip_deadline(self, decode: bool) -> float:
        """How long a trip may take before it counts as failed: ``stall_factor`` x the smoothed decode trip time
        for a decode trip once three were measured (at least ``stall_floor``), else ``step_timeout``."""
        if not decode or not self.stall_factor or self._decode_trips < 3 or self.decode_trip_s is None:
            return self.step_timeout
        return min(self.step_timeout, max(self.stall_floor, self.stall_factor * self.decode_trip_s))

    def _fail(self, peer: str, msg: object, hand_on: bool = False) -> None:
        """Raise what a message other than the trip's answer means; ``hand_on``: the ring is closed on a chain of
        several stages, so the last stage sends on to the first."""
        if isinstance(msg, LinkLost):
            raise ChainBroken(f"stream to {peer} ended: {msg.reason}")
        if isinstance(msg, ErrorMessage):
            # INTERNAL: e.g. its next hop died; OVERLOADED: its next hop takes no frames; EXPIRED: idle too long.
            # Each: probe the chain, re-route, replay. A ring's last stage has one hop to send on, the ring's
            # first stage: its INTERNAL or OVERLOADED may be that link (or its own compute failing, which the
            # trips through the client then show as any failure)
            if msg.code in (ErrorCode.INTERNAL, ErrorCode.OVERLOADED, ErrorCode.EXPIRED):
                ring = hand_on and msg.code != ErrorCode.EXPIRED and peer == self.route[-1].peer_id
                raise ChainBroken(f"{peer}: {msg.code.name}: {msg.message}", ring=ring)
            if msg.code == ErrorCode.NON_FINITE:
                at = self.peers.index(peer) if peer in self.peers else 0
                producer = self.peers[at - 1] if at else None
                raise NonFiniteHidden(f"{peer} refused the hidden states of {producer}: {msg.message}", peer, producer)
            raise StageRefused(f"{peer} refused: {msg.code.name}: {msg.message}", msg.code, peer)
        raise StageRefused(f"{peer} sent an unexpected {type(msg).__name__}", ErrorCode.BAD_FRAME, peer)

    async def _send_to(self, link: Link, msg: object) -> None:
        try:
            await link.send(msg)  # type: ignore[arg-type]
        except SangamaError as exc:
            raise ChainBroken(f"cannot send to {link.peer}: {exc}") from exc

    async def close(self) -> None:
        """Free the session on every stage still reachable; never raises."""
        links, self.links = self.links, []
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            for link in links:
                link.unsubscribe(self.session_id)
                if link.lost is None:
                    try:
                        await link.send(CloseSession(self.session_id))
                    except SangamaError:
                        pass
        self._send.close()


async def _gather(thunks: list) -> None:
    """Run the coroutine factories concurrently; the first failure cancels the rest and propagates unwrapped."""
    errors: list[BaseException] = []

    async def run(thunk) -> None:  # noqa: ANN001
        try:
            await thunk()
        except SangamaError as exc:
            errors.append(exc)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for t in thunks:
            nursery.start_soon(run, t)
    if errors:
        raise errors[0]
