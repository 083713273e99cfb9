"""Verification of trips: which to re-run, through which peers, and who lied when two chains disagree. Pure.

Nothing a stage returns can be checked on its own (the client sees only the last stage's tokens), so a client in a
public swarm re-runs a random fraction of its trips through a second chain of *other* peers serving the *same*
ranges and compares the tokens (exactly: greedy decoding is deterministic, and sampled draws are seeded per
position, :func:`sangama_p2p.model.sampling.position_seed`). Two honest chains agree; when they do not, one of the
peers is wrong, and :func:`find_liar` finds which by mixing the chains:

1. Re-run both chains the same way (fresh sessions that replay the generation's trips in their shapes, so that a
   stage sees what it saw on the live chain): if they now agree, nobody is blamed (the first answers differed by
   numerics, or a lie did not repeat), and the caller keeps the trip only when that agreed answer is its own.
2. Swap one stage at a time: the chain with main's peers except alt's peer at position ``i``, for every ``i``
   (and the other way round).
3. A peer ``p`` is *consistent* with being the one liar when every chain without ``p`` gives one answer and some
   chain with ``p`` gives another (:func:`suspects`). Two peers of one position are always both consistent when the
   lie is deterministic (a chain's answer depends only on which of the two sits there), so
4. a *referee* (a third peer serving that range) takes the position in main's chain, and the vote decides.
5. Several still consistent: the one that lied in *every* chain it was in, if exactly one did; else more runs
   (a referee per suspect position, and each suspect once more in the other chain: a liar adding noise does not
   change the tokens every time, an honest chain always answers the same), a few rounds at most.
6. Before a verdict, the liar's own chain is run once more with a third peer in its place, where one exists: that
   chain must give the honest answer too (two liars at once could otherwise make an honest peer look like the one).
   And the liar must lie beside peers *outside* both disputed chains too: up to :data:`OUTSIDE_COMPANIES`
   disjoint companies (a peer at every other range, drawn at random: a boast of speed does not make a judge), each
   run with it up to :data:`OUTSIDE_TRIES` times. Colluders that lie only beside an honest neighbour make it look
   like the one liar in every mix of the two chains; a company counts against the suspect only when it answers
   honestly with the suspect's stand-in (the honest chain's peer) in its place - else it lies on its own (another
   liar, not yet banned) and proves nothing - and the suspect is banned only when it lied beside more companies
   than it answered honestly beside: framers must outnumber the honest peers of the other ranges. Without
   referees at the other ranges nobody is banned (the suspect is routed around, and its trip is not kept).
7. One position is not proof: honest peers computing in another dtype or on another device flip near-ties now and
   then (measured: 1 of 240 trips between fp32 and bf16 last stages of the tiny model). So the liar's chain and the
   closest honest chain are also compared at other positions (``recheck``: the generation's earlier trips and a few
   positions after this one, the same inputs for both); the liar is convicted when one differs, and is only a
   ``suspect`` (not banned; routed around for the generation, its trip not kept) when none does.

One consistent peer is the verdict (the caller bans it); none or several is undecided (no ban; the peers are
``disputed``). The honest answer is what the chains without the liar gave.

Usage (``run`` re-runs the trip on a route and returns its tokens; see :mod:`sangama_p2p.client.verifier`)::

    if should_verify(rng, fraction):
        alt = alternate_route(offers, route, exclude=banned)       # None: no disjoint chain of the same ranges
        ...
        verdict = await find_liar(run, route, alt, offers, exclude=banned)
        verdict.liar, verdict.reason, verdict.honest
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ..errors import RouteError, SangamaError
from .routing import RouteCandidate, step_cost

__all__ = ["PUBLIC_FRACTION", "Verdict", "alternate_route", "find_liar", "mixed_routes", "referee",
           "resolve_fraction", "should_verify", "suspects"]

PUBLIC_FRACTION = 0.05
"""The fraction of trips verified by default in a public swarm (no fleet secret); a private fleet verifies none."""

OUTSIDE_TRIES = 5
"""Runs of a suspect beside one company of peers outside the disputed chains before it counts as honest there (a
noisy liar does not change the tokens every time)."""

OUTSIDE_COMPANIES = 4
"""Companies of peers outside the disputed chains (disjoint, drawn at random) beside which a suspect is run: it is
banned only when it lied beside more of them than it answered honestly beside (framers must outnumber the honest
peers of the other ranges)."""

Route = Sequence[RouteCandidate]
Answer = tuple[int, ...]


def resolve_fraction(configured: float | None, *, private: bool) -> float:
    """The fraction of trips to verify: the configured one, else :data:`PUBLIC_FRACTION` in a public swarm and 0
    in a private fleet (its peers hold the fleet secret: they are the operator's own)."""
    if configured is None:
        return 0.0 if private else PUBLIC_FRACTION
    if not 0.0 <= configured <= 1.0:
        raise RouteError(f"the verified fraction of trips must lie in [0, 1], got {configured}")
    return float(configured)


def should_verify(rng: random.Random, fraction: float) -> bool:
    """Whether to verify the next trip: a coin with ``fraction`` heads (1 and 0 never flip)."""
    return fraction >= 1.0 or (fraction > 0.0 and rng.random() < fraction)


def _cost(o: RouteCandidate) -> float:
    return step_cost(o) + (o.rtt if o.rtt is not None else 0.05)


def alternate_route(offers: Sequence[RouteCandidate], route: Route, *, exclude: Collection[str] = (),
                    rng: random.Random | None = None) -> list[RouteCandidate] | None:
    """A chain over the same ranges as ``route`` with another peer at every position (none of ``route``'s, none of
    ``exclude``), the cheapest per position, or with ``rng`` one drawn at random (a verifier's: liars that boast of
    their speed win the generation's chain, and must not win its check too - two noisy liars chained in both
    answered alike in the liar soak); None when some range has no other peer."""
    used = {o.peer_id for o in route}
    alt: list[RouteCandidate] = []
    for stage in route:
        options = [o for o in offers if (o.start, o.end) == (stage.start, stage.end) and o.peer_id not in used
                   and o.peer_id not in exclude]
        if not options:
            return None
        best = (min(options, key=lambda o: (_cost(o), o.peer_id)) if rng is None
                else rng.choice(sorted(options, key=lambda o: o.peer_id)))
        alt.append(best)
        used.add(best.peer_id)
    return alt


def mixed_routes(main: Route, alt: Route) -> list[tuple[int, list[RouteCandidate]]]:
    """``(i, main with alt's stage at position i)`` for every position (none for a one-stage chain: that is alt)."""
    if len(main) != len(alt) or any((a.start, a.end) != (b.start, b.end) for a, b in zip(main, alt)):
        raise RouteError("chains mix only over the same ranges")
    if len(main) < 2:
        return []
    return [(i, [*main[:i], alt[i], *main[i + 1:]]) for i in range(len(main))]


def referee(offers: Sequence[RouteCandidate], stage: RouteCandidate, *,
            exclude: Collection[str]) -> RouteCandidate | None:
    """A third peer for ``stage``'s range (none of ``exclude``), the cheapest; None if there is none."""
    options = [o for o in offers if (o.start, o.end) == (stage.start, stage.end) and o.peer_id not in exclude]
    return min(options, key=lambda o: (_cost(o), o.peer_id)) if options else None


def _companies(offers: Sequence[RouteCandidate], base: Route, i: int, shunned: Collection[str],
               rng: random.Random) -> list[list[RouteCandidate]]:
    """Up to :data:`OUTSIDE_COMPANIES` chains like ``base`` with other peers (none of ``shunned``) at every position
    but ``i``, each peer in at most one, in a random order (a peer's boast of speed does not make it a judge); none
    when some other position has no such peer."""
    pools = []
    for j, stage in enumerate(base):
        if j == i:
            continue
        pool = sorted((o for o in offers if (o.start, o.end) == (stage.start, stage.end) and o.peer_id not in shunned),
                      key=lambda o: o.peer_id)
        if not pool:
            return []
        rng.shuffle(pool)
        pools.append(pool)
    n = min(OUTSIDE_COMPANIES, *(len(p) for p in pools))
    out = []
    for c in range(n):
        others = iter([p[c] for p in pools])
        out.append([stage if j == i else next(others) for j, stage in enumerate(base)])
    return out


Observations = Sequence[tuple[tuple[str, ...], Answer]]
"""(a route's peer ids, the answer it gave) per chain run; a route may appear more than once (a liar that adds
noise answers differently each time; an honest chain never does)."""


def suspects(observations: Observations | Mapping[tuple[str, ...], Answer], *, strict: bool = False) -> list[str]:
    """The peers each of which, alone lying, explains ``observations``: every chain run without it gave one
    answer, and some chain run with it gave another (``strict``: every one). Sorted."""
    obs = list(observations.items()) if isinstance(observations, Mapping) else list(observations)
    peers = sorted({p for route, _ in obs for p in route})
    out = []
    for p in peers:
        without = {ans for route, ans in obs if p not in route}
        with_p = [ans not in without for route, ans in obs if p in route]
        if len(without) == 1 and (all(with_p) if strict else any(with_p)):
            out.append(p)
    return out


def _narrow(obs: Observations, found: list[str]) -> list[str]:
    """Several suspects: the one that lied in every chain it was in, if exactly one did (else all of them)."""
    if len(found) <= 1:
        return found
    strict = [p for p in suspects(obs, strict=True) if p in found]
    return strict if len(strict) == 1 else found


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`find_liar`: ``liar`` (None = undecided or nobody), why, the honest answer (what the
    chains without the liar gave), how many chains were run, and the peers left ``disputed`` when undecided.
    ``suspect``: the one peer that explains the answers but agreed with the others at every other position tried
    (a near-tie that honest numerics of another dtype or device flip, or a liar that lies rarely): not convicted,
    and ``liar_in_main`` then says whether it sits in main's chain."""

    liar: str | None
    reason: str
    honest: Answer | None = None
    chains_run: int = 0
    disputed: frozenset[str] = frozenset()
    liar_in_main: bool = False
    suspect: str | None = None
    observations: tuple[tuple[tuple[str, ...], Answer], ...] = ()  # (route's peer ids, its answer) per chain run


def _ids(route: Route) -> tuple[str, ...]:
    return tuple(o.peer_id for o in route)


def _show(answer: Answer | None) -> str:
    return "no answer" if answer is None else str(list(answer))


async def find_liar(run: Callable[[Route], Awaitable[Answer]], main: Route, alt: Route,
                    offers: Sequence[RouteCandidate], *, exclude: Collection[str] = (), rounds: int = 3,
                    recheck: Callable[[Route, Route], Awaitable[tuple[Sequence[Answer], Sequence[Answer]]]]
                    | None = None, rechecks: int = 10, rng: random.Random | None = None) -> Verdict:
    """Find the one peer whose answers differ from the others': re-run the trip on ``main`` and ``alt``, on every
    one-stage swap between them (both ways), then, while several peers stay suspect (at most ``rounds`` times),
    on main with a referee at each suspect's position and once more on the other chain holding each suspect (a
    noisy liar does not lie visibly every time); before a verdict, on the liar's chain with a referee in its place.
    ``run(route)`` returns the trip's tokens on ``route`` (a chain that fails with a :class:`SangamaError` is no
    observation). ``recheck(bad, good)``: the answers of the liar's chain and of the closest honest chain at other
    positions (the same inputs for both), up to ``rechecks`` of them compared; with it, a peer is convicted only
    when its chain also differs at one of those, else it is only the verdict's ``suspect``. See the module
    docstring."""
    obs: list[tuple[tuple[str, ...], Answer]] = []
    runs = 0
    rng = rng or random.Random(0)

    async def observe(route: Route, *, again: bool = False) -> Answer | None:
        nonlocal runs
        key = _ids(route)
        if not again:
            for k, ans in obs:
                if k == key:
                    return ans
        runs += 1
        try:
            ans = tuple(await run(route))
        except SangamaError:
            return None
        obs.append((key, ans))
        return ans

    def verdict(found: list[str], why: str) -> Verdict:
        return Verdict(None, f"undecided: {why}; {len(obs)} chains answered "
                       f"{sorted({_show(x) for _, x in obs})}", None, runs, disputed=frozenset(found),
                       observations=tuple(obs))

    a, b = await observe(main), await observe(alt)
    if a is not None and a == b:
        return Verdict(None, f"on a second run both chains answered {_show(a)}: nobody blamed", a, runs,
                       observations=tuple(obs))
    for _, route in [*mixed_routes(main, alt), *mixed_routes(alt, main)]:
        await observe(route)
    found = _narrow(obs, suspects(obs))
    tried: set[str] = set(_ids(main)) | set(_ids(alt))
    for _ in range(rounds):
        if len(found) <= 1:
            break
        for p in found:
            for here, other in ((main, alt), (alt, main)):
                if p in _ids(here):
                    i = _ids(here).index(p)
                    ref = referee(offers, main[i], exclude={*tried, *exclude})
                    if ref is not None:
                        tried.add(ref.peer_id)
                        await observe([*main[:i], ref, *main[i + 1:]])
                    if len(main) > 1:
                        await observe([*other[:i], here[i], *other[i + 1:]], again=True)
        found = _narrow(obs, suspects(obs))
    if len(found) == 1:  # confirm: the liar's own chain with a third peer in its place must answer the honest way
        liar = found[0]
        base = main if liar in _ids(main) else alt
        i = _ids(base).index(liar)
        options = [o for o in offers if (o.start, o.end) == (base[i].start, base[i].end)
                   and o.peer_id not in {main[i].peer_id, alt[i].peer_id, *exclude}]
        ref = min(options, key=lambda o: (o.peer_id in tried, _cost(o), o.peer_id), default=None)
        if ref is not None:
            await observe([*base[:i], ref, *base[i + 1:]])
            found = _narrow(obs, suspects(obs))
    if len(found) != 1:
        return verdict(found, "several peers explain the answers (no referee to tell them apart)" if found else
                       "no single peer explains the answers")
    liar = found[0]
    honest = {ans for route, ans in obs if liar not in route}.pop()
    lied = sorted({ans for route, ans in obs if liar in route and ans != honest})
    reason = (f"answered {', '.join(_show(x) for x in lied)} where {sum(liar not in r for r, _ in obs)} chains "
              f"without it answered {_show(honest)}")
    in_main = liar in _ids(main)
    confirmed: list[tuple[Route, Route, Answer]] = []  # (the suspect beside an outside company, its control, the lie)
    if len(main) > 1:  # its neighbours in the disputed chains may be the ones lying, only beside it (framing)
        base = main if in_main else alt
        i = _ids(base).index(liar)
        stand_in = (alt if in_main else main)[i]  # its position's peer in the chain that answered honestly
        companies = _companies(offers, base, i, {*_ids(main), *_ids(alt), *exclude}, rng)
        if not companies:
            return Verdict(None, f"{liar} {reason}, but no chain of peers outside the disputed chains can confirm "
                           "it (a ban needs a third peer at every other range): not banned", honest, runs,
                           disputed=frozenset({liar}), liar_in_main=in_main, suspect=liar, observations=tuple(obs))
        clean = 0  # companies beside which it answered honestly every time
        for n, company in enumerate(companies):
            left = len(companies) - n
            if len(confirmed) > clean + left or clean >= len(confirmed) + left:
                break  # decided either way
            with_it = company  # the suspect at its own position
            ans = None
            for k in range(OUTSIDE_TRIES):  # a noisy liar does not lie visibly every time
                ans = await observe(with_it, again=k > 0)
                if ans is not None and ans != honest:
                    break
            if ans is None or ans == honest:
                clean += 1
                continue
            # the company must answer honestly with the stand-in in the suspect's place (twice: a noisy liar leaves
            # the tokens alone now and then), else it lies on its own - a liar of another range not yet banned -
            # and proves nothing either way (a soak's honest first stage was banned beside a constant liar that had
            # just joined under a fresh key)
            control = [*company[:i], stand_in, *company[i + 1:]]
            controls = [await observe(control, again=True) for _ in range(2)]
            if all(c == honest for c in controls):
                confirmed.append((with_it, control, ans))
        if not confirmed or len(confirmed) <= clean:
            why = (f"answered {_show(honest)} beside {clean} of {clean + len(confirmed)} companies of peers outside the "
                   "disputed chains: its neighbours may lie beside it alone (framing)" if clean else
                   f"each of the {len(companies)} companies of peers outside the disputed chains tried lied without "
                   "it too (none to judge it by)")
            return Verdict(None, f"{liar} {reason}, but {why}; nobody banned", honest, runs,
                           disputed=frozenset(_ids(main)) | frozenset(_ids(alt)), liar_in_main=in_main,
                           suspect=liar, observations=tuple(obs))
        reason += (f", and {_show(confirmed[0][2])} beside peers outside the disputed chains ({len(confirmed)} of "
                   f"{clean + len(confirmed)} companies that answer honestly without it)")
    if recheck is not None:  # one position is not enough: honest numerics (another dtype, device) flip near-ties
        by_id = {o.peer_id: o for o in [*offers, *main, *alt]}
        if confirmed:  # beside a company shown honest without it: the two chains differ at the suspect alone
            bad, good = list(confirmed[0][0]), list(confirmed[0][1])
        else:
            bad_route = next(r for r, ans in obs if liar in r and ans != honest)
            good_route = max((r for r, ans in obs if liar not in r and ans == honest),
                             key=lambda r: sum(a == b for a, b in zip(r, bad_route)))  # the closest honest chain
            bad, good = [by_id[p] for p in bad_route], [by_id[p] for p in good_route]
        runs += 2
        try:
            bad_at, good_at = await recheck(bad, good)
        except SangamaError:
            bad_at, good_at = [], []
        pairs = list(zip(bad_at, good_at))[:rechecks]
        differs_at = next(((a, b) for a, b in pairs if a != b), None)
        if differs_at is None:
            return Verdict(None, f"{liar} {reason}, but agreed with them at {len(pairs)} other positions: a near-tie "
                           "(another dtype or device?) or a rare lie; not banned", honest, runs,
                           disputed=frozenset({liar}), liar_in_main=in_main, suspect=liar, observations=tuple(obs))
        reason += f", and {_show(differs_at[0])} where they answered {_show(differs_at[1])} at another position"
    return Verdict(liar, reason, honest, runs, liar_in_main=in_main, observations=tuple(obs))
