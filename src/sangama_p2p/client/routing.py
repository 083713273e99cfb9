"""Choosing a chain of peers: Dijkstra over (peer, layer) with costs from RTTs, throughput and queues. Pure.

Why this shape (the approach Petals takes): the cost of a chain is what one trip takes, i.e. the sum over hops of
the link latency into the hop plus the hop's compute and queueing time, plus the way back from the last stage to the
client. A graph node is "peer p has just computed up to layer b" (``(p, b)``); an edge goes from ``(q, b)`` to
``(p, end_p)`` for every peer ``p`` whose range starts at ``b``. Because the node remembers the previous peer,
edge costs may depend on the pair (``link_cost(q, p)``). Stages serve exactly their announced range.

Usage::

    offers = [RouteCandidate("A", 0, 4, throughput=80.0, rtt=0.002),
              RouteCandidate("B", 4, 8, throughput=50.0, rtt=0.003)]
    chain = plan_route(offers, num_layers=8)            # [offer A, offer B]; RouteError if nothing covers 0..8
    chain = plan_route(offers, 8, exclude={"B"})        # re-route around a failed peer
    chain = plan_route(offers, 8, banned={"B": "lied"}) # banned peers (client/verify.py) are never chained

Stage-to-stage latency comes from the round trips the stages measured to each other and published in their signed
records (``RouteCandidate.links``, :mod:`sangama_p2p.stage.neighbours`); only a hop nobody measured is estimated
from the client's own round trips (:func:`link_cost_from_rtts`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from ..errors import RouteError

__all__ = ["CLIENT", "FULL_PENALTY", "RouteCandidate", "chain_cost", "hop_latencies", "link_cost_from_rtts",
           "measured_links", "plan_route", "step_cost"]

CLIENT = ""
"""The client's own name in link costs."""
_UNKNOWN_RTT = 0.05  # seconds assumed for a peer whose RTT was not measured
_NO_THROUGHPUT = 1.0  # steps/s assumed for a peer that announces none yet
FULL_PENALTY = 60.0  # seconds added for a peer that announces no free session: tried only when nothing else fits


@dataclass(frozen=True)
class RouteCandidate:
    """A peer the client may chain, as it sees it: layer range, announced speed and load, the RTT it measured
    (what :func:`plan_route` chooses from and returns).

    ``throughput``: steps per second one session gets at the stage, as it announces (0 = unknown). ``queue``: steps
    waiting at the stage. ``rtt``: the client's measured round trip to the peer in seconds (None = not measured).
    ``addrs``: where to dial it. ``fingerprint``/``num_layers``/``layer_hashes``: its checkpoint's identity (routing
    ignores them; the client chains only offers of one fingerprint, see :mod:`sangama_p2p.net.lineup`). ``links``:
    (peer id, round trip in s) the peer measured to stages that can follow it, from its signed record
    (:mod:`sangama_p2p.stage.neighbours`). ``source``: the address the client's own link to it comes from (not what
    its record claims; empty on loopback or through a relay), which a ban follows.
    """

    peer_id: str
    start: int
    end: int
    throughput: float = 0.0
    queue: int = 0
    free_sessions: int = 1
    rtt: float | None = None
    addrs: tuple[str, ...] = ()
    fingerprint: str = ""  # the checkpoint's fingerprint, from the peer's signed record
    num_layers: int = 0  # the model's depth under that fingerprint (from the record)
    layer_hashes: tuple[tuple[str, str], ...] = ()
    links: tuple[tuple[str, float], ...] = ()
    source: tuple[str, ...] = ()  # what the probe's link saw of it: "address IP" and "network ..." (net/addrs.py)


def step_cost(offer: RouteCandidate) -> float:
    """Seconds one step is expected to spend at ``offer``: its compute time, times the queue ahead plus one.

    A peer announcing no free session gets :data:`FULL_PENALTY` on top: its figure is an estimate (sized for a
    typical session), so it is still tried, and refuses with a typed ``CAPACITY`` error if it really is full.
    """
    tps = offer.throughput if offer.throughput > 0 else _NO_THROUGHPUT
    return (1 + max(offer.queue, 0)) / tps + (FULL_PENALTY if offer.free_sessions <= 0 else 0.0)


def measured_links(offers: Sequence[RouteCandidate]) -> dict[tuple[str, str], float]:
    """The stage-to-stage round trips the offers' peers measured: ``(p, q) -> seconds`` for p's measurement of its
    link to q (also keyed ``(q, p)`` where q measured none to p: a round trip is the same both ways)."""
    rtts: dict[tuple[str, str], float] = {}
    for o in offers:
        for peer, rtt in o.links:
            if peer != o.peer_id and math.isfinite(rtt) and rtt > 0:
                rtts[(o.peer_id, peer)] = rtt
    for (a, b), rtt in list(rtts.items()):
        rtts.setdefault((b, a), rtt)
    return rtts


def link_cost_from_rtts(offers: Sequence[RouteCandidate]) -> Callable[[str, str], float]:
    """One-way latency of each hop: client<->p is the client's rtt/2; p->q is half the round trip p (or q) measured
    to the other and published (:func:`measured_links`; never less than half the difference of the client's round
    trips to p and q, which a lying peer cannot beat), else estimated as (rtt_p + rtt_q)/4 from the client's own
    round trips (what nobody measured: a peer that joined since, an old peer); a peer to itself costs 0."""
    rtts = {o.peer_id: (o.rtt if o.rtt is not None else _UNKNOWN_RTT) for o in offers}
    measured = measured_links(offers)

    def cost(a: str, b: str) -> float:
        if a == b:
            return 0.0
        if a == CLIENT:
            return rtts.get(b, _UNKNOWN_RTT) / 2
        if b == CLIENT:
            return rtts.get(a, _UNKNOWN_RTT) / 2
        known = measured.get((a, b))
        if known is not None:
            # a peer's claim about its own link, bounded below by what the client sees (triangle inequality: a
            # stage cannot be nearer its successor than the difference of their distances to the client)
            return max(known, abs(rtts.get(a, _UNKNOWN_RTT) - rtts.get(b, _UNKNOWN_RTT))) / 2
        return (rtts.get(a, _UNKNOWN_RTT) + rtts.get(b, _UNKNOWN_RTT)) / 4

    return cost


def hop_latencies(chain: Sequence[RouteCandidate], offers: Sequence[RouteCandidate]) -> list[tuple[str, str, float,
                                                                                                   bool]]:
    """Each hop of ``chain``, client to client: ``(from, to, one-way seconds, measured)``; measured is False where
    the figure is an estimate (see :func:`link_cost_from_rtts`; the client's own hops are always measured when it
    probed the peer)."""
    cost = link_cost_from_rtts(offers)
    measured = measured_links(offers)
    probed = {o.peer_id for o in offers if o.rtt is not None}
    names = [CLIENT, *(o.peer_id for o in chain), CLIENT]
    hops = []
    for a, b in zip(names, names[1:]):
        if CLIENT in (a, b):
            known = (b if a == CLIENT else a) in probed
        else:
            known = (a, b) in measured or a == b
        hops.append((a, b, cost(a, b), known))
    return hops


def plan_route(
    offers: Sequence[RouteCandidate],
    num_layers: int,
    *,
    exclude: Collection[str] = (),
    banned: Mapping[str, str] | None = None,
    link_cost: Callable[[str, str], float] | None = None,
) -> list[RouteCandidate]:
    """The cheapest chain of offers covering layers ``[0, num_layers)`` in order (see the module docstring).

    Peers in ``exclude`` are skipped, and so are those in ``banned`` (peer id -> reason: peers this client caught
    lying, :mod:`sangama_p2p.client.verify`); peers announcing no free session are used only when nothing else fits.
    Ties are broken by peer id, so the result is deterministic. Raises :class:`RouteError` naming the first layer
    nobody covers when no chain exists (and the banned peers that could have, with their reasons).
    """
    if num_layers <= 0:
        raise RouteError(f"num_layers must be positive, got {num_layers}")
    banned = banned or {}
    usable = [o for o in offers if o.peer_id not in exclude and o.peer_id not in banned and 0 <= o.start < o.end
              and o.end <= num_layers and o.peer_id != CLIENT]
    link = link_cost or link_cost_from_rtts(usable)
    by_start: dict[int, list[RouteCandidate]] = {}
    for o in usable:
        by_start.setdefault(o.start, []).append(o)
    for group in by_start.values():
        group.sort(key=lambda o: (o.peer_id, o.end))
    # node: (layer reached, index of the offer that reached it; -1 = the client at layer 0)
    start_node = (0, -1)
    dist: dict[tuple[int, int], float] = {start_node: 0.0}
    prev: dict[tuple[int, int], tuple[int, int]] = {}
    index = {id(o): i for i, o in enumerate(usable)}
    heap: list[tuple[float, str, tuple[int, int]]] = [(0.0, "", start_node)]
    best_end: tuple[float, tuple[int, int]] | None = None
    while heap:
        d, _, node = heapq.heappop(heap)
        if d > dist.get(node, math.inf):
            continue
        layer, i = node
        here = usable[i].peer_id if i >= 0 else CLIENT
        if layer == num_layers:
            total = d + link(here, CLIENT)
            if best_end is None or total < best_end[0]:
                best_end = (total, node)
            continue
        for o in by_start.get(layer, ()):
            nxt = (o.end, index[id(o)])
            nd = d + link(here, o.peer_id) + step_cost(o)
            if nd < dist.get(nxt, math.inf):
                dist[nxt] = nd
                prev[nxt] = node
                heapq.heappush(heap, (nd, o.peer_id, nxt))
    if best_end is None:
        reach = max((layer for layer, _ in dist), default=0)
        raise RouteError(
            f"no chain of peers covers layers 0..{num_layers}: nobody usable serves a range starting at layer {reach}"
            + (f" (excluded: {sorted(exclude)})" if exclude else "")
            + "".join(f" (banned {o.peer_id} {o.start}:{o.end}: {banned[o.peer_id]})" for o in offers
                      if o.peer_id in banned)
        )
    chain = []
    node = best_end[1]
    while node != start_node:
        chain.append(usable[node[1]])
        node = prev[node]
    return chain[::-1]


def chain_cost(chain: Sequence[RouteCandidate], link_cost: Callable[[str, str], float] | None = None) -> float:
    """Estimated seconds per trip of ``chain`` under the same cost model as :func:`plan_route`."""
    link = link_cost or link_cost_from_rtts(chain)
    total, here = 0.0, CLIENT
    for o in chain:
        total += link(here, o.peer_id) + step_cost(o)
        here = o.peer_id
    return total + link(here, CLIENT)
