"""The pure verification logic (client/verify.py): the second chain, the mixes, who is suspect, the verdicts.

``run`` here computes a chain's answer from which peers it holds (an honest chain answers the honest tokens; a chain
holding a liar answers what that liar makes of it), so every verdict below is the algorithm's, on answers shaped
like the network's. The loopback tests with real lying stages are in test_liars.py.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
import trio

from sangama_p2p.client.routing import RouteCandidate, plan_route
from sangama_p2p.client.verify import (PUBLIC_FRACTION, alternate_route, find_liar, mixed_routes, referee,
                                       resolve_fraction, should_verify, suspects)
from sangama_p2p.errors import RouteError, StageError

HONEST = (7, 3)


def offers(spec: dict[str, tuple[int, int]], fast: Sequence[str] = ()) -> list[RouteCandidate]:
    return [RouteCandidate(p, a, b, throughput=1000.0 if p in fast else 10.0, rtt=0.001) for p, (a, b) in spec.items()]


def world(liars: dict[str, object]):
    """A chain answers HONEST unless it holds a liar: a constant one answers its constant, a noisy one a fresh
    random answer each run."""
    rng = random.Random(5)
    calls: list[tuple[str, ...]] = []

    async def run(route):
        ids = tuple(o.peer_id for o in route)
        calls.append(ids)
        for o in route:
            kind = liars.get(o.peer_id)
            if kind == "noise":
                return (rng.randrange(1000), rng.randrange(1000))
            if kind == "crash":
                raise StageError("gone")
            if kind is not None:
                return kind
        return HONEST

    return run, calls


THREE = {"a0": (0, 3), "b0": (0, 3), "c0": (0, 3), "a1": (3, 5), "b1": (3, 5), "c1": (3, 5), "a2": (5, 8), "b2": (5, 8),
         "c2": (5, 8)}


def test_fraction_defaults_public_on_private_off_and_bounds():
    assert resolve_fraction(None, private=False) == PUBLIC_FRACTION
    assert resolve_fraction(None, private=True) == 0.0
    assert resolve_fraction(0.5, private=True) == 0.5  # configured wins, also in a private fleet
    with pytest.raises(RouteError):
        resolve_fraction(1.5, private=False)
    rng = random.Random(1)
    assert all(should_verify(rng, 1.0) for _ in range(100))
    assert not any(should_verify(rng, 0.0) for _ in range(100))
    n = sum(should_verify(rng, 0.05) for _ in range(20000))
    assert 800 < n < 1200, n


def test_the_second_chain_keeps_the_ranges_and_shares_no_peer():
    o = offers(THREE, fast=("a0", "a1", "a2"))
    main = plan_route(o, 8)
    assert [x.peer_id for x in main] == ["a0", "a1", "a2"]
    alt = alternate_route(o, main)
    assert [(x.start, x.end) for x in alt] == [(0, 3), (3, 5), (5, 8)]
    assert not {x.peer_id for x in alt} & {"a0", "a1", "a2"}
    assert alternate_route(o, main, exclude={"b0", "c0"}) is None  # nobody else serves 0:3
    assert [x.peer_id for x in alternate_route(o, main, exclude={"b1"})] == ["b0", "c1", "b2"]
    # a range served by another split only (0:4 + 4:8 where main has 0:3 ...) is no second chain
    assert alternate_route(offers({"a": (0, 8), "b": (0, 4), "c": (4, 8)}), [RouteCandidate("a", 0, 8)]) is None


def test_mixes_swap_one_position_each_and_referees_are_third_peers():
    o = offers(THREE)
    by = {x.peer_id: x for x in o}
    main, alt = [by["a0"], by["a1"], by["a2"]], [by["b0"], by["b1"], by["b2"]]
    got = [(i, [x.peer_id for x in r]) for i, r in mixed_routes(main, alt)]
    assert got == [(0, ["b0", "a1", "a2"]), (1, ["a0", "b1", "a2"]), (2, ["a0", "a1", "b2"])]
    assert mixed_routes(main[:1], alt[:1]) == []
    with pytest.raises(RouteError):
        mixed_routes(main, [by["b0"], by["b1"]])
    assert referee(o, by["a1"], exclude={"a1", "b1"}).peer_id == "c1"
    assert referee(o, by["a0"], exclude={"a0", "b0", "c0"}) is None


def test_suspects_are_the_peers_that_alone_explain_the_answers():
    obs = {("a0", "L"): (1,), ("b0", "h1"): (9,), ("b0", "L"): (1,), ("a0", "h1"): (9,)}
    assert suspects(obs) == ["L", "h1"]  # two peers of one position: either could be the liar
    obs[("a0", "h2")] = (9,)
    assert suspects(obs) == ["L"]  # a referee settles it
    assert suspects({("a",): (1,), ("b",): (1,)}) == []  # agreeing chains: nobody


@pytest.mark.parametrize("liar,kind", [("a2", (5, 5)), ("a1", "noise"), ("a0", (0, 1)), ("b2", (5, 5)),
                                       ("b1", "noise")])
def test_find_liar_names_the_one_liar_in_either_chain(liar, kind):
    o = offers(THREE)
    by = {x.peer_id: x for x in o}
    main, alt = [by["a0"], by["a1"], by["a2"]], [by["b0"], by["b1"], by["b2"]]
    run, calls = world({liar: kind})
    verdict = trio.run(lambda: find_liar(run, main, alt, o))
    assert verdict.liar == liar, verdict
    assert verdict.honest == HONEST
    assert verdict.liar_in_main == liar.startswith("a")
    assert verdict.chains_run == len(calls) <= 2 + 6 + 3 * 2 * 2 + 1  # main, alt, 6 swaps, rounds, the confirmation


def test_without_a_referee_two_peers_of_one_range_stay_undecided():
    o = offers({"a0": (0, 4), "b0": (0, 4), "a1": (4, 8), "L": (4, 8)})
    by = {x.peer_id: x for x in o}
    run, _ = world({"L": (5,)})
    verdict = trio.run(lambda: find_liar(run, [by["a0"], by["a1"]], [by["b0"], by["L"]], o))
    assert verdict.liar is None and verdict.disputed == {"a1", "L"}
    assert "undecided" in verdict.reason


def test_chains_that_agree_on_a_second_run_blame_nobody_and_a_crashing_chain_is_no_observation():
    o = offers(THREE)
    by = {x.peer_id: x for x in o}
    main, alt = [by["a0"], by["a1"], by["a2"]], [by["b0"], by["b1"], by["b2"]]
    run, calls = world({})
    verdict = trio.run(lambda: find_liar(run, main, alt, o))
    assert verdict.liar is None and verdict.honest == HONEST and len(calls) == 2
    # a liar that also crashes some chains: the others still convict it
    run, _ = world({"a2": (5, 5), "b0": "crash"})
    verdict = trio.run(lambda: find_liar(run, main, alt, o))
    assert verdict.liar == "a2"


def test_two_liars_are_never_pinned_on_an_honest_peer():
    o = offers(THREE)
    by = {x.peer_id: x for x in o}
    main, alt = [by["a0"], by["a1"], by["a2"]], [by["b0"], by["b1"], by["b2"]]
    run, _ = world({"a2": (5, 5), "b1": (6, 6)})
    verdict = trio.run(lambda: find_liar(run, main, alt, o))
    assert verdict.liar in (None, "a2", "b1")


def test_banned_peers_are_never_routed_and_the_error_says_why():
    o = offers({"a": (0, 4), "b": (0, 4), "c": (4, 8)}, fast=("a",))
    assert [x.peer_id for x in plan_route(o, 8)] == ["a", "c"]
    assert [x.peer_id for x in plan_route(o, 8, banned={"a": "lied"})] == ["b", "c"]
    with pytest.raises(RouteError, match="banned c 4:8: answered constant tokens"):
        plan_route(o, 8, banned={"c": "answered constant tokens"})


@pytest.mark.parametrize("seed", range(12))
def test_a_liar_whose_noise_often_leaves_the_tokens_alone_is_found(seed):
    """As seen on the tiny model: noise on a middle stage's hidden states changes the token in some chains only
    (its swap into the other chain answered the honest token). The repeated runs still convict it."""
    o = offers(THREE)
    by = {x.peer_id: x for x in o}
    main, alt = [by["a0"], by["a1"], by["a2"]], [by["b0"], by["b1"], by["b2"]]
    rng = random.Random(seed)

    async def run(route):
        if "a1" in (x.peer_id for x in route) and (route[0].peer_id == "a0" or rng.random() < 0.5):
            return (rng.choice([4, 9, 11]),)  # visible in main (that is how the mismatch was seen), else at random
        return HONEST

    verdict = trio.run(lambda: find_liar(run, main, alt, o))
    assert verdict.liar == "a1", verdict
    assert verdict.honest == HONEST


def _recheck_world(liars: dict[str, object], differs_elsewhere: bool):
    """``recheck``: three other positions, where a liar's chain answers (9,) when ``differs_elsewhere`` and every
    chain the same otherwise (as honest numerics that flipped one near-tie)."""
    run, calls = world(liars)

    async def recheck(bad, good):
        calls.append(("recheck", tuple(o.peer_id for o in bad), tuple(o.peer_id for o in good)))
        lies = differs_elsewhere and any(o.peer_id in liars for o in bad)
        return [(9,) if lies else (1,)] * 3, [(1,)] * 3

    return run, recheck, calls


def test_a_liar_is_convicted_only_when_it_also_differs_at_another_position():
    o = offers(THREE)
    by = {x.peer_id: x for x in o}
    main, alt = [by["a0"], by["a1"], by["a2"]], [by["b0"], by["b1"], by["b2"]]
    run, recheck, calls = _recheck_world({"a2": (5, 5)}, differs_elsewhere=True)
    v = trio.run(lambda: find_liar(run, main, alt, o, recheck=recheck))
    assert v.liar == "a2" and "another position" in v.reason
    (check,) = [c for c in calls if c[0] == "recheck"]
    assert "a2" in check[1] and "a2" not in check[2]  # the liar's chain against the closest honest one


@pytest.mark.parametrize("peer", ["a2", "b1"])
def test_a_peer_that_differs_at_one_position_only_is_a_suspect_not_a_liar(peer):
    """Honest numerics (another dtype or device) flip a near-tie now and then: one position proves nothing."""
    o = offers(THREE)
    by = {x.peer_id: x for x in o}
    main, alt = [by["a0"], by["a1"], by["a2"]], [by["b0"], by["b1"], by["b2"]]
    run, recheck, calls = _recheck_world({peer: (5, 5)}, differs_elsewhere=False)
    v = trio.run(lambda: find_liar(run, main, alt, o, recheck=recheck))
    assert v.liar is None and v.suspect == peer and v.disputed == {peer}
    assert v.liar_in_main == (peer == "a2") and v.honest == HONEST
    assert sum(c[0] == "recheck" for c in calls) == 1 and "3 other positions" in v.reason


@pytest.mark.parametrize("seed", range(20))
def test_colluders_that_lie_only_beside_an_honest_peer_never_get_it_banned(seed):
    """Issue 26's framing: the 0:3 and 5:8 peers of main lie only when the honest 3:5 peer h1 sits between them
    (a stage knows its neighbours: OpenSession names the next and previous hop). In every mix of the two chains h1
    is the one peer that explains the answers; beside peers outside both chains it answers honestly, so nobody is
    banned. 20 of 20 runs, the alternative chain drawn from a seeded shuffle of the offers."""
    spec = {"x0": (0, 3), "h1": (3, 5), "x2": (5, 8), **{k: v for k, v in THREE.items() if not k.startswith("a")}}
    o = offers(spec)
    random.Random(seed).shuffle(o)
    by = {x.peer_id: x for x in o}
    main = [by["x0"], by["h1"], by["x2"]]
    alt = alternate_route(o, main)
    colluders = {"x0", "x2"}

    async def run(route):
        ids = [x.peer_id for x in route]
        return (6, 6) if "h1" in ids and colluders & set(ids) else HONEST

    verdict = trio.run(lambda: find_liar(run, main, alt, o))
    assert verdict.liar is None, verdict
    assert verdict.suspect == "h1" and "outside the disputed chains" in verdict.reason
    assert verdict.honest == HONEST


def test_without_referees_at_the_other_ranges_nobody_is_banned():
    o = offers({"a0": (0, 4), "b0": (0, 4), "a1": (4, 8), "b1": (4, 8), "c1": (4, 8)})
    by = {x.peer_id: x for x in o}
    run, _ = world({"a1": (5,)})
    verdict = trio.run(lambda: find_liar(run, [by["a0"], by["a1"]], [by["b0"], by["b1"]], o))
    assert verdict.liar is None and verdict.suspect == "a1" and verdict.liar_in_main
    assert "a ban needs a third peer at every other range" in verdict.reason
    o.append(RouteCandidate("c0", 0, 4, throughput=10.0, rtt=0.001))  # a referee for 0:4 too: now convicted
    verdict = trio.run(lambda: find_liar(run, [by["a0"], by["a1"]], [by["b0"], by["b1"]], o))
    assert verdict.liar == "a1" and "outside the disputed chains" in verdict.reason


def test_a_referee_that_lies_on_its_own_does_not_confirm_a_framed_peer():
    """The 30-minute liar soak banned an honest first stage: a framer of 4:8 lied only beside it (every mix of the
    two chains pointed at it), and the company "outside the disputed chains" chosen to confirm was a constant liar of
    4:8 that had just joined under a fresh key (cheapest: it boasts). Its lie counted as the honest peer's. The
    company must answer honestly with the suspect's stand-in in its place; this one does not, and proves nothing."""
    o = offers({"h0": (0, 4), "b0": (0, 4), "c0": (0, 4), "f1": (4, 8), "b1": (4, 8), "k1": (4, 8), "d1": (4, 8)},
               fast=["f1", "k1"])
    by = {x.peer_id: x for x in o}

    async def run(route):
        ids = {x.peer_id for x in route}
        if "k1" in ids:
            return (0,)  # the constant liar, whoever sits beside it
        return (2,) if {"h0", "f1"} <= ids else HONEST  # the framer, beside its target only

    main, alt = [by["h0"], by["f1"]], [by["b0"], by["b1"]]
    verdict = trio.run(lambda: find_liar(run, main, alt, o))
    assert verdict.liar is None and verdict.suspect == "h0", verdict
    seen = [r for r, _ in verdict.observations]
    assert ("h0", "d1") in seen  # an honest company was tried
    # an honest company confirms a real liar: h0 lying beside everyone is still convicted
    liar_run, _ = world({"h0": (9,)})
    verdict = trio.run(lambda: find_liar(liar_run, main, alt, o))
    assert verdict.liar == "h0" and "outside the disputed chains" in verdict.reason


@pytest.mark.parametrize("seed", range(10))
def test_a_peer_framed_by_two_liars_of_the_other_range_is_not_banned_while_the_honest_outnumber_them(seed):
    """The 5-minute liar soak banned an honest last stage: a framer of 0:4 lied beside it only, and a noisy first
    stage (whose noise now and then leaves the tokens alone) passed as honest company. It now has to lie beside more
    companies outside the disputed chains than it answers honestly beside: three honest first stages outnumber the
    two liars. A real liar of that range lies beside all of them and is still banned."""
    spec = {"h1": (4, 8), "b1": (4, 8), "c1": (4, 8), "x0": (0, 4), "b0": (0, 4), "c0": (0, 4), "d0": (0, 4),
            "f0": (0, 4), "n0": (0, 4)}
    o = offers(spec, fast=["f0", "n0"])
    by = {x.peer_id: x for x in o}
    rng = random.Random(seed)

    async def run(route):
        ids = {x.peer_id for x in route}
        if "n0" in ids and rng.random() < 0.7:
            return (13,)  # noise that moves the token 7 times in 10
        return (11,) if {"f0", "h1"} <= ids else HONEST

    main, alt = [by["f0"], by["h1"]], [by["x0"], by["b1"]]
    verdict = trio.run(lambda: find_liar(run, main, alt, o, rng=random.Random(seed)))
    assert verdict.liar is None, verdict
    liar_run, _ = world({"h1": (9,)})
    verdict = trio.run(lambda: find_liar(liar_run, main, alt, o, rng=random.Random(seed)))
    assert verdict.liar == "h1", verdict
