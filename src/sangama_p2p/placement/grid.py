"""The search space placement works in: ranges aligned to a grid of blocks, and a fast scorer for it. Pure.

The model's ``depth`` layers are cut into ``blocks`` blocks at boundaries ``k * depth // blocks`` (8 by default,
fewer when the model is shallower); :func:`~sangama_p2p.placement.place`, the exact
:func:`~sangama_p2p.placement.brute_force` and the Petals-style baseline all choose every range ``[start, end)``
with both ends on that grid, within the peer's memory. A *state* is one entry per peer: ``(a, b)`` (blocks ``a``
to ``b``) or ``None`` (idle).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from .model import CLIENT, Links, PeerSpec, Score, best_chain, link_of, served

__all__ = ["Grid", "State", "random_swarm"]

State = tuple[tuple[int, int] | None, ...]


class Grid:
    """Peers, links and depth on a block grid, with the score of a state cached (same functions as ``score``)."""

    def __init__(self, peers: Sequence[PeerSpec], links: Links, depth: int, blocks: int, sessions: int,
                 default_link: float) -> None:
        if depth <= 0 or blocks <= 0 or sessions < 1:
            raise ValueError(f"depth, blocks and sessions must be positive, got {depth}, {blocks}, {sessions}")
        if len({p.peer_id for p in peers}) != len(peers):
            raise ValueError("peer ids must be unique")
        self.peers = list(peers)
        self.depth = depth
        self.blocks = min(blocks, depth)
        self.bounds = [k * depth // self.blocks for k in range(self.blocks + 1)]
        self.sessions = sessions
        self.link = link_of(links, default_link)
        g = self.blocks
        self.options: list[list[tuple[int, int]]] = [
            [(a, b) for a in range(g) for b in range(a + 1, g + 1) if self.layers(a, b) <= p.max_layers]
            for p in self.peers]
        self._cache: dict[State, Score] = {}

    def layers(self, a: int, b: int) -> int:
        return self.bounds[b] - self.bounds[a]

    def capacity(self, i: int, a: int, b: int) -> float:
        """Steps/s peer ``i`` computes on blocks ``a..b``."""
        return 1.0 / (self.layers(a, b) * self.peers[i].layer_s)

    def fits(self, i: int, a: int, b: int) -> bool:
        return 0 <= a < b <= self.blocks and self.layers(a, b) <= self.peers[i].max_layers

    def evaluate(self, state: State) -> Score:
        hit = self._cache.get(state)
        if hit is not None:
            return hit
        g = self.blocks
        cap = [[0.0] * (g + 1) for _ in range(g + 1)]  # residual capacities between block boundaries
        ranges = []
        for i, r in enumerate(state):
            if r is not None:
                a, b = r
                comp = self.layers(a, b) * self.peers[i].layer_s
                ranges.append((self.peers[i].peer_id, self.bounds[a], self.bounds[b], comp))
                cap[a][b] += 1.0 / comp
        flow = _grid_flow(cap, g, 1e-12 / min(r[3] for r in ranges)) if ranges else 0.0
        if flow <= 0:
            return Score(0.0, 0.0, math.inf)
        latency, chain = best_chain(ranges, self.depth, self.link)
        out = Score(served(flow, latency, self.sessions), flow, latency, chain)
        if len(self._cache) < 500_000:
            self._cache[state] = out
        return out

    def assignment(self, state: State) -> dict[str, tuple[int, int]]:
        return {self.peers[i].peer_id: (self.bounds[r[0]], self.bounds[r[1]])
                for i, r in enumerate(state) if r is not None}


def _grid_flow(cap: list[list[float]], g: int, eps: float) -> float:
    """Max flow from boundary 0 to ``g`` over the residual matrix ``cap`` (Edmonds-Karp; ``max_flow`` on lists)."""
    total = 0.0
    nodes = range(g + 1)
    while True:
        parent = [-1] * (g + 1)
        parent[0] = 0
        queue = [0]
        for u in queue:
            row = cap[u]
            for v in nodes:
                if parent[v] < 0 and row[v] > eps:
                    parent[v] = u
                    queue.append(v)
            if parent[g] >= 0:
                break
        if parent[g] < 0:
            return total
        push, v = math.inf, g
        while v:
            push = min(push, cap[parent[v]][v])
            v = parent[v]
        v = g
        while v:
            u = parent[v]
            cap[u][v] -= push
            cap[v][u] += push
            v = u
        total += push


def random_swarm(seed: int, n: int = 8, depth: int = 32, regions: int = 3
                 ) -> tuple[list[PeerSpec], dict[tuple[str, str], float]]:
    """A seeded random swarm for tests and benchmarks: ``n`` peers in ``regions`` regions (one-way 0.5-1.5 ms
    inside a region, 10-40 ms between two), each holding 4-16 layers (between an eighth and a half of 32) at 1-5 ms
    per layer per step; the client sits in region 0. Total memory is at least ``depth`` (the model fits)."""
    rng = random.Random(seed)
    while True:
        peers = [PeerSpec(f"p{i}", rng.choice([4, 8, 8, 12, 16]) * depth // 32, rng.uniform(0.001, 0.005))
                 for i in range(n)]
        if sum(p.max_layers for p in peers) >= depth:
            break
    where = {p.peer_id: rng.randrange(regions) for p in peers}
    where[CLIENT] = 0
    between = {(a, b): rng.uniform(0.010, 0.040) for a in range(regions) for b in range(a + 1, regions)}
    links = {}
    for a in where:
        for b in where:
            if a != b:
                ra, rb = sorted((where[a], where[b]))
                links[(a, b)] = rng.uniform(0.0005, 0.0015) if ra == rb else between[(ra, rb)]
    return peers, links
