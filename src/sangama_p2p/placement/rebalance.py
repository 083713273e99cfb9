"""Rebalancing: which range a serving peer takes at join, and whether it moves later. Pure.

Inputs are the ``(start, end)`` ranges the *other* live peers of the same checkpoint serve, the model's depth and
the span this peer may serve (and, to move, its own range). Chains are built from whole ranges that meet end to
start, so both choices keep to existing boundaries.

* :func:`thinnest_range` (what ``join --layers auto`` takes): the first layer nobody serves and up to ``span``
  layers from it, never past the gap; with no gap, the ``span``-window at an existing boundary whose least-served
  layer has the fewest peers, then the fewest peers per layer, then the lowest start - or, given the peers'
  announced speeds (what join passes), first the windows serving at most twice the thinnest one's steps per
  second (the bottleneck of the chains clients build; closer speeds count as equal, being noisy), then by peers.
* :func:`first_mover`: several spares often see the same gap at once; the one with the lowest peer id among
  those that would make the same move goes first, the others hold back (a bounded number of re-checks, see
  :mod:`sangama_p2p.stage.rebalance`), so two spares do not both leave a range and open a new gap.
* :func:`choose_move` (what a peer that joined with ``auto`` re-checks): move only when its own range stays served
  by the others without it (a move never opens a gap to close another), and either some layer is served by nobody
  (move to :func:`thinnest_range`: the first gap) or, with no gap, its range is clearly over-served next to the
  thinnest window (every layer of it has at least ``margin`` more other peers than that window's least-served
  layer; with the default 2, the move cannot be undone by the same rule, so peers never swing back and forth).

Usage::

    choose_move([(0, 3), (6, 8)], mine=(0, 3), num_layers=8, span=3)   # (3, 6): the 3:6 peer left
    choose_move([(3, 6), (6, 8)], mine=(0, 3), num_layers=8, span=3)   # None: leaving 0:3 opens a gap
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["choose_move", "first_mover", "layer_capacity", "layer_counts", "thinnest_range"]

Range = tuple[int, int]
SPEED_TIE = 2.0  # served steps/s within this factor of the thinnest window's count as equally thin


def layer_counts(covered: Sequence[Range], num_layers: int) -> list[int]:
    """How many of ``covered`` serve each layer ``0 .. num_layers - 1`` (ranges are clipped to the model)."""
    count = [0] * num_layers
    for start, end in covered:
        for i in range(max(start, 0), min(end, num_layers)):
            count[i] += 1
    return count


def _check(num_layers: int, span: int) -> None:
    if num_layers <= 0:
        raise ValueError("the model has no layers")
    if not 0 < span <= num_layers:
        raise ValueError(f"span must be in 1..{num_layers}, got {span}")


def layer_capacity(covered: Sequence[Range], speeds: Sequence[float], num_layers: int) -> list[float]:
    """The steps per second the swarm serves each layer with: the sum of the announced speeds of the ranges that
    hold it (parallel chains add up). A speed of 0 (not measured yet) counts as the lower median of the measured,
    or 1 when none is."""
    known = sorted(v for v in speeds if v > 0)
    fill = known[(len(known) - 1) // 2] if known else 1.0  # the lower median
    cap = [0.0] * num_layers
    for (start, end), v in zip(covered, speeds):
        for i in range(max(start, 0), min(end, num_layers)):
            cap[i] += v if v > 0 else fill
    return cap


def thinnest_range(covered: Sequence[Range], num_layers: int, span: int,
                   speeds: Sequence[float] | None = None) -> Range:
    """Up to ``span`` layers where ``covered`` is thinnest (see the module docstring); with ``speeds`` (each
    range's announced steps/s), the windows whose least-served layer serves at most :data:`SPEED_TIE` x the
    thinnest one's steps/s (:func:`layer_capacity`) come first: a slow peer's range is thinner than a fast one's,
    whatever the peer counts, while speeds within that factor (announced speeds are noisy: 58-425 steps/s measured
    on one loaded stage) count as equal and the peer counts decide. ValueError on a bad depth or span."""
    _check(num_layers, span)
    if speeds is not None and len(speeds) != len(covered):
        raise ValueError(f"{len(speeds)} speeds for {len(covered)} ranges")
    count = layer_counts(covered, num_layers)
    if 0 in count:
        start = count.index(0)
        end = start
        while end < num_layers and end - start < span and count[end] == 0:
            end += 1
        return start, end
    bounds = {0} | {b for r in covered for b in r if 0 <= b < num_layers}

    def window(values: Sequence[float], s: int) -> Sequence[float]:
        return values[s:min(s + span, num_layers)]

    if speeds is not None:
        cap = layer_capacity(covered, speeds, num_layers)
        floor = min(min(window(cap, s)) for s in bounds)
        bounds = {s for s in bounds if min(window(cap, s)) <= SPEED_TIE * floor}

    def key(s: int) -> tuple[int, float, int]:
        w = window(count, s)
        return min(w), sum(w) / len(w), s  # a mean: a window cut short by the model's end is no lighter

    best = min(bounds, key=key)
    return best, min(best + span, num_layers)


def choose_move(others: Sequence[Range], mine: Range, num_layers: int, span: int, *,
                margin: int | None = 2) -> Range | None:
    """The range this peer (serving ``mine``) should move to, or None to stay.

    ``others``: the ranges of the other live peers of this checkpoint (never this peer's own). ``span``: how many
    layers it may serve. ``margin``: how much more served its range must be than the thinnest window for a move
    without a gap (None: move only to close a gap). Deterministic: the same inputs give the same answer.
    """
    _check(num_layers, span)
    start, end = mine
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"bad range {start}:{end} for a model of {num_layers} layers")
    count = layer_counts(others, num_layers)
    held = count[start:end]
    if min(held) == 0:
        return None  # we are the only peer of some layer: leaving would open a gap
    target = thinnest_range(others, num_layers, span)
    if target == mine:
        return None
    if 0 in count:
        return target  # a layer nobody serves, and our own range stays served without us
    if margin is None:
        return None
    if min(held) >= min(count[target[0]:target[1]]) + margin:
        return target  # we are a spare of a well-served range while another range has few peers
    return None


def first_mover(me: str, mine: Range, others: Mapping[str, Range], num_layers: int, span: int, *,
                margin: int | None = 2) -> bool:
    """Whether ``me`` (serving ``mine``; ``others``: peer id -> range of every other live peer) goes first among
    the peers that would make the same move now: no other peer with a lower id would move to the same range from
    where it is (each judged with this peer's ``span``). True when ``me`` would not move at all."""
    target = choose_move(list(others.values()), mine, num_layers, span, margin=margin)
    if target is None:
        return True
    for peer, theirs in others.items():
        if peer >= me:
            continue
        rest = [r for q, r in others.items() if q != peer] + [mine]
        if choose_move(rest, theirs, num_layers, span, margin=margin) == target:
            return False
    return True
