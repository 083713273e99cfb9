"""Verification on the network: re-run sampled trips through a second chain, judge, ban, roll back.

The pure parts (which trips, which second chain, who lied) are in :mod:`sangama_p2p.client.verify`; this module
runs them over :class:`~sangama_p2p.client.session.ChainSession`. A :class:`Verification` belongs to one
``ChainClient`` (its ban list and figures outlive generations); each generation gets a :class:`TripVerifier`
(``None`` when verification is off) and calls one hook after each trip whose tokens it is about to keep::

    verifier = client.verification.start(params)                      # None: verifying no trips
    await verifier.check(session, start, sent, n_guesses, res.tokens, prompt, out)   # may raise ChainBroken
    await verifier.aclose()

``check`` re-runs the trip (with the chosen probability) on a chain of other peers for the same ranges, whose
session is kept for the whole generation and catches up on the context lazily: a verified trip carries every
token since that chain's last verified trip, so the second chain computes each position once, in a few larger
steps. On a mismatch it finds the liar (:func:`~sangama_p2p.client.verify.find_liar`, fresh sessions on mixed
chains), bans it (reason and expiry in the ban list, shown by ``status``), and, when the liar sits in the
generation's own chain, raises ``ChainBroken`` naming the liar as misbehaving, with ``keep``: the tokens up to the
last verified trip. The transport re-routes without it and answers :class:`~sangama_p2p.generation.Rewind`: the
generation drops the later trips and their tokens (``result.retracted``), replays the ones it keeps and goes on.
A peer that differed at this position only (a near-tie flipped by another dtype or device, or a rare lie) is not
banned; when it sits in the generation's chain the generation still goes back and continues around it
(``ChainBroken`` naming it stalled).
"""

from __future__ import annotations

import logging
import os
import random
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import trio

from .. import clock
from ..errors import ErrorCode, SangamaError, StageRefused, VerifyingTripLate
from ..generation import Trip
from ..net.bans import BanList
from ..positions import next_start
from .routing import RouteCandidate
from .session import ChainBroken, ChainSession, SessionParams
from .verify import Verdict, alternate_route, find_liar, resolve_fraction, should_verify

__all__ = ["RECHECKS", "TripVerifier", "Verification", "VerifyEvent"]

RECHECKS = 5
"""Earlier trips, and positions after the disputed one, at which a suspect's chain is compared with an honest one
before it is convicted (up to this many of each)."""

LATE_GRACE = 4
"""A generation's verifying chains get this many times the deadline after one was late."""

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VerifyEvent:
    """A mismatch and what came of it: the trip (counted per generation, the prefill is 1), the trips verified
    before it in that generation, the verdict, and the seconds the judging took (the re-runs on mixed chains)."""

    trip: int
    trips_verified: int
    verdict: Verdict
    seconds: float = 0.0


@dataclass
class Verification:
    """A client's verification settings, ban list and figures (one per ``ChainClient``)."""

    client: Any
    fraction: float = 0.0
    bans: BanList = field(default_factory=BanList)
    trips: int = 0  # trips the hook saw
    verified: int = 0  # trips re-run on a second chain and found equal
    unverifiable: int = 0  # trips drawn for verification with no second chain of the same ranges
    strict: bool = False  # a drawn trip no other chain confirmed is not kept (the generation goes around its chain)
    refused: int = 0  # trips not kept for want of confirmation (strict)
    seconds: float = 0.0  # spent verifying (second-chain trips, opening it, judging), on the generations' paths
    open_seconds: float = 0.0  # of which opening second chains
    events: list[VerifyEvent] = field(default_factory=list)
    disputed: set[str] = field(default_factory=set)

    @classmethod
    def for_client(cls, client: Any) -> Verification:
        cfg = client.config
        private = getattr(getattr(client.node, "config", None), "fleet_secret", None) is not None
        fraction = resolve_fraction(cfg.verify, private=private)
        strict = fraction >= 1.0 if cfg.verify_strict is None else cfg.verify_strict
        return cls(client, fraction, BanList(cfg.bans_file), strict=strict)

    def banned(self, offers: Sequence[RouteCandidate] = ()) -> dict[str, str]:
        """peer id -> reason of every ban in force (routing leaves these peers out), and of each of ``offers`` a
        ban follows: the banned checkpoint's range from the banned address under another key."""
        return {**self.bans.reasons(),
                **self.bans.follow([(o.peer_id, o.source, o.fingerprint, f"{o.start}:{o.end}") for o in offers])}

    def start(self, params: SessionParams, *, rng: random.Random | None = None) -> TripVerifier | None:
        """The verifier of one generation, or None when no trip is to be verified."""
        if self.fraction <= 0:
            return None
        return TripVerifier(self, params, rng or random.Random(int.from_bytes(os.urandom(8), "little")))


class TripVerifier:
    """One generation's verification (see the module docstring)."""

    def __init__(self, owner: Verification, params: SessionParams, rng: random.Random) -> None:
        self.owner = owner
        self.client = owner.client
        # its chains step trip by trip from here, never round a ring (a ring's session would have its last stage
        # dial the first one, and every stage keep rollback for the windows in flight, for nothing)
        self.params = replace(params, ring_until=0, ring_stop=(), windows=1)
        self.rng = rng
        self.alt: ChainSession | None = None
        self.alt_pos = 0  # positions the second chain holds valid state for
        self.alt_step = 0
        self.trip = 0
        self.trips_verified = 0
        self.trips_unverified = 0  # drawn for verification and not checked (no second chain, or it failed)
        self.verified = 0  # out[:verified] was produced by trips that were verified (or precede one that was)
        self.skip: set[str] = set()  # peers whose verifying chain failed in this generation
        self.resurveyed = False  # whether this generation already surveyed afresh for want of a second chain
        self.late = False  # whether a verifying chain missed its deadline once (then given LATE_GRACE x the time)
        self.fingerprint: str | None = None  # the generation's checkpoint

    async def check(self, session: ChainSession, start: int, sent: Sequence[int], n_guesses: int,
                    tokens: Sequence[int], prompt: Sequence[int], out: list[int],
                    history: Sequence[Trip] = ()) -> None:
        """Called after a trip on ``session`` (input ``sent`` at ``start`` with ``n_guesses`` guesses) answered
        ``tokens``, before they join ``out``. Returns normally when the trip was not drawn, could not be checked, or
        was found right (or the liar sat in the second chain); raises ``ChainBroken`` (misbehaving: the liar; ``keep``:
        the tokens of ``out`` up to the last verified trip) when a peer of ``session`` lied, or when no other chain
        confirmed the answer. ``history``: the trips ``session`` was sent before this one, in order (judging replays
        them)."""
        self.trip += 1
        self.owner.trips += 1
        if not should_verify(self.rng, self.owner.fraction):
            return
        t0 = clock.now()
        try:
            await self._check(session, start, sent, n_guesses, tokens, prompt, out, history)
        finally:
            self.owner.seconds += clock.now() - t0

    async def _check(self, session: ChainSession, start: int, sent: Sequence[int], n_guesses: int,
                     tokens: Sequence[int], prompt: Sequence[int], out: list[int], history: Sequence[Trip]) -> None:
        context = [*prompt, *out][:start]
        self.fingerprint = session.fingerprint  # the second chains' stages check it at open, as the first's do
        # the last survey (the generation's own chain came from it): no DHT round on the generation's path
        offers = self.client.offers or await self.client.survey(max_age=self.client.config.survey_max_age)
        # only peers of the chain's own checkpoint that routing would chain: another checkpoint answers otherwise
        # without lying (its peers are in another fingerprint group, and left out)
        offers = self._chainable(offers, session)
        banned = frozenset(self.owner.banned(offers))
        if self.alt is not None and start < self.alt_pos:
            # the generation went back past what the second chain holds (a rewind around a liar): a stage keeps
            # the states of its last step only, so it refuses a deeper roll-back (BAD_POSITION), and its peers were
            # then skipped for the rest of the generation, every later trip unverified: a fresh second chain
            await self._drop_alt()
        alt = await self._second_chain(session, offers, banned)
        if alt is None and not self.resurveyed:
            # the last survey may have missed peers (a DHT lookup that times out on a busy machine misses records:
            # tests/net/test_net_swarm.py; a probe that was late, and is skipped for a while): once per generation,
            # a fresh one asking late peers again, before the trip goes unverified
            self.resurveyed = True
            offers = self._chainable(await self.client.survey(max_age=0.0, retry_slow=True), session)
            alt = await self._second_chain(session, offers, banned)
        if alt is None:
            self._not_confirmed(session, f"no second chain of other peers ({len(offers)} chainable offers of "
                                f"{self.client.survey_facts.records} records; {self.client.late_peers} peers late "
                                "to their probes)")
            return
        while True:
            pos = min(self.alt_pos, start)
            limit = min(self.client.config.step_timeout, self._deadline(session) * (LATE_GRACE if self.late else 1))
            try:
                answer = await self._bounded(limit, self._steps(alt, pos, [*context[pos:], *sent], n_guesses))
                break
            except VerifyingTripLate as exc:
                await self._drop_alt()
                if not self.late:
                    # a loaded machine's honest chain can miss the deadline once (on the suite under two busy
                    # loops it did, and every later trip went unverified): once per generation it is opened again
                    # and given LATE_GRACE x the time, from then on
                    log.info("verifying chain %s was late (%s): once more, with %dx the time", alt.peers, exc,
                             LATE_GRACE)
                    self.late = True
                    alt = await self._second_chain(session, offers, banned)
                    if alt is not None:
                        continue
                else:
                    log.info("verifying chain %s was late again: %s", alt.peers, exc)
                    self.skip |= set(alt.peers)
            except StageRefused as exc:
                if exc.code != ErrorCode.BAD_POSITION or self.alt_pos == 0:
                    log.info("verifying chain %s failed: %s", alt.peers, exc)
                    self.skip |= set(alt.peers)
                    await self._drop_alt()
                else:  # its state does not reach back to this trip (ours to fix, not its peers'): a fresh chain
                    log.info("verifying chain %s cannot go back from %d to %d: %s; a fresh one", alt.peers,
                             self.alt_pos, start, exc)
                    await self._drop_alt()
                    alt = await self._second_chain(session, offers, banned)
                    if alt is not None:
                        continue
            except SangamaError as exc:
                log.info("verifying chain %s failed: %s", alt.peers, exc)
                self.skip |= set(alt.peers)  # not again in this generation (e.g. a black hole costs `limit` once)
                await self._drop_alt()
            # drawn, and not verified: said, as a trip with no second chain is (strict: not kept)
            self._not_confirmed(session, "its verifying chain failed")
            return
        if answer == tuple(tokens):
            self.alt_pos = start + len(sent) - n_guesses + len(tokens) - 1
            self.trips_verified += 1
            self.owner.verified += 1
            self.verified = len(out) + len(tokens)
            return
        log.warning("trip %d: chain %s answered %s, chain %s answered %s; finding the liar", self.trip,
                    session.peers, list(tokens), alt.peers, list(answer))
        # every chain the judging runs replays the generation's own trips in their shapes (its prompt chunks, then
        # each trip's tokens and guesses) before this one: a stage cannot tell a judging session from a live one by
        # its steps (a liar honest on a session's first step lied on the live chain and was honest on a one-step
        # re-run: nobody was blamed, and its tokens were kept), and honest peers compute exactly what they computed
        shapes = [(t.start, tuple(t.tokens), t.n_guesses, t.chunk) for t in history]
        shapes.append((start, tuple(sent), n_guesses, False))
        bound = min(10 * limit, self.client.config.step_timeout) + limit * (len(shapes) + RECHECKS)

        async def replay(route: Sequence[RouteCandidate], ahead: int = 0,
                         follow: Sequence[tuple[int, ...]] | None = None) -> list[tuple[int, ...]]:
            s = self._session(route)
            try:
                await s.open()
                return await self._bounded(bound, self._replay(s, shapes, ahead, follow))
            finally:
                await s.close()

        async def run(route: Sequence[RouteCandidate]) -> tuple[int, ...]:
            return (await replay(route))[-1]

        earlier = [j for j, shape in enumerate(shapes[:-1]) if not shape[3]][::-1]  # the latest first
        picks = earlier[::max(1, len(earlier) // RECHECKS)][:RECHECKS]
        ahead = max(0, min(RECHECKS, self.params.max_length - self._after(shapes[-1], answer) - 1))

        async def recheck(bad: Sequence[RouteCandidate], good: Sequence[RouteCandidate]
                          ) -> tuple[list[tuple[int, ...]], list[tuple[int, ...]]]:
            # the earlier trips, then `ahead` positions after this one, each fed the honest chain's last token
            good_at = await replay(good, ahead)
            bad_at = await replay(bad, ahead, follow=good_at)
            at = [*picks, *range(len(shapes), len(shapes) + ahead)]
            return [bad_at[j] for j in at], [good_at[j] for j in at]

        alt_route = list(alt.route)
        await self._drop_alt()
        t0 = clock.now()
        verdict = await find_liar(run, session.route, alt_route, offers, exclude=banned, recheck=recheck,
                                  rechecks=2 * RECHECKS, rng=self.rng)
        self.owner.events.append(VerifyEvent(self.trip, self.trips_verified, verdict, clock.now() - t0))
        if verdict.liar is None:
            log.warning("trip %d: %s", self.trip, verdict.reason)
            self.owner.disputed |= verdict.disputed
            # not judged again in this generation: the same peers would give the same dispute on every check
            self.skip |= verdict.disputed - set(session.peers)
            if verdict.suspect is not None and verdict.liar_in_main:
                # not proven a liar, but its answer here was not the others': go back, continue without it
                raise ChainBroken(f"{verdict.suspect} disagreed with the other chains at trip {self.trip}",
                                  stalled=frozenset({verdict.suspect}), keep=self.verified)
            if verdict.honest == tuple(tokens):  # the chains agreed with the generation's own answer
                self.verified = len(out) + len(tokens)
                return
            if verdict.honest is None:  # two answers and no peer left to tell which
                clear = verdict.disputed | banned
                if all(any((o.start, o.end) == (st.start, st.end) and o.peer_id not in clear for o in offers)
                       for st in session.route):  # a chain without every disputed peer exists: go on there
                    raise ChainBroken(f"trip {self.trip}'s answer {list(tokens)} was disputed ({verdict.reason})",
                                      stalled=frozenset(verdict.disputed), keep=self.verified)
                self._not_confirmed(session, verdict.reason)  # kept, said unchecked (strict: not kept)
                return
            # the other chains agree on another answer than the generation's own, which no replay reproduced (a
            # liar lying only on live sessions): never kept, back to the last verified trip, around its chain
            raise ChainBroken(f"trip {self.trip}'s answer {list(tokens)} was not confirmed ({verdict.reason})",
                              stalled=frozenset((verdict.disputed & set(session.peers)) or session.peers),
                              keep=self.verified)
        self.owner.disputed.discard(verdict.liar)
        reason = f"wrong tokens for {self.params.model_id} (trip {self.trip}): {verdict.reason}"
        who = next((o for o in [*offers, *session.route, *alt_route] if o.peer_id == verdict.liar), None)
        address = next((k.split(" ", 1)[1] for k in (who.source if who else ()) if k.startswith("address ")), "")
        self.owner.bans.ban(verdict.liar, reason, duration=self.client.config.ban_s, model_id=self.params.model_id,
                            address=address, fingerprint=who.fingerprint if who else "",
                            layers=f"{who.start}:{who.end}" if who else "")
        log.warning("banned %s: %s", verdict.liar, reason)
        self.client.stats.liars_banned += 1
        if not verdict.liar_in_main and verdict.honest == tuple(tokens):
            self.verified = len(out) + len(tokens)  # the generation's own chain answered the honest way
        if verdict.liar_in_main:
            raise ChainBroken(f"{verdict.liar} lied: {verdict.reason}", misbehaving=frozenset({verdict.liar}),
                              keep=self.verified)

    def _chainable(self, offers: Sequence[RouteCandidate], session: ChainSession) -> list[RouteCandidate]:
        """The offers routing would chain with ``session``: its checkpoint's (another answers otherwise without
        lying) and not left out."""
        return [o for o in offers if o.fingerprint == session.fingerprint and o.peer_id not in self.client.left_out]

    async def _second_chain(self, session: ChainSession, offers: Sequence[RouteCandidate],
                            banned: frozenset[str]) -> ChainSession | None:
        """The generation's second chain: kept while it still fits ``session``'s ranges and shares none of its
        peers or the banned ones, else a new one (None when the swarm has none)."""
        main = session.route
        alt = self.alt
        if alt is not None:
            same = [(o.start, o.end) for o in alt.route] == [(o.start, o.end) for o in main]
            clash = {o.peer_id for o in alt.route} & ({o.peer_id for o in main} | banned)
            if same and not clash:
                return alt
            await self._drop_alt()
        route = alternate_route(offers, main, exclude=banned | self.skip, rng=self.rng)
        if route is None:
            return None
        alt = self._session(route)
        t0 = clock.now()
        try:
            await alt.open()
        except SangamaError as exc:
            self.owner.open_seconds += clock.now() - t0
            log.info("cannot open a verifying chain on %s: %s", [o.peer_id for o in route], exc)
            await alt.close()
            self.skip |= {o.peer_id for o in route}
            return None
        self.owner.open_seconds += clock.now() - t0
        self.alt, self.alt_pos, self.alt_step = alt, 0, 0
        return alt

    def _deadline(self, session: ChainSession) -> float:
        """How long one verifying trip may take: 2 x the generation's stall deadline (its decode trips x
        ``stall_factor``; a catch-up carries more tokens), at least 4 x ``stall_floor_s``, at most ``step_timeout``."""
        cfg = self.client.config
        trip = session.decode_trip_s or cfg.stall_floor_s
        return min(cfg.step_timeout, max(4 * cfg.stall_floor_s, 2 * cfg.stall_factor * trip))

    @staticmethod
    async def _bounded(limit: float, work: Awaitable[tuple[int, ...]]) -> tuple[int, ...]:
        with trio.move_on_after(limit):
            return await work
        raise VerifyingTripLate(f"a verifying trip took over {limit:.2f} s")

    def _session(self, route: Sequence[RouteCandidate]) -> ChainSession:
        cfg = self.client.config
        s = ChainSession(self.client._pool(), route, self.params, open_timeout=cfg.open_timeout,
                         step_timeout=cfg.step_timeout)
        s.fingerprint = self.fingerprint
        return s

    async def _steps(self, s: ChainSession, start: int, tokens: Sequence[int], n_guesses: int, *,
                     fresh: bool = False) -> tuple[int, ...]:
        """Send ``tokens`` at ``start`` (the last ``n_guesses`` of them guesses) in steps of at most
        ``max_step_tokens`` (the guesses stay in the last one); the last step's tokens."""
        limit = max(self.client.config.max_step_tokens, n_guesses + 1)
        step = 0 if fresh else self.alt_step
        rest = list(tokens)
        while len(rest) > limit:
            chunk = rest[:min(limit, len(rest) - n_guesses - 1)]
            await s.step(step, start, chunk, 0)
            start, rest, step = start + len(chunk), rest[len(chunk):], step + 1
        res, _ = await s.step(step, start, rest, n_guesses)
        if not fresh:
            self.alt_step = step + 1
        return tuple(res.tokens)

    @staticmethod
    def _after(shape: tuple[int, tuple[int, ...], int, bool], answer: Sequence[int]) -> int:
        """Where the trip after ``shape`` starts when its answer was ``answer`` (positions.next_start)."""
        start, toks, n_guesses, _ = shape
        return next_start(start, len(toks), n_guesses, len(answer) - 1)

    async def _replay(self, s: ChainSession, shapes: Sequence[tuple[int, tuple[int, ...], int, bool]], ahead: int,
                      follow: Sequence[tuple[int, ...]] | None) -> list[tuple[int, ...]]:
        """Each trip of ``shapes`` as one step on ``s`` (its answers), then ``ahead`` steps of one token each: the
        last token of the answer before it, ``follow``'s (the honest chain's) where given, else ``s``'s own."""
        answers: list[tuple[int, ...]] = []
        for j, (start, toks, n_guesses, _) in enumerate(shapes):
            res, _ = await s.step(j, start, list(toks), n_guesses)
            answers.append(tuple(res.tokens))
        lead = answers if follow is None else follow
        pos = self._after(shapes[-1], lead[len(shapes) - 1])
        for k in range(ahead):
            res, _ = await s.step(len(shapes) + k, pos, [lead[len(shapes) - 1 + k][-1]], 0)
            answers.append(tuple(res.tokens))
            pos += 1
        return answers

    def _not_confirmed(self, session: ChainSession, why: str) -> None:
        """A drawn trip that no other chain confirmed: kept and counted unverified (said with the result), or, when
        verification is strict, not kept: ``ChainBroken`` back to the last verified token, around this chain."""
        if self.owner.strict:
            log.warning("trip %d could not be verified (%s): not kept (strict verification); going on around %s",
                        self.trip, why, session.peers)
            self.owner.refused += 1
            raise ChainBroken(f"trip {self.trip} could not be verified ({why}), and strict verification keeps no "
                              "unconfirmed trip", stalled=frozenset(session.peers), keep=self.verified)
        log.info("trip %d: %s: not verified", self.trip, why)
        self._unverified()

    def _unverified(self) -> None:
        self.trips_unverified += 1
        self.owner.unverifiable += 1

    async def _drop_alt(self) -> None:
        alt, self.alt = self.alt, None
        if alt is not None:
            await alt.close()

    async def aclose(self) -> None:
        await self._drop_alt()
