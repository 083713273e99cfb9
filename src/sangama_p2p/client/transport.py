"""The generation loop's transport over the network: one request's trips on its chain session, with failover.

:class:`~sangama_p2p.generation.GenerationLoop` decides what each trip carries and what its answer does;
:class:`ChainTransport` carries it (``await transport.run(trips)``) and owns everything that is the network's
concern: opening the chain (an ``auto`` request asks for fewer guesses where a stage allows fewer), each trip's
timing and route, and failover. When a trip cannot finish (:class:`~sangama_p2p.client.session.ChainBroken`), it
probes the chain, excludes the dead peers (or avoids the stalled chain's peers where a route without them exists),
opens the session on a new chain of the same checkpoint fingerprint, and answers ``None``: the loop then replays
every answered trip in its original shape (``generation.Generation.finish``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import trio

from ..errors import ErrorCode, RouteError
from ..generation import Answer, GenerationResult, Rewind, Trip
from ..positions import session_length
from ..wire.limits import MAX_RING_STOP
from .config import ClientConfig
from .routing import RouteCandidate, hop_latencies
from .session import ChainBroken, ChainSession, NonFiniteHidden, SessionParams, StageRefused
from .timing import trip_timing
from .verifier import TripVerifier, Verification

if TYPE_CHECKING:
    from ..net.discovery import SurveyFacts

__all__ = ["ChainOpener", "ChainTransport"]

log = logging.getLogger(__name__)


class ChainOpener(Protocol):
    """What the transport needs from its client (``ChainClient``): routing and opening chains, probing peers."""

    config: ClientConfig
    peer_id: str
    active: dict[int, ChainSession]
    verification: Verification
    offers: Sequence[RouteCandidate]  # the last survey's candidates
    survey_facts: SurveyFacts  # what it found on its way (records, of which ``offers`` answered)

    async def open_chain(self, params: SessionParams, exclude: set[str], max_age: float, pin: str | None = None,
                         avoid: frozenset[str] = frozenset()) -> ChainSession: ...

    async def dead_peers(self, session: ChainSession) -> set[str]: ...


class ChainTransport:
    """One request's chain session; ``await ChainTransport.open(...)``, ``await run(trips)`` per trip, then
    ``await close()``."""

    def __init__(self, client: ChainOpener, result: GenerationResult, params: SessionParams,
                 session: ChainSession, exclude: set[str]) -> None:
        self.client = client
        self.result = result
        self.params = params
        self.session = session
        self.exclude = exclude  # peers left out of this request's routes (dead, misbehaving, refusing)
        self.avoid: frozenset[str] = frozenset()  # peers of chains that stalled, or that computed NaN/Inf
        self.non_finite_from: set[str] = set()  # peers whose hidden states a stage refused as NaN/Inf
        self.verify_reroutes = 0  # re-routes the verifier asked for (a lie caught, a trip not confirmed)
        self.ring_broke = False  # the ring's hand-on failed once: the request's trips go through the client
        self.sent: list[Trip] = []  # the trips the session was sent and answered, in order (a verifier replays them)
        # a fraction of trips re-run on a second chain of other peers (client/verifier.py); None: not verifying
        self.verifier: TripVerifier | None = client.verification.start(params)
        client.active[id(result)] = session

    @classmethod
    async def open(cls, client: ChainOpener, result: GenerationResult, max_new: int, temperature: float,
                   top_p: float, seed: int, max_guesses: int, adaptive: bool,
                   top_logprobs: int | None = None, grammar: str | None = None,
                   stop: Sequence[int] = ()) -> ChainTransport:
        """Route and open a session for ``result``'s request; raises RouteError or StageRefused. When no chain
        covers the model while some layer is served twice (the only peer of a range left and a spare may move there),
        it waits for one as a failover does (:meth:`_reopen`), if a recorded peer did not answer its probe."""
        config, prompt = client.config, result.prompt_ids
        exclude: set[str] = set()  # open_chain adds the peers it had to leave out
        deadline, max_age = trio.current_time() + config.recover_s, config.survey_max_age
        while True:
            params = SessionParams(config.model_id, client.peer_id,
                                   session_length(len(prompt), max_new, max_guesses),
                                   temperature, top_p, seed, max_guesses, adaptive, top_logprobs, grammar,
                                   len(prompt) if grammar is not None else 0,
                                   len(prompt) + max_new if config.rings else 0, tuple(stop)[:MAX_RING_STOP],
                                   config.windows if max_guesses else 1)
            try:
                session = await client.open_chain(params, exclude, max_age)
                return cls(client, result, params, session, exclude)
            except StageRefused as exc:
                if exc.code == ErrorCode.TOO_MANY_GUESSES and adaptive and max_guesses:
                    # auto: as many guesses as pay, so fewer where a stage allows fewer (or none: no MTP layer)
                    log.info("%s refused %d guesses (%s); auto tries %d", exc.peer, max_guesses, exc,
                             max_guesses // 2)
                    max_guesses //= 2
                    adaptive = bool(max_guesses)
                    continue
                if exc.code == ErrorCode.CAPACITY:
                    raise StageRefused(
                        f"{exc} (this generation needs {params.max_length} positions on every stage: a prompt of "
                        f"{len(prompt)} tokens + {max_new} new tokens + {max_guesses} guesses + 1)", exc.code,
                        exc.peer) from exc
                raise
            except RouteError as exc:
                # only after a leave, a recorded peer that did not answer (the depth liars' test: every peer
                # answered, the chain was refused for their claims, and nobody will move)
                facts = client.survey_facts  # (an enumeration finds no record of a dead public peer: a provider)
                left = max(facts.records, facts.providers) > len(client.offers)
                if not (left and _may_be_covered(client, exclude, exc, deadline)):
                    raise
                log.info("no chain yet (%s): surveying again in %g s", exc, config.recover_every_s)
                await trio.sleep(config.recover_every_s)
                max_age = 0.0  # a fresh survey: the move shows in the mover's new record

    async def run(self, trips: Sequence[Trip]) -> list[Answer | Rewind | None]:
        """Carry the request's trip (one request per transport); ``[None]`` after a failover, ``[Rewind]`` after one
        that a verifier's catch caused."""
        (trip,) = trips
        try:
            ring = self.params.ring_until > 0 and not trip.chunk and not trip.replay
            res, trip_s = await self.session.step(trip.number, trip.start, trip.tokens, trip.n_guesses, ring)
            if self.verifier is not None and not trip.chunk and not trip.replay:  # raises ChainBroken at a liar
                await self.verifier.check(self.session, trip.start, trip.tokens, trip.n_guesses, res.tokens,
                                          self.result.prompt_ids, self.result.tokens, self.sent)
            self.sent.append(trip)
        except ChainBroken as exc:
            if exc.ring and self.params.ring_until:
                self._ring_off(trip, exc)
                await self._fail_over(trip, exc, set(), exc.stalled)  # nobody blamed: no probe, nobody left out
                return [None]
            bad = set(exc.misbehaving) | await self.client.dead_peers(self.session)
            await self._fail_over(trip, exc, bad, exc.stalled, verifying=exc.keep is not None)
            return [None if exc.keep is None else Rewind(exc.keep)]  # a verifier's catch: back to its tokens
        except NonFiniteHidden as exc:
            await self._fail_over(trip, exc, set(), self._non_finite(exc))
            return [None]
        if not trip.chunk:
            self.result.route = self.session.peers
        emitted = 0 if trip.chunk or trip.replay else len(res.tokens)
        self.result.trips.append(trip_timing(trip.number, len(trip.tokens), emitted, trip_s, res.trace))
        return [Answer(tuple(res.tokens), tuple(res.guesses), res.logprobs)]

    def _non_finite(self, exc: NonFiniteHidden) -> frozenset[str]:
        """Hidden states with NaN or Inf: the first time, the peer that computed them may be at fault (a broken
        device, a bad copy of the weights), so the next chain avoids it where a route without it exists. The second
        time - another peer computed the same, or none other could be tried - the input itself is the cause, which
        no other peer changes: raise, with what was tried."""
        producer, seen = exc.producer, self.non_finite_from
        if producer is None or seen:
            tried = sorted(seen | {producer} if producer is not None else seen)
            others = "another peer" if len(tried) > 1 else "no other peer could be tried, and it"
            raise NonFiniteHidden(
                f"the model's hidden states hold NaN or Inf for this input (computed by {', '.join(tried) or '?'}; "
                f"{others} gave the same): not retried; {exc}", exc.peer, producer) from exc
        seen.add(producer)
        return frozenset({producer})

    def _ring_off(self, trip: Trip, exc: ChainBroken) -> None:
        """The ring's hand-on failed (the last stage's link to the first stage, which the client cannot probe: a
        relayed link whose relay restarted, a hole not punched yet): the rest of the request goes through the client.
        The failover that follows blames nobody, so its chain may be the same one (a trip handed on that was never
        answered avoids the chain's peers where a route without them exists, as a stall does: a black hole and a dead
        ring link look alike), and it is not counted against ``max_failovers``: the ring goes off once a request."""
        log.info("the ring of chain %s broke at trip %d (%s): the trips go through the client from here",
                 self.session.peers, trip.number, exc)
        self.ring_broke = True
        self.params = dataclasses.replace(self.params, ring_until=0, ring_stop=(), windows=1)

    async def _fail_over(self, trip: Trip, exc: Exception, bad: set[str], stalled: frozenset[str], *,
                         verifying: bool = False) -> None:
        """Re-route around ``bad`` (excluded) or, when nobody is known bad, around ``stalled`` (avoided where a
        route without them exists), on a chain of the same fingerprint; the loop then replays. ``verifying``: the
        verifier caught a lie or could not confirm a trip (counted against ``max_verify_reroutes``, not
        ``max_failovers``: under attack each catch is progress, and the liars boasting the best chain come one by
        one)."""
        client, config, result, session = self.client, self.client.config, self.result, self.session
        log.info("chain %s broke at trip %d: %s", session.peers, trip.number, exc)
        result.failovers += 1
        self.verify_reroutes += verifying
        await session.close()
        if verifying and self.verify_reroutes > config.max_verify_reroutes:
            raise RouteError(f"gave up after {self.verify_reroutes - 1} re-routes for verification: {exc}") from exc
        if result.failovers - self.verify_reroutes - self.ring_broke > config.max_failovers:
            raise RouteError(f"gave up after {result.failovers - 1} re-routes: {exc}") from exc
        self.exclude |= bad
        if not bad:  # every peer answers its probe, yet the trip stalled: route around them if we can
            self.avoid |= stalled
        try:
            self.session, self.sent = await self._reopen(session.fingerprint), []
        except RouteError as route_exc:
            if type(route_exc) is not RouteError:
                raise
            raise RouteError(f"the chain broke at trip {trip.number} ({exc}), and no chain to go on with was found: "
                             f"{route_exc}") from route_exc
        client.active[id(result)] = self.session

    async def _reopen(self, fingerprint: str | None) -> ChainSession:
        """A chain for the rest of the generation; when none covers the model while some layer is served twice (a
        spare that may move to the range that was left), survey again every ``recover_every_s`` until one does or
        ``recover_s`` passed."""
        client, config = self.client, self.client.config
        deadline = trio.current_time() + config.recover_s
        while True:
            try:
                return await client.open_chain(self.params, self.exclude, 0.0 if config.rediscover else math.inf,
                                               pin=fingerprint, avoid=self.avoid)
            except RouteError as exc:
                if not _may_be_covered(client, self.exclude, exc, deadline):
                    raise  # nobody could move to the range that was left: say so at once
                log.info("no chain to continue on (%s): surveying again in %g s", exc, config.recover_every_s)
                await trio.sleep(config.recover_every_s)

    async def close(self) -> None:
        self.client.active.pop(id(self.result), None)
        if self.result.route:  # what carried each hop at the end (read once, not per trip)
            self.result.links = self.session.link_kinds()
            self.result.hops = [{"from": a, "to": b, "ms": round(1e3 * t, 3), "measured": m}
                                for a, b, t, m in hop_latencies(self.session.route, self.client.offers)]
        if self.verifier is not None:  # what verification checked, said with the result
            self.result.verified_trips = self.verifier.trips_verified
            self.result.unverified_trips = self.verifier.trips_unverified
        try:
            if self.verifier is not None:
                await self.verifier.aclose()
        finally:
            await self.session.close()


def _may_be_covered(client: ChainOpener, exclude: set[str], exc: RouteError, deadline: float) -> bool:
    """Whether a request that found no chain (``exc``, a plain RouteError) should survey again: time is left before
    ``deadline`` and some layer is served twice among the live peers, so a spare may move into the gap."""
    live = [o for o in client.offers if o.peer_id not in exclude]
    return (type(exc) is RouteError and trio.current_time() + client.config.recover_every_s <= deadline
            and _has_spare(live))


def _has_spare(offers: Sequence[RouteCandidate]) -> bool:
    """Whether two of ``offers`` overlap: some layer is served twice, so a peer could leave it for a gap."""
    spans = sorted((o.start, o.end) for o in offers)
    return any(b[0] < a[1] for a, b in zip(spans, spans[1:]))
