"""Placement: which contiguous range of layers each peer serves, so that the swarm serves the most. Pure.

Given the peers (memory in layers, measured seconds per layer per step), their measured one-way links and the
model's depth, :func:`place` chooses each peer's range ``[start, end)``; :func:`score` is the cost model it
maximises (:mod:`~sangama_p2p.placement.model`: the max-flow throughput of the chains and the best chain's latency,
as what ``sessions`` concurrent generations get); :func:`brute_force` is its exact optimum on the same block grid,
for small swarms; :func:`petals_greedy` is the Petals-style baseline. Nothing here does I/O or reads a clock: the
stage side (what to serve, when to move) and the client call it with what they measured.

Usage::

    peers = [PeerSpec("a", max_layers=16, layer_s=0.002), PeerSpec("b", 16, 0.003), PeerSpec("c", 32, 0.004)]
    links = {("a", "b"): 0.001, ("b", "a"): 0.001}      # one-way seconds; missing pairs cost DEFAULT_LINK_S
    ranges = place(peers, links, depth=32)              # {"a": (0, 16), "b": (16, 32), "c": (0, 32)} or similar
    score(ranges, peers, links, 32).served              # steps/s that 8 concurrent generations get
"""

from .exact import brute_force
from .grid import random_swarm
from .model import CLIENT, DEFAULT_LINK_S, DEFAULT_SESSIONS, PeerSpec, Score, score
from .search import petals_greedy, place

__all__ = ["CLIENT", "DEFAULT_LINK_S", "DEFAULT_SESSIONS", "PeerSpec", "Score", "brute_force", "petals_greedy",
           "place", "random_swarm", "score"]
