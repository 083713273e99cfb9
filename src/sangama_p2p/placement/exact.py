"""The exact optimum of the cost model on the block grid, by branch and bound. Pure; meant for small swarms (8 peers).

The space is every state of :mod:`~sangama_p2p.placement.grid`: each peer idle or on any grid-aligned range its
memory holds, the same space :func:`~sangama_p2p.placement.place` searches. Nothing is sampled; a part of the space
is skipped only when a bound proves no state in it scores more than the best found so far (``place``'s answer is
the first "best so far"; it only makes the bounds bite sooner). The enumeration has two levels:

1. **The best chain.** Every state that covers the model has a chain of least trip time ``L*``. Enumerate chains
   (distinct peers, ranges meeting from block 0 to the last block), cutting a prefix when even a best case for the
   rest - the remaining layers at the fastest unused peer's speed, the cheapest next link and way back, and the
   fluid bound on throughput (every peer's speed, whole, shared evenly by the blocks) - cannot beat the best.
2. **The other peers**, for each such chain: each idle or on any range, cut when ``S / (L + (S - 1) / F_up)``, with
   ``L`` the chain's trip time, is no better than the best; ``F_up`` is the water level reached when the
   unplaced peers' capacity (at most ``1 / (smallest block * layer_s)`` summed over blocks each) is poured onto the
   per-block capacity of the placed peers (per-block sums bound the max flow; see ``model``).

A state whose best chain is ``C`` has trip time ``L(C)`` and is reached under ``C`` with a valid bound, so it is
never cut unless it cannot win; under other chains it may be cut, which does no harm.
"""

from __future__ import annotations

from collections.abc import Sequence

from .grid import Grid, State
from .model import CLIENT, DEFAULT_LINK_S, DEFAULT_SESSIONS, Links, PeerSpec
from .search import place_state

__all__ = ["brute_force", "brute_force_state"]


def _water(cover: Sequence[float], mass: float) -> float:
    """The highest level ``w`` with ``sum(max(0, w - c))`` over ``cover`` at most ``mass``."""
    cs = sorted(cover)
    acc = 0.0
    for k, c in enumerate(cs, 1):
        acc += c
        level = (mass + acc) / k
        if k == len(cs) or level <= cs[k]:
            return level
    return mass  # no blocks (not reached)


def brute_force_state(grid: Grid) -> tuple[State, int]:
    """The best state on ``grid`` and how many complete states were scored."""
    n, g, s = len(grid.peers), grid.blocks, grid.sessions
    ids = [p.peer_id for p in grid.peers]
    link = grid.link
    best_state = place_state(grid)
    best = [grid.evaluate(best_state).served, best_state]
    small = min(grid.layers(k, k + 1) for k in range(g))
    mass = [1.0 / (small * p.layer_s) for p in grid.peers]
    fluid = sum(m for i, m in enumerate(mass) if grid.options[i]) / g
    back = min((link(i, CLIENT) for i in ids), default=0.0)
    scored = [0]

    def bound(latency: float, flow: float) -> float:
        return s / (latency + (s - 1) / flow) if flow > 0 else 0.0

    state: list[tuple[int, int] | None] = [None] * n

    def others(rest: list[int], r: int, cover: list[float], left: float, latency: float) -> None:
        if bound(latency, _water(cover, left)) <= best[0]:
            return
        if r == len(rest):
            scored[0] += 1
            x = grid.evaluate(tuple(state)).served
            if x > best[0]:
                best[0], best[1] = x, tuple(state)
            return
        i = rest[r]
        for a, b in grid.options[i]:
            c = grid.capacity(i, a, b)
            for k in range(a, b):
                cover[k] += c
            state[i] = (a, b)
            others(rest, r + 1, cover, left - mass[i], latency)
            for k in range(a, b):
                cover[k] -= c
        state[i] = None
        others(rest, r + 1, cover, left - mass[i], latency)

    def chain(at: int, last: str, used: list[int], latency: float) -> None:
        if at == g:
            latency += link(last, CLIENT)
            cover = [0.0] * g
            for i in used:
                a, b = state[i]
                for k in range(a, b):
                    cover[k] += grid.capacity(i, a, b)
            rest = sorted((i for i in range(n) if i not in used), key=lambda i: -mass[i])
            others(rest, 0, cover, sum(mass[i] for i in rest), latency)
            return
        free = [i for i in range(n) if i not in used and grid.options[i]]
        if not free:
            return
        least = (latency + min(link(last, ids[i]) for i in free)
                 + (grid.depth - grid.bounds[at]) * min(grid.peers[i].layer_s for i in free) + back)
        if bound(least, fluid) <= best[0]:
            return
        for i in free:
            for a, b in grid.options[i]:
                if a == at:
                    state[i] = (a, b)
                    used.append(i)
                    comp = grid.layers(a, b) * grid.peers[i].layer_s
                    chain(b, ids[i], used, latency + link(last, ids[i]) + comp)
                    used.pop()
                    state[i] = None

    chain(0, CLIENT, [], 0.0)
    return best[1], scored[0]


def brute_force(peers: Sequence[PeerSpec], links: Links, depth: int, *, blocks: int = 8,
                sessions: int = DEFAULT_SESSIONS, default_link: float = DEFAULT_LINK_S) -> dict[str, tuple[int, int]]:
    """The assignment of the highest :func:`~sangama_p2p.placement.score` among all on the block grid (exhaustive
    with exact cuts; module docstring). Exponential in the number of peers: for checking ``place`` on small swarms."""
    grid = Grid(peers, links, depth, blocks, sessions, default_link)
    return grid.assignment(brute_force_state(grid)[0])
