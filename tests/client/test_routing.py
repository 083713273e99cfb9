"""Routing is a pure function: Dijkstra over (peer, layer) with RTT, throughput and queue costs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sangama_p2p.client.routing import (
    FULL_PENALTY,
    RouteCandidate,
    chain_cost,
    link_cost_from_rtts,
    plan_route,
    step_cost,
)
from sangama_p2p.errors import RouteError


def ids(chain):
    return [o.peer_id for o in chain]


def test_prefers_fast_peers_and_fewer_hops_when_they_are_cheaper():
    offers = [
        RouteCandidate("a", 0, 4, throughput=100, rtt=0.002),
        RouteCandidate("b", 4, 8, throughput=100, rtt=0.002),
        RouteCandidate("whole", 0, 8, throughput=60, rtt=0.002),  # one hop, 16.7 ms vs 2 x 10 ms + an extra hop
        RouteCandidate("slow", 4, 8, throughput=10, rtt=0.001),
    ]
    assert ids(plan_route(offers, 8)) == ["whole"]
    offers[2] = RouteCandidate("whole", 0, 8, throughput=40, rtt=0.002)
    assert ids(plan_route(offers, 8)) == ["a", "b"]
    assert chain_cost(plan_route(offers, 8)) == pytest.approx(0.001 + 0.01 + 0.001 + 0.01 + 0.001)


def test_queue_rtt_exclusion_and_full_peers():
    offers = [RouteCandidate("a", 0, 4, throughput=100, rtt=0.001),
              RouteCandidate("b", 0, 4, throughput=100, rtt=0.001),
              RouteCandidate("c", 4, 8, throughput=100, rtt=0.001)]
    assert ids(plan_route(offers, 8)) == ["a", "c"]  # tie: smaller peer id
    queued = [RouteCandidate("a", 0, 4, throughput=100, queue=3, rtt=0.001), *offers[1:]]
    assert ids(plan_route(queued, 8)) == ["b", "c"]
    far = [RouteCandidate("a", 0, 4, throughput=100, rtt=0.2), *offers[1:]]
    assert ids(plan_route(far, 8)) == ["b", "c"]
    assert ids(plan_route(offers, 8, exclude={"a"})) == ["b", "c"]
    full = [RouteCandidate("a", 0, 4, throughput=100, free_sessions=0, rtt=0.001), offers[2]]
    assert ids(plan_route(full, 8)) == ["a", "c"]  # still tried when nothing else fits
    assert step_cost(full[0]) == pytest.approx(0.01 + FULL_PENALTY)
    assert ids(plan_route([*full, offers[1]], 8)) == ["b", "c"]


def test_no_chain_names_the_gap():
    offers = [RouteCandidate("a", 0, 4), RouteCandidate("c", 5, 8)]
    with pytest.raises(RouteError, match="layer 4"):
        plan_route(offers, 8)
    with pytest.raises(RouteError, match="excluded"):
        plan_route([RouteCandidate("a", 0, 8)], 8, exclude={"a"})
    with pytest.raises(RouteError):
        plan_route([], 8)
    with pytest.raises(RouteError):
        plan_route([RouteCandidate("a", 0, 8)], 0)


def test_link_costs_can_depend_on_the_pair():
    offers = [RouteCandidate("a", 0, 4), RouteCandidate("b", 0, 4),
              RouteCandidate("c", 4, 8), RouteCandidate("d", 4, 8)]

    def link(x, y):
        near = {("a", "d"), ("d", ""), ("", "a")}
        return 0.0 if (x, y) in near else 1.0

    assert ids(plan_route(offers, 8, link_cost=link)) == ["a", "d"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 7), st.integers(1, 4), st.floats(1, 200), st.integers(0, 3),
                          st.floats(0.0001, 0.1)), min_size=1, max_size=10))
def test_any_route_is_contiguous_and_optimal(raw):
    offers = [RouteCandidate(f"p{i}", s, min(s + n, 8), throughput=t, queue=q, rtt=r)
              for i, (s, n, t, q, r) in enumerate(raw)]
    try:
        chain = plan_route(offers, 8)
    except RouteError:
        chain = None
    # brute force over every contiguous chain, with the same RTT table plan_route uses
    link = link_cost_from_rtts(offers)

    def cost(path):
        return chain_cost(path, link)

    best_cost = None

    def walk2(layer, path):
        nonlocal best_cost
        if layer == 8:
            c = cost(path)
            best_cost = c if best_cost is None else min(best_cost, c)
            return
        for o in offers:
            if o.start == layer:
                walk2(o.end, [*path, o])

    walk2(0, [])
    if best_cost is None:
        assert chain is None
    else:
        assert chain is not None and chain[0].start == 0 and chain[-1].end == 8
        assert all(x.end == y.start for x, y in zip(chain, chain[1:]))
        assert cost(chain) == pytest.approx(best_cost)


def test_an_error_inside_async_with_chain_client_comes_out_as_itself():
    """Not wrapped in an ExceptionGroup by the client's nursery (a caller's ``except RouteError`` must catch it)."""
    from types import SimpleNamespace

    import trio

    from sangama_p2p.client.config import ClientConfig
    from sangama_p2p.client.generate import ChainClient
    from sangama_p2p.errors import RouteError

    node = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "12D3KooWclient"))  # no dial is made

    async def main():
        with pytest.raises(RouteError, match="no chain"):
            async with ChainClient(node, ClientConfig("m")):
                raise RouteError("no chain")

    trio.run(main)


def test_stage_measured_links_replace_the_estimate_and_pick_the_near_successor():
    """Issue 24's near/far case: the client is near both candidates for 4:8, so its own round trips cannot tell them
    apart; a's measurements can (b 2 ms from it, c 80 ms), and b is chosen although c announces more speed."""
    from sangama_p2p.client.routing import hop_latencies, measured_links

    a = RouteCandidate("a", 0, 4, throughput=100, rtt=0.040, links=(("b", 0.002), ("c", 0.080)))
    b = RouteCandidate("b", 4, 8, throughput=80, rtt=0.040)
    c = RouteCandidate("c", 4, 8, throughput=100, rtt=0.040)
    estimated = [RouteCandidate(o.peer_id, o.start, o.end, o.throughput, rtt=o.rtt) for o in (a, b, c)]
    assert ids(plan_route(estimated, 8)) == ["a", "c"]  # (40 + 40) / 4 either way: the faster one
    assert ids(plan_route([a, b, c], 8)) == ["a", "b"]
    assert measured_links([a, b, c]) == {("a", "b"): 0.002, ("b", "a"): 0.002, ("a", "c"): 0.080, ("c", "a"): 0.080}
    cost = link_cost_from_rtts([a, b, c])
    assert cost("a", "b") == pytest.approx(0.001) and cost("b", "a") == pytest.approx(0.001)
    hops = hop_latencies(plan_route([a, b, c], 8), [a, b, c])
    assert [(x, y, m) for x, y, _, m in hops] == [("", "a", True), ("a", "b", True), ("b", "", True)]
    assert hop_latencies([a, c], [b, c, RouteCandidate("a", 0, 4, rtt=0.04)])[1][3] is False  # nobody measured it


def test_a_claimed_link_cannot_beat_what_the_client_sees():
    """A stage that claims a 0.1 ms link to a successor the client sees 60 ms further off is held to the triangle
    inequality: the hop costs at least half the difference of the client's round trips."""
    liar = RouteCandidate("a", 0, 4, throughput=100, rtt=0.010, links=(("far", 0.0001),))
    far = RouteCandidate("far", 4, 8, throughput=100, rtt=0.070)
    assert link_cost_from_rtts([liar, far])("a", "far") == pytest.approx(0.030)
