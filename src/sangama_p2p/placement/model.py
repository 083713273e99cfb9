"""The placement cost model: what an assignment of layer ranges to peers serves. Pure (no I/O, no clock).

An *assignment* maps a peer id to the range ``(start, end)`` of layers it serves; a peer not in it serves nothing.
Each peer ``p`` has a measured compute time per layer per step ``layer_s`` and holds at most ``max_layers``
layers. Links are measured one-way latencies in seconds per ordered pair of ids (:data:`CLIENT`, ``""``, is the
client, as in :mod:`sangama_p2p.client.routing`); a pair not measured costs ``default_link``, a peer to itself 0.

What an assignment serves (:func:`score`), three numbers:

- **throughput** ``F`` (steps/s): a peer serving ``n`` layers computes ``1 / (n * layer_s)`` steps per second. Chains
  are paths from layer 0 to layer ``depth`` through peers whose ranges meet exactly (a stage serves exactly its
  range, as routing assumes), and peers shared by several chains divide their capacity: ``F`` is the maximum flow
  from boundary 0 to boundary ``depth`` in the graph whose nodes are layer boundaries and whose edges are the
  serving peers, with their capacities. (Per-layer "sum of the peers covering it", Petals' measure, is only an
  upper bound: ``A 0:2, C 1:3`` covers layer 1 twice and carries nothing.)
- **latency** ``L`` (s per step): the best chain's trip, client -> stages -> client, i.e. the sum of its link
  latencies and of its stages' compute ``n * layer_s`` (routing's ``chain_cost`` with no queue).
- **served** ``X`` (steps/s, the score): what ``S = sessions`` concurrent generations get, each with one trip in
  flight (a decode step needs the previous token): ``X = S / (L + (S - 1) / F)``. This is the balanced-job bound of
  a closed queueing network: each trip takes the best chain's latency plus, at worst, the bottleneck's time for the
  other ``S - 1`` sessions' steps. It is exact at both ends - one session gets ``1 / L``, many get ``F`` - so it
  weighs latency where few sessions run and throughput where many do, in one number with no arbitrary weight.
  ``X = 0`` when no chain covers the model.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["CLIENT", "DEFAULT_LINK_S", "DEFAULT_SESSIONS", "Assignment", "Links", "PeerSpec", "Score", "score"]

CLIENT = ""
"""The client's name in links (as in :mod:`sangama_p2p.client.routing`)."""
DEFAULT_LINK_S = 0.025  # one-way seconds for a pair nobody measured (routing assumes a 50 ms round trip)
DEFAULT_SESSIONS = 8  # concurrent generations the score is for

Assignment = Mapping[str, tuple[int, int]]
Links = Mapping[tuple[str, str], float]


@dataclass(frozen=True)
class PeerSpec:
    """A peer as placement sees it: how many layers its memory holds and its measured seconds per layer per step."""

    peer_id: str
    max_layers: int
    layer_s: float

    def __post_init__(self) -> None:
        if not self.peer_id or self.max_layers < 0 or not self.layer_s > 0:
            raise ValueError(f"bad peer spec {self!r}: needs an id, max_layers >= 0 and layer_s > 0")

    @classmethod
    def from_bytes(cls, peer_id: str, memory_bytes: int, bytes_per_layer: int, layer_s: float) -> PeerSpec:
        """A peer whose memory budget is in bytes: it holds ``memory_bytes // bytes_per_layer`` layers."""
        return cls(peer_id, int(memory_bytes // bytes_per_layer), layer_s)


@dataclass(frozen=True)
class Score:
    """What an assignment serves (module docstring): ``served`` is the score, ``throughput`` the max flow in
    steps/s, ``latency`` the best chain's seconds per step, ``chain`` that chain's peer ids in order."""

    served: float
    throughput: float
    latency: float
    chain: tuple[str, ...] = ()


def link_of(links: Links, default_link: float):
    """``link(a, b)``: one-way seconds from ``a`` to ``b`` (0 to itself, ``default_link`` where not measured)."""

    def link(a: str, b: str) -> float:
        return 0.0 if a == b else links.get((a, b), default_link)

    return link


def max_flow(edges: Mapping[tuple[int, int], float], source: int, sink: int) -> float:
    """Maximum flow from ``source`` to ``sink`` over edges ``(u, v) -> capacity`` (Edmonds-Karp)."""
    res: dict[int, dict[int, float]] = {}
    for (u, v), c in edges.items():
        res.setdefault(u, {})[v] = res.setdefault(u, {}).get(v, 0.0) + c
        res.setdefault(v, {}).setdefault(u, 0.0)
    if source not in res or sink not in res:
        return 0.0
    eps = 1e-12 * max(edges.values())
    total = 0.0
    while True:
        parent = {source: source}
        queue = deque([source])
        while queue and sink not in parent:
            u = queue.popleft()
            for v, c in res[u].items():
                if c > eps and v not in parent:
                    parent[v] = u
                    queue.append(v)
        if sink not in parent:
            return total
        push, v = math.inf, sink
        while v != source:
            push = min(push, res[parent[v]][v])
            v = parent[v]
        v = sink
        while v != source:
            u = parent[v]
            res[u][v] -= push
            res[v][u] += push
            v = u
        total += push


def best_chain(ranges: Sequence[tuple[str, int, int, float]], depth: int, link) -> tuple[float, tuple[str, ...]]:
    """The chain with the least trip time over ``(peer id, start, end, compute seconds)``: client -> stages whose
    ranges meet -> client (``math.inf`` and ``()`` when none covers ``[0, depth)``)."""
    best: dict[int, tuple[float, int]] = {}  # index -> (seconds to have computed its range, previous index or -1)
    ending: dict[int, list[tuple[float, int]]] = {}  # boundary -> (best, index) of the ranges ending there
    ordered: set[int] = set()
    for i in sorted(range(len(ranges)), key=lambda i: ranges[i][1]):
        pid, start, end, comp = ranges[i]
        if start == 0:
            cand = (link(CLIENT, pid) + comp, -1)
        else:
            cand = (math.inf, -1)
            into = ending.get(start, [])
            if start not in ordered:  # every range ending at ``start`` began before it: the list is complete
                into.sort()
                ordered.add(start)
            for before, j in into:
                if before + comp >= cand[0]:
                    break  # links cost >= 0: no later (slower) predecessor can do better
                t = before + link(ranges[j][0], pid) + comp
                if t < cand[0]:
                    cand = (t, j)
        if cand[0] < math.inf:
            best[i] = cand
            ending.setdefault(end, []).append((cand[0], i))
    total, last = math.inf, -1
    for _, j in ending.get(depth, ()):
        t = best[j][0] + link(ranges[j][0], CLIENT)
        if t < total:
            total, last = t, j
    chain = []
    while last >= 0:
        chain.append(ranges[last][0])
        last = best[last][1]
    return total, tuple(chain[::-1])


def served(throughput: float, latency: float, sessions: int) -> float:
    """``S / (L + (S - 1) / F)``, 0 when nothing covers the model."""
    if throughput <= 0 or not math.isfinite(latency):
        return 0.0
    return sessions / (latency + (sessions - 1) / throughput)


def score(assignment: Assignment, peers: Sequence[PeerSpec], links: Links, depth: int, *,
          sessions: int = DEFAULT_SESSIONS, default_link: float = DEFAULT_LINK_S) -> Score:
    """What ``assignment`` serves under the cost model of the module docstring.

    Raises ``ValueError`` for a range outside ``[0, depth)``, an empty one, one over the peer's memory, or an
    unknown peer id.
    """
    if depth <= 0 or sessions < 1:
        raise ValueError(f"depth and sessions must be positive, got {depth}, {sessions}")
    spec = {p.peer_id: p for p in peers}
    ranges, edges = [], {}
    for pid, (start, end) in sorted(assignment.items()):
        p = spec.get(pid)
        if p is None:
            raise ValueError(f"unknown peer {pid!r}")
        if not 0 <= start < end <= depth or end - start > p.max_layers:
            raise ValueError(f"peer {pid!r} cannot serve {start}:{end} (depth {depth}, holds {p.max_layers})")
        comp = (end - start) * p.layer_s
        ranges.append((pid, start, end, comp))
        edges[(start, end)] = edges.get((start, end), 0.0) + 1.0 / comp
    flow = max_flow(edges, 0, depth) if edges else 0.0
    latency, chain = best_chain(ranges, depth, link_of(links, default_link))
    return Score(served(flow, latency, sessions), flow, latency, chain)
