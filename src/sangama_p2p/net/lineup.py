"""Which peers of one model id may be chained together: those of one checkpoint fingerprint. Pure.

Every serving record carries the fingerprint of the peer's checkpoint and the model's depth taken from it (see
:mod:`sangama_p2p.model.fingerprint`). Peers that announce one model id may still serve different checkpoints, so a
client (and ``sangama-peer status``) sorts the offers of a model id into one *lineup*:

1. A peer announcing layers beyond its own checkpoint's depth (``end > num_layers``) is left out.
2. Offers are grouped by fingerprint. A group's depth is the client's own (``ClientConfig.num_layers``: from its
   checkpoint, or the depth of an explicit ``--fingerprint FP:LAYERS``) when it has one: never a vote, so records
   claiming another depth cannot exclude honest peers. Without one it is the depth most of the group's peers
   announce (ties: the smaller). A peer announcing another depth than its group's is left out (one of them lies).
3. With a local checkpoint's fingerprint (``generate --model DIR``, or the client's own stage), every other group is
   left out.
4. Of the groups left, the winner is the one whose ranges chain from layer 0 to its depth; then the one with
   most peers; then the highest announced throughput in total; then the smallest fingerprint (deterministic).
   Every peer of another group is left out, with the reason.

Peers of the winner that hold the same part (a layer, ``embed``, ``head``) with different content hashes are
reported as ``conflicts``: one of them serves other weights under the same metadata, and nothing here can tell which.

Usage::

    lineup = choose_lineup(offers, local_fingerprint=None)   # offers: ServingRecord or client RouteCandidate
    lineup.members, lineup.num_layers                        # chain only these; the model's depth
    for out in lineup.left_out: print(out.peer_id, out.reason)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

__all__ = ["Conflict", "LeftOut", "Lineup", "choose_lineup", "covers"]


class _Serving(Protocol):
    """What a lineup reads of a peer serving layers: a :class:`~.records.ServingRecord` or a client's
    :class:`~sangama_p2p.client.routing.RouteCandidate` (``throughput`` in steps per second of one session)."""

    peer_id: str
    start: int
    end: int
    throughput: float
    fingerprint: str
    num_layers: int


T = TypeVar("T", bound=_Serving)


@dataclass(frozen=True)
class LeftOut:
    """A peer not chained, and why."""

    peer_id: str
    start: int
    end: int
    fingerprint: str
    num_layers: int
    reason: str


@dataclass(frozen=True)
class Conflict:
    """Peers of the chosen fingerprint that hold ``part`` with different content: hash -> peer ids."""

    part: str
    hashes: tuple[tuple[str, tuple[str, ...]], ...]


@dataclass(frozen=True)
class Lineup(Generic[T]):
    """The chosen fingerprint (None: no usable peer), the model's depth from it (0: none), its peers, the rest."""

    fingerprint: str | None
    num_layers: int
    members: tuple[T, ...]
    left_out: tuple[LeftOut, ...]
    conflicts: tuple[Conflict, ...] = ()


def covers(ranges: Sequence[tuple[int, int]], num_layers: int) -> bool:
    """Whether ranges joined end to start lead from layer 0 to ``num_layers`` (a chain exists)."""
    reached = {0}
    for start, end in sorted(ranges):
        if start in reached and end <= num_layers:
            reached.add(end)
    return num_layers in reached


def _short(fp: str) -> str:
    return fp[:12]


def _out(o: _Serving, reason: str) -> LeftOut:
    return LeftOut(o.peer_id, o.start, o.end, o.fingerprint, o.num_layers, reason)


def choose_lineup(offers: Sequence[T], *, local_fingerprint: str | None = None,
                  num_layers: int | None = None) -> Lineup[T]:
    """Sort ``offers`` of one model id into the peers to chain and the ones left out (module docstring)."""
    left: list[LeftOut] = []
    groups: dict[str, list[T]] = {}
    for o in offers:
        if o.num_layers <= 0 or o.end > o.num_layers:
            left.append(_out(o, f"announces layers {o.start}:{o.end} beyond its checkpoint's {o.num_layers} layers"))
        else:
            groups.setdefault(o.fingerprint, []).append(o)
    depths: dict[str, int] = {}
    for fp, members in groups.items():
        if num_layers is not None:  # the client's own checkpoint says: never a vote of the records
            depth, why = num_layers, f"the client's checkpoint has {num_layers}"
        else:
            counts = Counter(o.num_layers for o in members)
            depth = min(counts, key=lambda d: (-counts[d], d))
            why = f"the other peers of fingerprint {_short(fp)} announce {depth}"
        depths[fp] = depth
        for o in [o for o in members if o.num_layers != depth]:
            left.append(_out(o, f"announces {o.num_layers} layers, but {why}"))
        groups[fp] = [o for o in members if o.num_layers == depth]
    groups = {fp: members for fp, members in groups.items() if members}
    eligible = dict(groups)
    for fp in list(eligible):
        why = None
        if local_fingerprint is not None and fp != local_fingerprint:
            why = f"fingerprint {_short(fp)} differs from the local checkpoint's {_short(local_fingerprint)}"
        if why is not None:
            left += [_out(o, why) for o in eligible.pop(fp)]

    def rank(fp: str) -> tuple[Any, ...]:
        members = eligible[fp]
        full = covers([(o.start, o.end) for o in members], depths[fp])
        return (not full, -len(members), -sum(max(o.throughput, 0.0) for o in members), fp)

    if not eligible:
        return Lineup(None, 0, (), tuple(left))
    winner = min(eligible, key=rank)
    full = covers([(o.start, o.end) for o in eligible[winner]], depths[winner])
    for fp in sorted(eligible):
        if fp != winner:
            why = (f"another checkpoint serves this model id: fingerprint {_short(fp)}, not the chosen "
                   f"{_short(winner)} ({len(eligible[winner])} peers{', covering the model' if full else ''})")
            left += [_out(o, why) for o in eligible[fp]]
    members = tuple(sorted(eligible[winner], key=lambda o: (o.start, o.end, o.peer_id)))
    return Lineup(winner, depths[winner], members, tuple(sorted(left, key=lambda x: (x.start, x.end, x.peer_id))),
                  _conflicts(members))


def _conflicts(members: Sequence[_Serving]) -> tuple[Conflict, ...]:
    held: dict[str, dict[str, list[str]]] = {}  # part -> hash -> peers
    for o in members:
        for part, digest in getattr(o, "layer_hashes", ()):
            held.setdefault(part, {}).setdefault(digest, []).append(o.peer_id)
    out = []
    for part, by_hash in held.items():
        if len(by_hash) > 1:
            out.append(Conflict(part, tuple(sorted((h, tuple(sorted(p))) for h, p in by_hash.items()))))
    return tuple(sorted(out, key=lambda c: (not c.part.isdigit(), int(c.part) if c.part.isdigit() else 0, c.part)))
