"""Choosing ranges: :func:`place` (chains sized by speed, then local search) and a Petals-style greedy baseline.
Pure.

:func:`place`, on the block grid of :mod:`~sangama_p2p.placement.grid`:

1. **Starts.** For every number of chains ``k`` (1 .. peers): deal the peers, fastest first, to the chain with the
   least speed so far (``1 / layer_s`` summed); merge a chain whose memory cannot hold the model into the weakest
   other; in each chain give every peer blocks in proportion to its speed under its memory (the largest bottleneck
   capacity an integer split allows; peers left with no block stay idle, so the chain has fewer hops); order each
   chain's peers for the least trip (every order up to 6 peers, nearest neighbour from the client beyond). The
   Petals-style greedy is one more start.
2. **Local search** from the best few starts, first improvement of the score until none helps: move one peer to
   any range or to idle; move the boundary between two peers that meet by one block; swap two peers' ranges; move
   a boundary for every peer that starts or ends on it (5,000 scores at most per start).
3. **Kicks** (iterated local search): 40 times, two random peers (seeded: the answer is deterministic) get random
   ranges and the result is polished; kept when it scores more.

Beyond 16 peers: chain counts 1..16 and n/2, n/4, n/6, n/8, only the best start polished, ``100000 / n`` scores,
no kicks (a few seconds for a few hundred peers).
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence

from .grid import Grid, State
from .model import CLIENT, DEFAULT_LINK_S, DEFAULT_SESSIONS, Links, PeerSpec

__all__ = ["petals_greedy", "place"]

_STARTS_SEARCHED = 3  # best starts polished by local search
_KICKS = 40  # random two-peer changes tried from the best state, each polished
_SMALL = 16  # up to this many peers: every chain count, several starts, kicks; beyond, a budget
_EXHAUSTIVE_ORDER = 6  # chains up to this many peers are ordered by trying every order


def _greedy_state(grid: Grid) -> State:
    g = grid.blocks
    cover = [0.0] * g
    state: list[tuple[int, int] | None] = [None] * len(grid.peers)
    for i, _ in enumerate(grid.peers):
        spans = [(a, b) for (a, b) in grid.options[i] if b - a == max(bb - aa for aa, bb in grid.options[i])]
        if not spans:
            continue
        a, b = min(spans, key=lambda s: (sorted(cover[s[0]:s[1]]), s[0]))
        state[i] = (a, b)
        for k in range(a, b):
            cover[k] += grid.capacity(i, a, b)
    return tuple(state)


def petals_greedy(peers: Sequence[PeerSpec], links: Links, depth: int, *, blocks: int = 8,
                  sessions: int = DEFAULT_SESSIONS, default_link: float = DEFAULT_LINK_S) -> dict[str, tuple[int, int]]:
    """The baseline (Petals' ``choose_best_blocks``): peers join in the given order, each takes as many blocks as
    its memory holds, at the span whose per-block throughput (sum of the covering peers' capacities), sorted, is
    least. Speeds and links do not move the span, only what it adds."""
    grid = Grid(peers, links, depth, blocks, sessions, default_link)
    return grid.assignment(_greedy_state(grid))


def _split(grid: Grid, members: list[int]) -> dict[int, int]:
    """Blocks per member: the largest bottleneck capacity an integer split of the grid allows, under memory."""
    g, unit = grid.blocks, grid.depth / grid.blocks
    cap = {i: max((b - a for a, b in grid.options[i]), default=0) for i in members}
    speed = {i: 1.0 / grid.peers[i].layer_s for i in members}

    def counts(f: float) -> dict[int, int]:
        return {i: min(cap[i], int(speed[i] / (f * unit) + 1e-9)) for i in members}

    candidates = sorted({speed[i] / (n * unit) for i in members for n in range(1, cap[i] + 1)}, reverse=True)
    for f in candidates:
        n = counts(f)
        if sum(n.values()) >= g:
            break
    else:
        return {}
    extra = sum(n.values()) - g
    for i in sorted(members, key=lambda i: speed[i]):  # trim the slowest first: whole peers off means fewer hops
        take = min(extra, n[i])
        n[i] -= take
        extra -= take
    return {i: k for i, k in n.items() if k > 0}


def _order(grid: Grid, members: list[int]) -> list[int]:
    ids = [grid.peers[i].peer_id for i in members]
    link = grid.link

    def trip(order: Sequence[int]) -> float:
        path = [CLIENT] + [ids[k] for k in order] + [CLIENT]
        return sum(link(a, b) for a, b in itertools.pairwise(path))

    if len(members) <= _EXHAUSTIVE_ORDER:
        best = min(itertools.permutations(range(len(members))), key=trip)
    else:
        best, here, left = [], CLIENT, set(range(len(members)))
        while left:
            k = min(left, key=lambda k: (link(here, ids[k]), k))
            best.append(k)
            left.discard(k)
            here = ids[k]
    return [members[k] for k in best]


def _chains_state(grid: Grid, k: int) -> State | None:
    usable = sorted((i for i in range(len(grid.peers)) if grid.options[i]), key=lambda i: grid.peers[i].layer_s)
    chains: list[list[int]] = [[] for _ in range(k)]
    heap = [(0.0, c) for c in range(k)]  # (speed so far, chain)
    for i in usable:
        speed, c = heapq.heappop(heap)
        chains[c].append(i)
        heapq.heappush(heap, (speed + 1.0 / grid.peers[i].layer_s, c))

    def holds(c: list[int]) -> int:
        return sum(max(b - a for a, b in grid.options[j]) for j in c)

    chains = [c for c in chains if c]
    while len(chains) > 1 and any(holds(c) < grid.blocks for c in chains):
        short = min((c for c in chains if holds(c) < grid.blocks), key=lambda c: sum(1.0 / grid.peers[j].layer_s
                                                                                    for j in c))
        chains.remove(short)
        min(chains, key=lambda c: sum(1.0 / grid.peers[j].layer_s for j in c)).extend(short)
    state: list[tuple[int, int] | None] = [None] * len(grid.peers)
    for c in chains:
        n = _split(grid, c)
        at = 0
        for i in _order(grid, list(n)):
            if not grid.fits(i, at, at + n[i]):
                return None
            state[i] = (at, at + n[i])
            at += n[i]
    return tuple(state) if any(s is not None for s in state) else None


def _neighbours(grid: Grid, state: State):
    n = len(state)
    for i in range(n):
        for r in [*grid.options[i], None]:
            if r != state[i]:
                yield state[:i] + (r,) + state[i + 1:]
    for i, j in itertools.permutations(range(n), 2):
        ri, rj = state[i], state[j]
        if ri and rj and ri[1] == rj[0]:
            for d in (-1, 1):
                b = ri[1] + d
                if ri[0] < b < rj[1] and grid.fits(i, ri[0], b) and grid.fits(j, b, rj[1]):
                    s = list(state)
                    s[i], s[j] = (ri[0], b), (b, rj[1])
                    yield tuple(s)
    for i, j in itertools.combinations(range(n), 2):
        ri, rj = state[i], state[j]
        if ri != rj and (ri is None or grid.fits(j, *ri)) and (rj is None or grid.fits(i, *rj)):
            s = list(state)
            s[i], s[j] = rj, ri
            yield tuple(s)
    for b in range(1, grid.blocks):
        for d in (-1, 1):
            s = [(r[0] + d if r[0] == b else r[0], r[1] + d if r[1] == b else r[1]) if r else None for r in state]
            if s != list(state) and all(r is None or grid.fits(i, *r) for i, r in enumerate(s)):
                yield tuple(s)


def _polish(grid: Grid, state: State, max_evals: int) -> State:
    """First improvement until no neighbour scores more or ``max_evals`` scores were computed; a small swarm's
    scans go on from where the last one improved (a large one's are lazy: its pairs alone are many)."""
    best = grid.evaluate(state).served
    evals, at = 0, 0
    small = len(state) <= _SMALL
    while evals < max_evals:
        if small:
            moves = list(_neighbours(grid, state))
            scan = (moves[(at + k) % len(moves)] for k in range(len(moves)))
        else:
            scan = _neighbours(grid, state)
        for k, cand in enumerate(scan):
            evals += 1
            x = grid.evaluate(cand).served
            if x > best * (1 + 1e-12):
                state, best, at = cand, x, at + k
                break
            if evals >= max_evals:
                return state
        else:
            return state
    return state


def place_state(grid: Grid, max_evals: int | None = None) -> State:
    """:func:`place` on a grid, returning the state."""
    n = len(grid.peers)
    counts = range(1, n + 1) if n <= _SMALL else sorted({*range(1, _SMALL + 1), *(n // c for c in (2, 4, 6, 8))})
    starts = {s for k in counts if (s := _chains_state(grid, k)) is not None}
    starts.add(_greedy_state(grid))
    ranked = sorted(starts, key=lambda s: -grid.evaluate(s).served)[:_STARTS_SEARCHED if n <= _SMALL else 1]
    budget = max_evals if max_evals is not None else (5_000 if n <= _SMALL else max(200, 100_000 // n))
    polished = [_polish(grid, s, budget) for s in ranked]
    best = max(polished, key=lambda s: grid.evaluate(s).served)
    rng = random.Random(0)
    for _ in range(_KICKS if n <= _SMALL else 0):
        cand = list(best)
        for i in rng.sample(range(n), min(2, n)):
            cand[i] = rng.choice([*grid.options[i], None])
        cand = _polish(grid, tuple(cand), budget)
        if grid.evaluate(cand).served > grid.evaluate(best).served * (1 + 1e-12):
            best = cand
    return best


def place(peers: Sequence[PeerSpec], links: Links, depth: int, *, blocks: int = 8, sessions: int = DEFAULT_SESSIONS,
          default_link: float = DEFAULT_LINK_S, max_evals: int | None = None) -> dict[str, tuple[int, int]]:
    """Each peer's range ``{peer id: (start, end)}`` (idle peers left out) that serves the most under
    :func:`~sangama_p2p.placement.score`, ranges on the block grid (module docstring). ``max_evals`` bounds the
    local search per start (scores computed; by default ``max(2000, 200000 / peers)``)."""
    grid = Grid(peers, links, depth, blocks, sessions, default_link)
    return grid.assignment(place_state(grid, max_evals))
