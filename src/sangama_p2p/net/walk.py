"""Surveys over the range directories (:mod:`.directory`): the walk from layer 0 that a client's survey makes, one
lookup per range boundary, and the one lookup of a stage's successors."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import trio
from libp2p.peer.id import ID

from .dial import remember
from .directory import PER_RANGE, DirectoryFacts, choose_candidates, directory_from_network, directory_key
from .node import Node
from .records import ServingRecord

__all__ = ["MAX_WALK", "find_starting_at", "walk_directories"]


async def find_starting_at(node: Node, model_id: str, start: int, *, fingerprint: str | None = None,
                           limit: int = PER_RANGE, keep: Collection[str] = ()) -> list[ServingRecord]:
    """At most ``limit`` peers whose range starts at layer ``start`` (other than us), from one directory lookup (a
    stage's successors): those in ``keep`` still there first (a stage measuring the same successors publishes no new
    set each round), the rest chosen as a survey chooses candidates. None where no directory was found (a DHT of
    go-libp2p servers keeps none): enumerating every peer's record instead cost a loaded 60-peer swarm more than
    the measurement it served."""
    entries = await directory_from_network(node, directory_key(model_id, start))
    me = node.peer_id.to_base58()
    records = [r for r, _ in entries if r.peer_id != me and (fingerprint is None or r.fingerprint == fingerprint)]
    kept = sorted((r for r in records if r.peer_id in keep), key=lambda r: r.peer_id)[:limit]
    rest = [r for r in records if r.peer_id not in keep]
    return kept + choose_candidates(rest, per_range=limit)[:limit - len(kept)]


MAX_WALK = 64  # directory lookups one survey makes at most
GAP_BATCH = 8  # directory lookups at once past a layer that no record found covers


async def walk_directories(node: Node, model_id: str, *, fingerprint: str | None, facts: Any,
                           usable: Callable[[ServingRecord], bool] | None, per_range: int,
                           num_layers: int) -> list[ServingRecord]:
    """The candidates of the directories from layer 0 on: each directory's ranges name the next ones, and where no
    range found covers a layer (a gap: its only peer left, or nobody came yet), the walk goes on past it through the
    next :data:`GAP_BATCH` start layers at a time, so that what serves after a gap is found by at most one lookup per
    layer (a spare deciding where to go, a client waiting for one), never by asking every peer. Where layer 0 and the
    first batch past it hold no entry at all (of any checkpoint), it stops: nobody serves the model (or the DHT keeps
    no directories), and a model of 60 layers must not cost 60 lookups to say so. A peer found in two directories (it
    moved: its old entry stays until its record expires) counts with its newest record only."""
    lookup, looked, todo = DirectoryFacts(), set(), {0}
    newest: dict[str, ServingRecord] = {}
    seen_any = False  # an entry of any checkpoint in any directory looked up so far
    while len(looked) < MAX_WALK:
        if not todo and (seen_any or looked == {0}):  # (nothing at layer 0 nor one batch past it: nobody serves)
            todo = _past_gap(newest, looked, num_layers)
        if not todo:
            break
        batch = sorted(todo)[:MAX_WALK - len(looked)]
        looked.update(batch)
        found: list[ServingRecord] = []

        async def one(start: int) -> None:
            entries = await directory_from_network(node, directory_key(model_id, start), facts=lookup)
            found.extend(r for r, _ in entries if r.start == start)

        async with trio.open_nursery() as nursery:
            for start in batch:
                nursery.start_soon(one, start)
        seen_any = seen_any or bool(found)
        for record in found:
            old = newest.get(record.peer_id)
            if (fingerprint is None or record.fingerprint == fingerprint) and (
                    old is None or (record.seq, record.expires_at) > (old.seq, old.expires_at)):
                newest[record.peer_id] = record
        todo = {r.end for r in newest.values() if r.end < (num_layers or r.num_layers)} - looked
    records = [r for r in newest.values() if usable is None or usable(r)]
    chosen = choose_candidates(records, per_range=per_range)
    for record in chosen:
        remember(node, ID.from_base58(record.peer_id), record.addrs)
    facts.directories = lookup.lookups
    facts.asked = len(lookup.asked)
    facts.answered = facts.replied = len(lookup.replied)
    facts.contacted.update(p.to_base58() for p in lookup.asked)
    facts.providers = facts.records = len(newest)
    facts.candidates = len(chosen)
    return chosen


def _past_gap(records: dict[str, ServingRecord], looked: set[int], num_layers: int) -> set[int]:
    """The next start layers to look up past the first layer that no record of ``records`` covers: up to
    :data:`GAP_BATCH` uncovered ones not ``looked`` up yet (empty: no gap, or no depth known)."""
    depth = num_layers or max((r.num_layers for r in records.values()), default=0)
    covered = {i for r in records.values() for i in range(r.start, min(r.end, depth))}
    return set([i for i in range(depth) if i not in covered and i not in looked][:GAP_BATCH])
