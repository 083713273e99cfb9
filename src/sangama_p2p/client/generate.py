"""``ChainClient``: generate tokens through a chain of stage peers found in the DHT.

Usage (trio; ``node`` from :func:`sangama_p2p.net.open_host`)::

    from sangama_p2p.client import ChainClient, ClientConfig

    async with ChainClient(node, ClientConfig(model_id="org/model")) as client:
        result = await client.generate(prompt_ids, max_new_tokens=64, temperature=0.0, guesses="auto",
                                       stop_tokens=spec.eos_token_ids)
        result.tokens                 # new token ids (equal to LocalChain's for the same model, split and settings)
        result.trips                  # [TripTiming]: per trip, each stage's queue/compute/send and the network
        summarize_trips(result.trips) # "where the time goes", mean ms per trip
        async for token in client.stream(prompt_ids, 64):   # tokens as soon as each trip returns
            ...

What ``generate`` does: find the peers serving ``model_id`` (DHT), measure each one's RTT with an
``/sangama/info/2`` round trip (which also brings its fresh throughput and queue), pick the cheapest chain
(:func:`~sangama_p2p.client.routing.plan_route`) among the peers of one checkpoint fingerprint
(:func:`~sangama_p2p.net.lineup.choose_lineup`: the model's depth comes from that checkpoint's config, and peers of
other checkpoints under the same model id are left out with a log line), open a session on every stage, then run
trips: STEP to the first stage, which forwards hidden states stage to stage; the last stage checks the guesses, samples, drafts new guesses
and answers the client directly. ``guesses`` is a fixed count (0..8) or ``"auto"`` (adaptive, up to 6). When a
stage fails (stream reset, peer gone, timeout), the client probes the chain, re-routes around the dead peers and
replays the prompt plus the tokens produced so far to the new chain, so the generation completes with the same
tokens (exactly so for greedy decoding).

Many ``generate`` calls may run concurrently on one client: they share one long-lived stream per stage peer, and
the stages batch their steps. A node that also serves a stage passes ``local_stage=server.open_local_stream`` so its
own stage can be part of its chains (libp2p cannot dial itself).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import trio

from ..errors import ModelError, NetworkError, RouteError, SangamaError, TokensRetracted
from ..generation import Generation, GenerationLoop, GenerationResult
from ..guesses import AUTO_MAX_GUESSES, MAX_GUESSES, parse_guesses
from ..net.directory import PER_RANGE
from ..net.discovery import SurveyFacts, find_serving_peers
from ..net.lineup import choose_lineup
from ..net.seam import Network
from .config import ClientConfig
from .links import LinkPool
from .probes import ProbeMemory, ProbeRound, probe_peer
from .routing import RouteCandidate, plan_route
from .session import RETRYABLE, ChainBroken, ChainSession, SessionParams, StageRefused
from .stats import ClientStats
from .timing import summarize_trips
from .transport import ChainTransport
from .verifier import Verification

__all__ = ["AUTO_MAX_GUESSES", "MAX_GUESSES", "ChainClient", "GenerationResult", "parse_guesses"]

log = logging.getLogger(__name__)



class ChainClient:
    """Drives generations through the swarm; an ``async with`` object owning its links' tasks (see module doc)."""

    def __init__(self, node: Network, config: ClientConfig, *,
                 local_stage: Callable[[], Awaitable[Any]] | None = None) -> None:
        """``local_stage``: for a node that also serves a stage, the server's ``open_local_stream`` (its own stage
        can then be part of a chain; without it the node's own peer id is left out of surveys)."""
        self.node = node
        self.config = config
        self.local_stage = local_stage
        self.peer_id: str = node.peer_id.to_base58()
        self.pool: LinkPool | None = None
        self._nursery_cm: Any = None
        self.offers: list[RouteCandidate] = []  # the last survey
        self.survey_facts = SurveyFacts()  # what the last survey found on its way (for errors that name a cause)
        self.surveyed_at = -math.inf  # trio clock time of the last survey
        self.probes = ProbeMemory()  # peers that did not answer their probes, or late
        self._survey_lock = trio.Lock()
        self.left_out: dict[str, Any] = {}  # peer id -> net.lineup.LeftOut, from the last routing decision
        self._reported: set[tuple[str, str]] = set()  # (peer, reason) already logged
        self.active: dict[int, ChainSession] = {}  # the chain session of each running generation
        self.verification = Verification.for_client(self)  # re-run trips, ban liars (client/verifier.py)
        self.stats = ClientStats()  # its generations' counters (the API's /metrics)

    async def __aenter__(self) -> ChainClient:
        self._nursery_cm = trio.open_nursery()
        nursery = await self._nursery_cm.__aenter__()
        self.pool = LinkPool(self.node, nursery, max_frame=self.config.max_frame,
                             connect_timeout=self.config.open_timeout, local_stage=self.local_stage,
                             lanes=self.config.lanes, lane_timeout=self.config.lane_timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        pool, cm = self.pool, self._nursery_cm
        if pool is None:
            return
        self.pool = None
        await pool.aclose()
        pool.nursery.cancel_scope.cancel()
        # the nursery is told nothing of the block's own exception, so it propagates as itself (``except
        # RouteError`` around ``async with ChainClient(...)`` catches it) instead of inside an ExceptionGroup
        await cm.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close every stream this client opened (its sessions are freed by the stages)."""
        await self.__aexit__(None, None, None)

    @property
    def routes(self) -> list[list[str]]:
        """The chains (peer ids in order) of the generations running now (for status displays and tests)."""
        return [s.peers for s in self.active.values()]

    def _pool(self) -> LinkPool:
        if self.pool is None:
            raise NetworkError("use the ChainClient inside `async with`")
        return self.pool

    # ---- discovery and routing -----------------------------------------------------------------------------
    async def survey(self, exclude: frozenset[str] = frozenset(), *, max_age: float = 0.0,
                     retry_slow: bool = False) -> list[RouteCandidate]:
        """The peers serving ``model_id`` as :class:`~sangama_p2p.client.routing.RouteCandidate` (DHT records refreshed
        with each peer's own ``/sangama/info/2`` figures, and the RTT measured over the stage stream).

        A survey younger than ``max_age`` seconds is re-used; concurrent callers share one survey in flight. A peer
        that refused or failed its probe is skipped until it publishes a newer record; one whose probe only timed
        out (alive but busy, as on a loaded machine) is skipped for :data:`~.probes.SLOW_RETRY_S`, or not at all with
        ``retry_slow`` (a caller that found no route, or no second chain, without it), and is then given
        :data:`SLOW_PROBE_FACTOR` x the probe's time (a stage under a flood answers, only late: in the liar soak the
        honest stages' probes timed out and every route was the liars').
        """
        started = trio.current_time()
        async with self._survey_lock:
            if self.surveyed_at > -math.inf and self.surveyed_at >= started - max_age:
                return [o for o in self.offers if o.peer_id not in exclude]
            return await self._survey(exclude, retry_slow)

    async def _survey(self, exclude: frozenset[str], retry_slow: bool) -> list[RouteCandidate]:
        pool, probes = self._pool(), self.probes
        facts = SurveyFacts()
        # peers silent or late to their last probe are not candidates; providers whose record no DHT server gave
        # (a survey that enumerates them) are asked for it themselves: this survey dials them next anyway
        records = await find_serving_peers(
            self.node, self.config.model_id, include_self=self.local_stage is not None, facts=facts,
            usable=lambda rec: probes.usable(rec, retry_slow), num_layers=self.config.num_layers or 0,
            # a caller that found no route: twice the candidates a range (the walk's, never every provider: a gap
            # nobody serves would make every client's retries dial the whole swarm)
            walk=self.config.walk, per_range=2 * PER_RANGE if retry_slow else PER_RANGE,
            ask_authors=lambda peer: peer not in probes.silent and (retry_slow or not probes.still_slow(peer)))
        self.survey_facts = facts
        probes.seen(records)
        # excluded peers are probed too: the survey is shared by later generations, the exclusion is this one's (a
        # peer that refused a too-long session was missing from every route for survey_max_age)
        usable = [rec for rec in records if probes.usable(rec, retry_slow)]
        round_ = ProbeRound(left=len(usable))
        surveyed: list[RouteCandidate] = []

        async def probe(rec: Any) -> None:
            try:
                await probe_peer(pool, rec, round_.offers, facts, probes, self.config.model_id, self._probe_s)
            finally:
                round_.ended()
                if round_.settled and self.offers is surveyed:  # a late answer joins the survey it belongs to
                    surveyed[:] = round_.sorted()

        for rec in usable:  # in the client's nursery: those still out when the survey settles answer into it later
            pool.nursery.start_soon(probe, rec)
        grace = await round_.settle(self.config.num_layers or max((r.end for r in records), default=0),
                                    wait_all=retry_slow)
        if grace is not None:
            log.info("survey of %s settled after %.2f s with %d of %d peers answered (the rest answer into it)",
                     self.config.model_id, grace, len(round_.offers), len(usable))
        surveyed[:] = round_.sorted()
        self.offers = surveyed
        self.surveyed_at = trio.current_time()
        return [o for o in self.offers if o.peer_id not in exclude]

    @property
    def _probe_s(self) -> float:
        """A probe's time: ``probe_timeout`` for the answer, plus ``lane_timeout`` when a new link first tries a lane
        (a lane port that never answers, or one crowded by idle connections, fails only after it; then the libp2p
        stream is opened): else such a peer counts as silent although its libp2p stream answers at once."""
        return self.config.probe_timeout + (self.config.lane_timeout if self.config.lanes else 0.0)

    @property
    def late_peers(self) -> int:  # how many peers are skipped for now because their last probe was late
        return self.probes.late_peers

    def _lineup(self, offers: Sequence[RouteCandidate], pin: str | None) -> Any:
        """The peers of one checkpoint fingerprint (``pin``, else the configured one, else the best group) and the
        model's depth from it; every peer left out is logged once per reason."""
        lineup = choose_lineup(offers, local_fingerprint=pin or self.config.fingerprint,
                               num_layers=self.config.num_layers)
        self.left_out = {o.peer_id: o for o in lineup.left_out}
        for o in lineup.left_out:
            if (o.peer_id, o.reason) not in self._reported:
                self._reported.add((o.peer_id, o.reason))
                log.warning("left out peer %s (layers %d:%d of %s): %s", o.peer_id, o.start, o.end,
                            self.config.model_id, o.reason)
        for c in lineup.conflicts:
            log.warning("peers of fingerprint %s disagree on the content of part %s: %s", lineup.fingerprint,
                        c.part, "; ".join(f"{h[:12]}: {', '.join(p)}" for h, p in c.hashes))
        return lineup

    def _route(self, offers: Sequence[RouteCandidate], exclude: set[str],
               pin: str | None) -> tuple[list[RouteCandidate], str]:
        lineup = self._lineup(offers, pin)
        left = "; ".join(f"{o.peer_id} {o.start}:{o.end}: {o.reason}" for o in lineup.left_out)
        if lineup.fingerprint is None:
            raise RouteError(f"no live peer serves {self.config.model_id!r}" + (f" (left out: {left})" if left else
                                                                                 self._why_nobody()))
        try:
            return plan_route(lineup.members, lineup.num_layers, exclude=exclude,
                              banned=self.verification.banned(offers)), lineup.fingerprint
        except RouteError as exc:
            if not left:
                raise
            raise RouteError(f"{exc} (left out: {left})") from exc

    def _why_nobody(self) -> str:
        """What the last survey saw, when it yielded no peer: no DHT server answered, no provider, no record, or
        records of peers that did not answer (gone, or only reachable over a relay that is gone)."""
        why = self.survey_facts.explain(self.config.model_id)
        if not why and self.survey_facts.records:
            why = (f"{self.survey_facts.records} peer(s) serve it by their records but none answered: they left, or "
                   "their links (or the relay they are reached through) are gone")
        return f": {why}" if why else ""

    async def open_chain(self, params: SessionParams, exclude: set[str], max_age: float,
                          pin: str | None = None, avoid: frozenset[str] = frozenset()) -> ChainSession:
        """Route (on a survey at most ``max_age`` old), open the session on every stage; re-route around peers
        that fail (on a fresh survey when ``config.rediscover``). A re-used survey that yields no route is taken
        again before this gives up (a peer that replaced a dead one may have joined since). ``pin``: chain only peers of this fingerprint
        (a generation's re-routes keep to the checkpoint it started on). ``avoid``: peers left out wherever a
        route without them exists (the peers of a chain that stalled: one of them swallowed the trip)."""
        tries = 0
        refused: StageRefused | None = None
        fresh_misses, retry_slow = 0, False
        while True:
            asked = trio.current_time()
            offers = await self.survey(frozenset(exclude), max_age=max_age, retry_slow=retry_slow)
            try:
                route, fingerprint = self._route(offers, exclude | self._avoidable(offers, exclude, pin, avoid), pin)
            except RouteError as exc:
                if refused is not None:  # the peers that could serve refused: say why, with their code
                    raise refused from exc
                if self.surveyed_at < asked:  # a re-used survey lacks peers that joined since it: ask once more
                    max_age = 0.0
                    continue
                if fresh_misses == 0:  # a fresh one can miss records too (DHT queries that timed out on a busy
                    fresh_misses, max_age = 1, 0.0  # machine: tests/stage/test_lane_flood.py once): once more,
                    retry_slow = True  # the peers whose probes were late asked again
                    continue
                if type(exc) is RouteError and self.survey_facts.records > len(offers):
                    raise RouteError(f"{exc}; the last survey found {self.survey_facts.records} records, of which "
                                     f"{len(offers)} peers answered their probes ({self.late_peers} late)") from exc
                raise
            session = ChainSession(self._pool(), route, params, open_timeout=self.config.open_timeout,
                                   step_timeout=self.config.step_timeout, stall_factor=self.config.stall_factor,
                                   stall_floor=self.config.stall_floor_s)
            session.fingerprint = fingerprint
            try:
                await session.open()
                return session
            except ChainBroken as exc:
                bad = set(exc.misbehaving) | await self.dead_peers(session)
                await session.close()
                if tries >= self.config.max_failovers:
                    raise RouteError(f"cannot open a chain: {exc}") from exc
                exclude |= bad
            except StageRefused as exc:
                await session.close()
                if exc.code not in RETRYABLE or tries >= self.config.max_failovers:
                    raise
                exclude.add(exc.peer)
                refused = exc
            tries += 1
            max_age = 0.0 if self.config.rediscover else math.inf

    def _avoidable(self, offers: Sequence[RouteCandidate], exclude: set[str], pin: str | None,
                   avoid: frozenset[str]) -> set[str]:
        """The largest part of ``avoid`` (taken peer by peer, in order) that still leaves a route."""
        keep: set[str] = set()
        for peer in sorted(avoid - exclude):
            try:
                self._route(offers, exclude | keep | {peer}, pin)
            except RouteError:
                continue
            keep.add(peer)
        return keep

    async def dead_peers(self, session: ChainSession) -> set[str]:
        """Probe every stage of ``session``'s route (over a fresh stream where the old one broke); those that do not
        answer within ``probe_timeout`` are dead. A peer whose stream broke but which answers is not excluded: the
        chain is re-opened and the trip replayed (a broken stream alone may be our own doing, e.g. a cancel)."""
        pool, dead = self._pool(), set()

        async def probe(offer: RouteCandidate) -> None:
            with trio.move_on_after(self._probe_s):
                try:
                    link = await pool.get(offer.peer_id, offer.addrs)
                    await link.probe()
                    return  # answered in time: alive
                except SangamaError:
                    pass
            dead.add(offer.peer_id)  # failed, or no answer in time
            self.probes.mark_silent(offer.peer_id)

        async with trio.open_nursery() as nursery:
            for offer in session.route:
                nursery.start_soon(probe, offer)
        return dead

    # ---- generation ----------------------------------------------------------------------------------------
    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        guesses: int | str = 0,
        stop_tokens: Sequence[int] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
        top_logprobs: int | None = None,
        grammar: str | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``; stop early at any of ``stop_tokens``.

        ``on_tokens`` is called with each trip's new tokens as soon as they arrive. Raises
        :class:`~sangama_p2p.errors.RouteError` when no chain covers the model (also after ``max_failovers``
        re-routes), :class:`~sangama_p2p.errors.StageError` (with its ``code``) when a stage refuses the request
        for a reason a re-route cannot fix (e.g. ``CAPACITY`` on every candidate, ``BAD_POSITION``).
        ``top_logprobs``: fill ``result.logprobs`` (one ``wire.TokenLogprobs`` per new token, with that many
        alternatives) from the last stage's float32 logits. ``grammar``: the last stage samples only tokens it
        allows (``model.constraint.json_grammar`` makes one of a JSON schema); such a generation drafts no guesses.
        """
        result = _network_result(prompt_ids)
        async for new in self._run(result, max_new_tokens, temperature, top_p, seed, guesses, stop_tokens,
                                   top_logprobs, grammar, streaming=on_tokens is not None):
            if on_tokens is not None:
                on_tokens(new)
        return result

    async def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> AsyncIterator[int]:
        """Like :meth:`generate`, yielding each new token id as soon as its trip returns.

        To stop early and free the chain's sessions at once (not when the generator is collected), iterate inside
        ``async with contextlib.aclosing(client.stream(...)) as tokens:``.
        """
        async for tok, _ in self.stream_scored(prompt_ids, max_new_tokens, None, **kwargs):
            yield tok

    async def stream_scored(self, prompt_ids: Sequence[int], max_new_tokens: int, top_logprobs: int | None,
                            **kwargs: Any) -> AsyncIterator[tuple[int, Any]]:
        """Like :meth:`stream`, yielding ``(token id, wire.TokenLogprobs)`` pairs: each token's log-probability
        and its ``top_logprobs`` best alternatives' (``None`` in place of them when ``top_logprobs`` is None)."""
        result = _network_result(prompt_ids)
        opts = {"temperature": 0.0, "top_p": 1.0, "seed": 0, "guesses": 0, "stop_tokens": (), "grammar": None}
        unknown = set(kwargs) - set(opts)
        if unknown:
            raise TypeError(f"unknown arguments {sorted(unknown)}")
        opts.update(kwargs)
        async for new in self._run(result, max_new_tokens, **opts,  # type: ignore[arg-type]
                                   top_logprobs=top_logprobs, streaming=True):
            scores = (result.logprobs[len(result.tokens) - len(new):] if top_logprobs is not None
                      else [None] * len(new))
            for tok, score in zip(new, scores):
                yield tok, score

    async def _run(self, result: GenerationResult, max_new: int, temperature: float, top_p: float, seed: int,
                   guesses: int | str, stop_tokens: Sequence[int],
                   top_logprobs: int | None = None, grammar: str | None = None,
                   streaming: bool = False) -> AsyncIterator[list[int]]:
        """The generation loop (``generation.GenerationLoop``) over this client's network transport, yielding each
        trip's new tokens. ``streaming``: the caller shows what it is yielded, so a verifier's catch that takes back
        tokens already yielded raises :class:`~sangama_p2p.errors.TokensRetracted` (else the generation goes on
        around the liar, and its result holds only right tokens)."""
        if not result.prompt_ids:
            raise ModelError("the prompt is empty")
        if max_new <= 0:
            return
        max_guesses, adaptive = parse_guesses(guesses)
        if grammar is not None:  # the grammar decides each token after the one before: nothing to guess ahead
            max_guesses, adaptive = 0, False
        try:
            transport = await ChainTransport.open(self, result, max_new, temperature, top_p, seed, max_guesses,
                                                  adaptive, top_logprobs, grammar, stop_tokens)
        except Exception:
            self.stats.add(result, failed=True)
            raise
        loop = GenerationLoop([Generation(result, max_new, stop_tokens, max_step_tokens=self.config.max_step_tokens)])
        failed = False
        try:
            yielded = 0
            while trips := loop.trips():
                for _, new in loop.finish(await transport.run(trips)):
                    yielded += len(new)
                    yield new
                if streaming and yielded > len(result.tokens):  # a Rewind took back tokens the caller has shown
                    kept = len(result.tokens)
                    raise TokensRetracted(
                        f"a peer of the chain was caught answering wrong tokens: of the {yielded} tokens streamed, "
                        f"the last {yielded - kept} are not confirmed (the first {kept} were verified); the stream "
                        "stops here rather than take them back (the peer is banned or avoided: see the log)",
                        kept, yielded - kept)
        except Exception:
            failed = True
            raise
        finally:
            try:
                await transport.close()
            finally:
                self.stats.add(result, failed=failed)


def _network_result(prompt_ids: Sequence[int]) -> GenerationResult:
    """An empty result of a generation over the network (route and trips filled as it runs)."""
    return GenerationResult(list(prompt_ids), [], route=[], time_summary=summarize_trips)
