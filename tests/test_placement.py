"""Placement (sangama_p2p.placement): the cost model on hand-computed cases, coverage, and place() against the exact
optimum of the same model on seeded random 8-peer swarms (the Petals-style greedy reported beside it)."""

from __future__ import annotations

import itertools
import math

import pytest

from sangama_p2p.placement import CLIENT, PeerSpec, brute_force, petals_greedy, place, random_swarm, score
from sangama_p2p.placement.grid import Grid

FAST_SEEDS = (3, 7, 16)  # the quickest brute forces of the benchmark's 20 (benchmarks/placement.py)


def test_one_chain_by_hand() -> None:
    peers = [PeerSpec("a", 4, 0.010), PeerSpec("b", 4, 0.005)]
    links = {(CLIENT, "a"): 0.001, ("a", "b"): 0.002, ("b", CLIENT): 0.003}
    s = score({"a": (0, 4), "b": (4, 8)}, peers, links, 8, sessions=8)
    assert s.throughput == pytest.approx(25.0)  # a: 4 layers x 10 ms = 40 ms a step; b: 20 ms
    assert s.latency == pytest.approx(0.001 + 0.040 + 0.002 + 0.020 + 0.003)
    assert s.served == pytest.approx(8 / (0.066 + 7 / 25.0))
    assert s.chain == ("a", "b")
    one = score({"a": (0, 4), "b": (4, 8)}, peers, links, 8, sessions=1)
    assert one.served == pytest.approx(1 / 0.066)  # one session gets one trip per trip time


def test_shared_peer_divides_its_capacity_and_the_best_chain_is_the_nearest() -> None:
    peers = [PeerSpec("a", 4, 0.001), PeerSpec("b", 4, 0.010), PeerSpec("c", 4, 0.010)]
    links = {("a", "b"): 0.030, ("a", "c"): 0.001}  # everything else: the default
    s = score({"a": (0, 4), "b": (4, 8), "c": (4, 8)}, peers, links, 8, default_link=0.002)
    assert s.throughput == pytest.approx(50.0)  # b and c (25 each) share a (250)
    assert s.chain == ("a", "c")
    assert s.latency == pytest.approx(0.002 + 0.004 + 0.001 + 0.040 + 0.002)


def test_ranges_that_do_not_meet_carry_nothing() -> None:
    peers = [PeerSpec(x, 3, 0.01) for x in "abcd"]
    # a 0:2 and c 1:3 cover every layer, but no chain of whole ranges exists
    assert score({"a": (0, 2), "c": (1, 3)}, peers, {}, 3).served == 0.0
    # a 0:1 -> c 1:3 and b 0:2 -> d 2:3: two chains, each limited by its slow stage (max flow, not per-layer sums)
    s = score({"a": (0, 1), "b": (0, 2), "c": (1, 3), "d": (2, 3)}, peers, {}, 3)
    assert s.throughput == pytest.approx(2 * 1 / 0.02)
    assert score({}, peers, {}, 3).served == 0.0 and math.isinf(score({}, peers, {}, 3).latency)


def test_bad_assignments_are_refused() -> None:
    peers = [PeerSpec("a", 4, 0.01)]
    for bad in ({"a": (0, 5)}, {"a": (2, 2)}, {"a": (0, 9)}, {"z": (0, 1)}):
        with pytest.raises(ValueError):
            score(bad, peers, {}, 8)
    assert PeerSpec.from_bytes("m", 10 * 2**30, 3 * 2**30, 0.01).max_layers == 3


@pytest.mark.parametrize("n, depth", [(3, 24), (8, 32), (12, 40), (40, 64)])
def test_place_covers_every_layer_when_memory_allows(n: int, depth: int) -> None:
    for seed in range(3):
        peers, links = random_swarm(seed, n=n, depth=depth)
        ranges = place(peers, links, depth)
        assert score(ranges, peers, links, depth).served > 0
        assert {layer for a, b in ranges.values() for layer in range(a, b)} == set(range(depth))


def test_place_with_just_enough_memory() -> None:
    peers = [PeerSpec(f"p{i}", 8, 0.001 * (i + 1)) for i in range(4)]  # 4 x 8 = 32 layers: one way to cover
    ranges = place(peers, {}, 32)
    assert sorted(ranges.values()) == [(0, 8), (8, 16), (16, 24), (24, 32)]


def test_brute_force_is_the_whole_space() -> None:
    """On a small grid, brute force's answer scores as well as the best of every state, listed one by one."""
    for seed in range(3):
        peers, links = random_swarm(seed, n=4, depth=16)
        grid = Grid(peers, links, 16, 4, 8, 0.025)
        every = max(grid.evaluate(s).served for s in itertools.product(*[[*o, None] for o in grid.options]))
        best = score(brute_force(peers, links, 16, blocks=4), peers, links, 16).served
        assert best == pytest.approx(every, rel=1e-12)


def _ratios(seed: int) -> tuple[float, float]:
    peers, links = random_swarm(seed)
    opt = score(brute_force(peers, links, 32), peers, links, 32).served
    ours = score(place(peers, links, 32), peers, links, 32).served
    greedy = score(petals_greedy(peers, links, 32), peers, links, 32).served
    assert ours <= opt * (1 + 1e-9) and greedy <= opt * (1 + 1e-9)
    return ours / opt, greedy / opt


@pytest.mark.parametrize("seed", FAST_SEEDS)
def test_place_is_within_ten_percent_of_the_optimum(seed: int) -> None:
    ours, greedy = _ratios(seed)
    print(f"seed {seed}: place {ours:.3f} of the optimum, Petals-style greedy {greedy:.3f}")
    assert ours >= 0.9


@pytest.mark.slow
def test_place_is_within_ten_percent_on_twenty_swarms() -> None:
    """The issue's target: 20 seeded 8-peer swarms (about 1-2 min; benchmarks/placement.py prints the table)."""
    ratios = [_ratios(seed) for seed in range(20)]
    print("place", [round(r, 3) for r, _ in ratios], "greedy", [round(g, 3) for _, g in ratios])
    assert min(r for r, _ in ratios) >= 0.9
