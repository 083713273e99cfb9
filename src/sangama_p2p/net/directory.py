"""Range directories: the signed records of every peer whose range starts at one layer, under one DHT key.

Why (issue 25): a survey that enumerates a model's providers and fetches each one's record dials every serving peer,
so a client's first token cost O(swarm) dials. A directory is the records of the peers of one *start layer*
(``directory_key(model, start)``), each still signed by its author; the DHT servers closest to the key merge what
they are sent (newest record per peer, expired ones dropped, at most :data:`MAX_ENTRIES`), as Petals' DHT keeps one
dictionary per block with a signed entry per server. A client walks the chain's boundaries: the directory of layer 0
names the ranges that start there, their ends name the next directories, and so on, so a survey costs one lookup per
boundary (the number of ranges, not of peers), and it keeps only :data:`PER_RANGE` candidates per range, chosen by
what the records say, to probe.

A peer publishes into one directory (its start) per re-publication: a bounded number of DHT messages whatever the
swarm's size. py-libp2p's ``put_value`` refuses a value the validator does not rank first, and its PUT_VALUE handler
keeps one value per key, so directories are stored by :func:`put_directory` and merged by the DHT store
(:class:`~.dht_store.CappedValueStore`).

Encoding: ``msgpack([DIRECTORY_SCHEMA, [record value, ...]])``; every entry is a record as :func:`~.records.
decode_record` checks it, under its own record key, and must start at the directory's layer.
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import trio
from libp2p.kad_dht.common import BUCKET_SIZE
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.records.record import make_signed_put_record

from .. import clock
from ..errors import RecordError, translate
from .kad_rpc import QUERY_TIMEOUT, closest_servers, kad_request, peer_infos, twice
from .records import MAX_RECORD_BYTES, NAMESPACE, RecordValidator, ServingRecord, decode_record, record_key

__all__ = ["DIRECTORY_SCHEMA", "ENOUGH", "MAX_ENTRIES", "PER_RANGE", "DirectoryFacts", "RecordsAndDirectories",
           "choose_candidates", "decode_directory", "directory_from_network", "directory_key", "encode_directory",
           "is_directory", "merge_directories", "merge_entries", "put_directory", "Closest"]

log = logging.getLogger(__name__)

DIRECTORY_SCHEMA = "sangama/dir/1"
MAX_ENTRIES = 64  # records a directory holds; past it, the ones expiring soonest give way
MAX_DIRECTORY_BYTES = MAX_ENTRIES * MAX_RECORD_BYTES + 64
PER_RANGE = 6  # candidates a survey keeps per layer range (and checkpoint): the best half by record, the rest drawn
ENOUGH = 3  # DHT servers whose directory a lookup merges before it stops
ALPHA = 3  # servers a lookup asks at once
STORE_ALPHA = 5  # servers a publication stores at at once


def directory_key(model_id: str, start: int) -> str:
    """The DHT key of the directory of ``model_id``'s ranges that start at layer ``start``."""
    digest = hashlib.sha256(b"sangama/directory\x00" + model_id.encode() + b"\x00" + str(int(start)).encode())
    return f"/{NAMESPACE}/{digest.hexdigest()[:32]}"


def encode_directory(values: Iterable[bytes]) -> bytes:
    return msgpack.packb([DIRECTORY_SCHEMA, list(values)], use_bin_type=True)


def is_directory(value: bytes) -> bool:
    """Whether ``value`` is a directory envelope (cheap: its first bytes; :func:`decode_directory` checks the rest)."""
    prefix = msgpack.packb([DIRECTORY_SCHEMA], use_bin_type=True)[1:]  # the schema string after the array header
    return len(value) > len(prefix) and value[1:1 + len(prefix)] == prefix


def decode_directory(key: str, value: bytes, *, now: float | None = None) -> list[tuple[ServingRecord, bytes]]:
    """The valid entries of a directory (record, its bytes), newest per peer; raises :class:`RecordError` when
    ``value`` is not a directory of ``key`` at all or holds no valid entry. Invalid and expired entries are skipped
    (a merged directory ages entry by entry; a server's copy may hold one that expired on the way)."""
    if len(value) > MAX_DIRECTORY_BYTES:
        raise RecordError(f"directory of {len(value)} bytes exceeds {MAX_DIRECTORY_BYTES}")
    try:
        schema, values = msgpack.unpackb(value, raw=False, strict_map_key=True, max_bin_len=MAX_RECORD_BYTES,
                                         max_array_len=MAX_ENTRIES)
    except Exception as exc:  # untrusted bytes: msgpack raises several types, unpacking a non-pair ValueError
        raise translate(exc, RecordError, "directory is not a msgpack [schema, entries] envelope")
    if schema != DIRECTORY_SCHEMA or not isinstance(values, list):
        raise RecordError(f"directory schema {schema!r:.40} is not {DIRECTORY_SCHEMA!r}")
    best: dict[str, tuple[ServingRecord, bytes]] = {}
    why = "no entries"
    for entry in values:
        try:
            record = _entry(key, entry, now)
        except RecordError as exc:
            why = str(exc)
            continue
        old = best.get(record.peer_id)
        if old is None or (record.seq, record.expires_at) > (old[0].seq, old[0].expires_at):
            best[record.peer_id] = (record, entry)
    if not best:
        raise RecordError(f"directory holds no valid record: {why}")
    return list(best.values())


def _entry(key: str, entry: Any, now: float | None) -> ServingRecord:
    if not isinstance(entry, bytes):
        raise RecordError("directory entry is not bytes")
    try:
        body = msgpack.unpackb(msgpack.unpackb(entry, raw=False)[0], raw=False)
        model, peer = body["model"], body["peer"]
        if not isinstance(model, str) or not isinstance(peer, str):
            raise TypeError("model or peer is not a string")
    except Exception as exc:  # untrusted bytes: decode_record below names the exact fault of a well-formed one
        raise translate(exc, RecordError, "directory entry is not a record")
    record = decode_record(record_key(model, peer), entry, now=now)
    if directory_key(record.model_id, record.start) != key:
        raise RecordError(f"record of {record.peer_id} (layers {record.start}:{record.end}) is in the wrong directory")
    return record


def merge_entries(into: dict[str, tuple[ServingRecord, bytes]], entries: Iterable[tuple[ServingRecord, bytes]],
                  *, now: float | None = None) -> dict[str, tuple[ServingRecord, bytes]]:
    """``into`` (peer id -> (record, its bytes), checked already) with ``entries`` merged in: the newest record per
    peer, expired ones dropped, at most :data:`MAX_ENTRIES` (the latest-expiring). Nothing is decoded again: a DHT
    server keeps its directories decoded, so a store checks only the entries it is sent."""
    now = clock.wall() if now is None else now
    best = {peer: e for peer, e in into.items() if e[0].expires_at > now}
    for record, entry in entries:
        old = best.get(record.peer_id)
        if record.expires_at > now and (old is None or (record.seq, record.expires_at) >
                                        (old[0].seq, old[0].expires_at)):
            best[record.peer_id] = (record, entry)
    if len(best) > MAX_ENTRIES:
        kept = sorted(best.values(), key=lambda e: (-e[0].expires_at, e[0].peer_id))[:MAX_ENTRIES]
        best = {r.peer_id: (r, entry) for r, entry in kept}
    return best


def merge_directories(key: str, values: Iterable[bytes], *, now: float | None = None) -> bytes | None:
    """One directory holding the newest valid record per peer of all ``values`` (directories that do not decode are
    skipped), at most :data:`MAX_ENTRIES` (the latest-expiring); None when no valid entry is left."""
    best: dict[str, tuple[ServingRecord, bytes]] = {}
    for value in values:
        try:
            best = merge_entries(best, decode_directory(key, value, now=now), now=now)
        except RecordError:
            continue
    return encode_directory(entry for _, entry in best.values()) if best else None


class RecordsAndDirectories(RecordValidator):
    """The DHT validator of the ``sangama`` namespace: records (:class:`RecordValidator`) and directories.

    A directory is never ranked against another (``select`` takes the last value: py-libp2p's PUT_VALUE handler
    passes [stored, new] and stores the new one, which the store merges into the stored one)."""

    _last_directory: tuple[str, bytes, list[tuple[ServingRecord, bytes]]] | None = None

    def validate(self, key: str, value: bytes) -> None:
        if is_directory(value):
            self._last_directory = (key, value, decode_directory(key, value))
            self._last = None
            return
        super().validate(key, value)

    def checked_directory(self, key: str, value: bytes) -> list[tuple[ServingRecord, bytes]]:
        """The entries of ``value``: those :meth:`validate` just decoded, else decoded (and checked) now."""
        last = self._last_directory
        if last is not None and last[0] == key and last[1] == value:
            return last[2]
        return decode_directory(key, value)

    def select(self, key: str, values: list[bytes]) -> int:
        if any(is_directory(v) for v in values):
            return len(values) - 1
        return super().select(key, values)


def choose_candidates(records: Iterable[ServingRecord], *, per_range: int = PER_RANGE,
                      rng: random.Random | None = None) -> list[ServingRecord]:
    """At most ``per_range`` records per (start, end, fingerprint): the best half by what the records say (a free
    session, then throughput, then the most time left), the rest drawn at random from the others, so that clients
    spread over a range's peers instead of all probing the same few."""
    groups: dict[tuple[int, int, str], list[ServingRecord]] = {}
    for record in records:
        groups.setdefault((record.start, record.end, record.fingerprint), []).append(record)
    rng = rng or random.Random()
    out: list[ServingRecord] = []
    for group in groups.values():
        group.sort(key=lambda r: (r.free_sessions <= 0, -r.throughput, -r.expires_at, r.peer_id))
        best = (per_range + 1) // 2
        out += group[:best]
        rest = group[best:]
        out += rng.sample(rest, min(len(rest), per_range - best))
    return out


@dataclass
class DirectoryFacts:
    """Who the lookups asked, who replied and who answered with a directory (``asked`` counts toward a survey's
    dials)."""

    asked: set[ID] = field(default_factory=set)
    answered: set[ID] = field(default_factory=set)  # with a directory
    replied: set[ID] = field(default_factory=set)  # at all (a server without the directory names closer ones)
    lookups: int = 0


async def directory_from_network(node: Any, key: str, *, enough: int = ENOUGH,
                                 facts: DirectoryFacts | None = None) -> list[tuple[ServingRecord, bytes]]:
    """The entries of the directory under ``key``: our own copy merged with those of the first ``enough`` DHT
    servers that hold one. An iterative lookup, :data:`ALPHA` servers at a time from the closest we know, each
    answer naming closer ones; at most ``BUCKET_SIZE`` servers are asked."""
    facts = facts if facts is not None else DirectoryFacts()
    facts.lookups += 1
    dht = node.dht
    key_bytes = key.encode()
    found: dict[str, tuple[ServingRecord, bytes]] = {}
    local = dht.value_store.get(key_bytes)
    if local is not None:
        try:
            found = merge_entries(found, decode_directory(key, local.value))
        except RecordError:  # every entry of our copy expired
            pass
    peerstore = node.host.get_peerstore()
    seen: set[ID] = set(dht.routing_table.find_local_closest_peers(key_bytes, BUCKET_SIZE))
    if not seen:
        seen = set(await closest_servers(node.host, dht.routing_table, key_bytes))
    seen.discard(node.peer_id)
    asked: set[ID] = set()
    got = 0

    async def ask(peer: ID) -> None:
        nonlocal got, found
        with trio.move_on_after(QUERY_TIMEOUT):
            try:
                response = await twice(kad_request, node.host, peer, Message.MessageType.GET_VALUE, key_bytes)
            except Exception as exc:  # a dead or misbehaving peer must not stop the lookup
                log.debug("GET_VALUE of a directory from %s failed: %s", peer, exc)
                return
            if response is None:
                return
            facts.replied.add(peer)
            if response.HasField("record") and response.record.value:
                try:
                    entries = decode_directory(key, response.record.value)
                except RecordError as exc:
                    log.debug("%s answered a bad directory: %s", peer, exc)
                else:
                    found = merge_entries(found, entries)
                    facts.answered.add(peer)
                    got += 1
            for info in peer_infos(node.host, peer, response.closerPeers):
                if info.peer_id != node.peer_id and info.addrs:
                    peerstore.add_addrs(info.peer_id, info.addrs, 600)
                    seen.add(info.peer_id)

    while got < enough and len(asked) < BUCKET_SIZE:
        todo = [p for p in sort_peer_ids_by_distance(key_bytes, list(seen)) if p not in asked][:ALPHA]
        if not todo:
            break
        asked.update(todo)
        facts.asked.update(todo)
        async with trio.open_nursery() as nursery:
            for peer in todo:
                nursery.start_soon(ask, peer)
    return list(merge_entries(found, ()).values())  # what expired during the lookup dropped


class Closest:
    """Where a peer's directory entries went: the DHT servers closest to each key, looked up at most once per
    :data:`CLOSEST_TTL_S` (a stage re-publishes as its load changes: the lookup was half of each publication's KAD
    streams; after a store that failed they are looked up again at the next publication), and the servers that took
    the entry. A server that joins later and is among the :data:`BUCKET_SIZE` closest to a key gets the entry from
    :meth:`top_up` (a peer that published into a DHT of one server - the first of a fleet - was missing from the
    directories clients read, which are kept by the servers that joined after it)."""

    def __init__(self) -> None:
        self._found: dict[str, tuple[float, list[ID]]] = {}
        self._sent: dict[str, tuple[bytes, Any, list[ID]]] = {}  # key -> (entry, its signed put, holders by distance)

    async def get(self, node: Any, key: str) -> list[ID]:
        now = trio.current_time()
        cached = self._found.get(key)
        if cached is not None and now - cached[0] < CLOSEST_TTL_S:
            return cached[1]
        peers = [p for p in await node.dht.peer_routing.find_closest_peers_network(key.encode())
                 if p != node.peer_id]
        self._found[key] = (now, peers)
        return peers

    def forget(self, key: str) -> None:
        self._found.pop(key, None)

    def sent(self, key: str, value: bytes, entry: Any, holders: Sequence[ID]) -> None:
        """``value`` (signed as ``entry``) was stored at ``holders`` (a newer entry for ``key`` replaces the last)."""
        self._sent[key] = (value, entry, sort_peer_ids_by_distance(key.encode(), list(holders))[:BUCKET_SIZE])

    def holders(self, key: str) -> list[ID]:
        """The servers that took our last entry for ``key``, closest first."""
        return list(self._sent[key][2]) if key in self._sent else []

    def wants(self, peer: ID) -> bool:
        """Whether ``peer`` belongs among the holders of one of our entries (it is not one, and fewer than
        :data:`BUCKET_SIZE` hold it or ``peer`` is closer to the key than the farthest holder)."""
        return any(self._closer(key, peer) for key in self._sent)

    def _closer(self, key: str, peer: ID) -> bool:
        holders = self._sent[key][2]
        if peer in holders:
            return False
        return len(holders) < BUCKET_SIZE or sort_peer_ids_by_distance(key.encode(), [holders[-1], peer])[0] == peer

    async def top_up(self, node: Any) -> int:
        """Store each entry at the servers of our routing table that belong among its holders (no network lookup:
        the table hears of every server that joins and talks to us); how many took one."""
        stored = 0
        for key, (value, entry, holders) in list(self._sent.items()):
            new = [p for p in node.dht.routing_table.find_local_closest_peers(key.encode(), BUCKET_SIZE)
                   if p != node.peer_id and self._closer(key, p)]
            if not new:
                continue
            took = await _store_at(node, key.encode(), value, entry, new)
            if self._sent.get(key, (None, None))[0] is value:  # (no newer entry went out meanwhile)
                self.sent(key, value, entry, [*holders, *took])
            stored += len(took)
        return stored


CLOSEST_TTL_S = 300.0  # (a server that failed a store is looked up again at once)


async def _store_at(node: Any, key_bytes: bytes, value: bytes, entry: Any, peers: Sequence[ID]) -> list[ID]:
    """Store a directory entry at ``peers``, :data:`STORE_ALPHA` at a time; those that took it."""
    took: list[ID] = []
    limiter = trio.CapacityLimiter(STORE_ALPHA)

    async def store(peer: ID) -> None:
        async with limiter:
            with trio.move_on_after(QUERY_TIMEOUT):
                try:
                    if await node.dht.value_store._store_at_peer(peer, key_bytes, value, record=entry):
                        took.append(peer)
                except Exception as exc:  # one server that fails must not stop the others
                    log.debug("storing a directory entry at %s failed: %s", peer, exc)

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(store, peer)
    return took


async def put_directory(node: Any, key: str, value: bytes, closest: Closest | None = None) -> int:
    """Store our directory entry ``value`` locally and at the DHT servers closest to ``key`` (they merge it into
    theirs; ``closest`` remembers who they are, and who took it); how many servers took it. Raises
    :class:`RecordError` for an entry that does not decode."""
    key_bytes = key.encode()
    node.dht.value_store.put(key_bytes, value)  # merged by the store, which decodes (and checks) it
    entry = make_signed_put_record(key_bytes, value, node.host.get_private_key())  # ours alone goes out
    closest = closest or Closest()
    found = await closest.get(node, key)
    # with the servers that hold our last entry and the closest our routing table knows: those it was handed on to
    # joined after the lookup (kept for minutes), and would keep the old entry until it expired
    known = node.dht.routing_table.find_local_closest_peers(key_bytes, BUCKET_SIZE)
    peers = sort_peer_ids_by_distance(key_bytes, list({*found, *closest.holders(key), *known} - {node.peer_id}))
    peers = peers[:BUCKET_SIZE]
    took = await _store_at(node, key_bytes, value, entry, peers)
    if len(took) < len(peers):
        closest.forget(key)
    closest.sent(key, value, entry, took)
    return len(took)
