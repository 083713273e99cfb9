"""The Kademlia DHT of a node, and network-wide queries that py-libp2p's shortcuts would answer locally.

py-libp2p's ``find_providers`` returns only the local provider store when it is non-empty, and ``get_value``
returns a local copy without asking anyone else. Discovery must see the whole swarm and the newest record, so
:func:`providers_from_network` and :func:`values_from_network` ask the peers closest to the key directly (the same
GET_PROVIDERS / GET_VALUE RPCs, without the local short-cut) and merge in the local answer.

The routing table holds DHT servers only (:class:`~.kad_table.ServerTable`: every way py-libp2p adds a peer goes
through its identify check), so a throwaway client (a ``generate`` run) never enters a table and no later lookup
dials it after it left; a peer that cannot be dialled any more is dropped from the table (as go-libp2p's DHT does
after a failed query).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from typing import Any

import trio
from libp2p.kad_dht.common import BUCKET_SIZE, PROTOCOL_ID
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.utils import sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.records.pubkey import PublicKeyValidator
from libp2p.records.validator import NamespacedValidator
from libp2p.tools.anyio_service import background_trio_service

from ..errors import NetworkError
from .kad_rpc import CONCURRENCY, QUERY_TIMEOUT, RETRY_PAUSE_S, ServerRouting, get_providers, twice
from .kad_table import ServerTable, offers_dht
from .node import Node
from .addrs import stream_source
from .dht_store import PUT_SOURCE, CappedValueStore
from .directory import RecordsAndDirectories
from .records import NAMESPACE, RecordLedger

__all__ = ["LookupFacts", "bootstrap", "offers_dht", "providers_from_network", "run_dht", "values_from_network"]

log = logging.getLogger(__name__)
AUTHOR_GRACE_S = 1.0  # once a DHT server answered with a valid value, how long the record's own author may still
# answer (a NATed author's dead addresses otherwise held every lookup for QUERY_TIMEOUT: 5 s measured)
BOOTSTRAP_IDENTIFY_WAIT = 3.0  # seconds identify has, after the bootstrap connect, to say whether it serves the DHT


def _require_dht(node: Node) -> KadDHT:
    if node.dht is None:
        raise NetworkError("this node runs no DHT")
    return node.dht


async def run_dht(node: Node, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the node's DHT until cancelled: server mode answers queries, client mode only asks.

    Validation is strict: only our namespace (and ``/pk``) is stored, so nobody can park arbitrary data on us; and
    the store is capped (``HostConfig.dht_max_records``, ``dht_records_per_peer``: see :class:`CappedValueStore`).
    """
    records = RecordsAndDirectories()
    validator = NamespacedValidator({NAMESPACE: records, "pk": PublicKeyValidator()}, strict_validation=True)
    mode = DHTMode.SERVER if node.config.dht_server else DHTMode.CLIENT
    async with trio.open_nursery() as nursery:
        dht = _ServerDHT(node.host, mode, nursery, validator=validator, validator_changed=True, strict_validation=True)
        ledger = RecordLedger(max_records=node.config.dht_max_records, max_per_peer=node.config.dht_records_per_peer)
        dht.value_store = CappedValueStore(node.host, dht.local_peer_id, ledger, records)
        node.dht = dht
        node.dial_failed.append(dht.forget)
        try:
            async with background_trio_service(dht):
                nursery.start_soon(dht.sweep_forever)
                task_status.started()
                await trio.sleep_forever()
        finally:
            node.dial_failed.remove(dht.forget)


SWEEP_S = 30.0  # how often a node drops expired records from its DHT store (records live 180 s by default)
SWEEP_BATCH = 256  # records dropped between two checkpoints of a sweep


class _ServerDHT(KadDHT):
    """A KadDHT whose routing table keeps DHT servers only (:class:`~.kad_table.ServerTable`).

    ``nursery`` runs the table's short waits for identify; it must outlive the DHT service.
    """

    def __init__(self, host: Any, mode: DHTMode, nursery: trio.Nursery, **kwargs: Any) -> None:
        super().__init__(host, mode, **kwargs)
        old = self.routing_table
        self.routing_table = ServerTable(self.local_peer_id, host, nursery,
                                         max_peers_per_subnet=old.max_peers_per_subnet,
                                         max_peers_per_subnet_table=old.max_peers_per_subnet_table)
        self.peer_routing = ServerRouting(host, self.routing_table)
        self.provider_store.peer_routing = self.peer_routing
        if self.rt_refresh_manager is not None:  # random walk (off by default) adds what it finds to the table
            self.rt_refresh_manager.routing_table = self.routing_table

    async def handle_stream(self, stream: Any) -> None:
        """py-libp2p's KAD handler, with the sender's address and network where the store can read them
        (:data:`~.dht_store.PUT_SOURCE`: a directory takes at most :data:`~.dht_store.DIRECTORY_PER_NETWORK` entries
        from one network)."""
        PUT_SOURCE.set(stream_source(stream))  # this handler runs in a task of its own
        await super().handle_stream(stream)

    async def add_peer(self, peer_id: ID, *, skip_server_mode_check: bool = False) -> bool:
        """Add ``peer_id`` if identify says it is a DHT server (now or within the table's wait).

        ``skip_server_mode_check`` is ignored: py-libp2p sets it for every peer that queries us, clients included.
        Trusted peers (bootstrap nodes) go through ``routing_table.add_peer(..., skip_server_mode_check=True)``.
        """
        return await self.routing_table.add_peer(peer_id)

    async def sweep_expired(self) -> int:
        """Drop stored records past their own ``expires_at`` (py-libp2p alone keeps every value for 24 h, so a stale
        record stayed on every DHT server, and was served, for a day); the count. A store without a ledger (a DHT
        not started by :func:`run_dht`) has nothing of ours to sweep."""
        store = self.value_store
        if not isinstance(store, CappedValueStore):
            return 0
        gone = await store.sweep_expired(SWEEP_BATCH)
        if gone:
            log.debug("dropped %d expired value(s) from the DHT store", gone)
        return gone

    async def sweep_forever(self) -> None:
        while True:
            await trio.sleep(SWEEP_S)
            await self.sweep_expired()

    def forget(self, peer_id: ID) -> None:
        """Drop a peer we could not dial from the routing table, so that later lookups stop dialling it."""
        if self.routing_table.remove_peer(peer_id):
            log.debug("dropped unreachable peer %s from the DHT routing table", peer_id)


async def bootstrap(node: Node, addrs: Iterable[str]) -> list[ID]:
    """Connect to the bootstrap nodes, seed the routing table with them, then look ourselves up.

    Returns the peers reached. Raises :class:`NetworkError` (e.g. a fleet-secret mismatch) if none answers.
    """
    dht = _require_dht(node)
    reached: list[ID] = []
    failures: list[NetworkError] = []

    async def one(addr: str) -> None:
        try:
            peer = await node.connect_multiaddr(addr)
        except NetworkError as exc:
            failures.append(exc)
            return
        await dht.routing_table.add_peer(peer, skip_server_mode_check=True)  # trusted: a bootstrap node is a server
        reached.append(peer)

    async with trio.open_nursery() as nursery:
        for addr in addrs:
            nursery.start_soon(one, addr)
    if not reached:
        if len(failures) == 1:
            raise failures[0]
        raise NetworkError("no bootstrap node answered: " + "; ".join(str(f) for f in failures))
    for failure in failures:
        log.warning("bootstrap: %s", failure)
    await _check_bootstrap_servers(node, reached)
    with trio.move_on_after(QUERY_TIMEOUT):
        for peer in await dht.peer_routing.find_closest_peers_network(node.peer_id.to_bytes()):
            await dht.add_peer(peer)
    return reached


async def _check_bootstrap_servers(node: Node, reached: list[ID], wait: float = BOOTSTRAP_IDENTIFY_WAIT) -> None:
    """A bootstrap node that serves no DHT (a DHT client, e.g. go-libp2p in auto mode behind NAT) stores nothing
    and answers no lookup: records published through it reach nobody. Wait for identify to tell (at most ``wait``
    s); raise :class:`NetworkError` naming them when every reached bootstrap is a client, warn when some are."""
    with trio.move_on_after(wait):
        while any(offers_dht(node.host, p) is None for p in reached):
            await trio.sleep(0.05)
    clients = [p for p in reached if offers_dht(node.host, p) is False]
    if not clients:
        return
    names = ", ".join(str(p) for p in clients)
    if len(clients) == len(reached):
        raise NetworkError(f"bootstrap node {names} is only a DHT client (identify lists no {PROTOCOL_ID}): it stores "
                           "no records and answers no lookups, so nobody would find this peer or the peers it "
                           "looks for; bootstrap from a node in DHT server mode (`sangama-peer bootstrap`)")
    log.warning("bootstrap node %s is only a DHT client: records and lookups go through the others", names)


async def _closest(dht: KadDHT, key: bytes) -> list[ID]:
    with trio.move_on_after(QUERY_TIMEOUT):
        peers = await dht.peer_routing.find_closest_peers_network(key)
        return [p for p in peers if p != dht.local_peer_id]
    return []


@dataclass
class LookupFacts:
    """Who a lookup asked and who answered (for error messages that say where nothing was found)."""

    asked: set[ID] = field(default_factory=set)
    answered: set[ID] = field(default_factory=set)


async def providers_from_network(node: Node, key: bytes, *, count: int = BUCKET_SIZE,
                                 facts: LookupFacts | None = None) -> set[ID]:
    """Every provider of ``key`` known to the ``count`` peers closest to it, plus our local store.

    One iterative Kademlia lookup with GET_PROVIDERS (whose answers also carry closer peers), rather than a
    FIND_NODE lookup followed by GET_PROVIDERS: the same peers are asked, in one round trip fewer. ``facts``
    learns whom it asked and who answered.
    """
    facts = facts if facts is not None else LookupFacts()
    dht = _require_dht(node)
    found: set[ID] = {info.peer_id for info in dht.provider_store.get_providers(key)}
    peerstore = node.host.get_peerstore()
    seen: set[ID] = set(dht.routing_table.find_local_closest_peers(key, count)) or {
        p for p in node.host.get_connected_peers() if offers_dht(node.host, p) is not False}  # never a DHT client
    seen.discard(node.peer_id)
    asked: set[ID] = set()
    limiter = trio.CapacityLimiter(CONCURRENCY)

    async def ask(peer: ID) -> None:
        async with limiter:
            with trio.move_on_after(QUERY_TIMEOUT):
                try:
                    providers, closer = await twice(get_providers, node, peer, key)
                except Exception as exc:  # a dead or misbehaving peer must not stop the lookup
                    log.debug("GET_PROVIDERS from %s failed: %s", peer, exc)
                    return
                facts.answered.add(peer)
                for info in providers:
                    if info.addrs:
                        peerstore.add_addrs(info.peer_id, info.addrs, 600)
                    found.add(info.peer_id)
                for info in closer:
                    if info.peer_id != node.peer_id and info.addrs:
                        peerstore.add_addrs(info.peer_id, info.addrs, 600)
                        seen.add(info.peer_id)

    while True:  # until the closest ``count`` peers seen have all been asked
        todo = [p for p in sort_peer_ids_by_distance(key, list(seen))[:count] if p not in asked]
        if not todo:
            return found
        asked.update(todo)
        facts.asked.update(todo)
        async with trio.open_nursery() as nursery:
            for peer in todo:
                nursery.start_soon(ask, peer)


async def values_from_network(node: Node, key: str, *, ask_first: Iterable[ID] = (), enough: int = 1) -> list[bytes]:
    """Valid values stored under ``key``: our local copy, and the answers of the peers in ``ask_first``, the DHT
    servers in our routing table closest to the key, and the network's closest peers, all asked in parallel.

    Stops once ``enough`` valid values came from ``ask_first`` (the caller picks the best with ``select``), else
    ``AUTHOR_GRACE_S`` after the first valid value from another peer, else when every query answered or timed out
    (``QUERY_TIMEOUT`` each). Values that fail the namespace validator are
    dropped.
    """
    dht = _require_dht(node)
    validator = dht.validator
    if validator is None:
        raise NetworkError("the DHT has no validator")
    key_bytes = key.encode()
    values: list[bytes] = []
    local = dht.value_store.get(key_bytes)
    if local is not None:
        values.append(local.value)

    def keep(value: bytes | None) -> bool:
        if value is None:
            return False
        try:
            validator.validate(key, value)
        except Exception as exc:  # untrusted value: our RecordValidator raises RecordError, libp2p's its own types
            log.debug("dropping invalid value for %s: %s", key, exc)
            return False
        values.append(value)
        return True

    async def ask(peer: ID) -> bool:
        with trio.move_on_after(QUERY_TIMEOUT):
            try:
                record = await dht.value_store._get_from_peer(peer, key_bytes, return_record=True)
            except Exception as exc:  # a dead or misbehaving peer must not stop the lookup
                log.debug("GET_VALUE from %s failed: %s", peer, exc)
                return False
            return keep(record.value if isinstance(record, Record) else None)
        return False

    asked: set[ID] = {node.peer_id}
    firsts = list(dict.fromkeys(ask_first))
    got = 0
    done = trio.Event()  # the author answered, or every query finished

    grace_started = False

    async def grace() -> None:
        await trio.sleep(AUTHOR_GRACE_S)
        done.set()

    async def ask_once(peer: ID, first: bool = False) -> None:
        nonlocal got, grace_started
        if peer in asked:
            return
        asked.add(peer)
        t0 = trio.current_time()
        ok = await ask(peer)
        if not ok and first and trio.current_time() - t0 < QUERY_TIMEOUT / 2:
            # the author holds its record: no answer is a failed query (py-libp2p returns None), once more unless
            # it was a time-out (an unreachable author must not hold a lookup twice as long)
            await trio.sleep(RETRY_PAUSE_S)
            ok = await ask(peer)
        if ok:
            if first:
                got += 1
                if got >= enough:  # the record's author answered: nobody holds a newer copy
                    done.set()
            elif not grace_started:  # a server holds a copy: the author (maybe behind NAT) gets a short grace only
                grace_started = True
                node.nursery.start_soon(grace)

    async def queries() -> None:
        # all at once, each bounded by QUERY_TIMEOUT: the author (whose addresses may all be dead behind a NAT), the
        # DHT servers we know near the key (the bootstrap holding the record), and the network's closest peers
        try:
            async with trio.open_nursery() as nursery:
                for peer in firsts:
                    nursery.start_soon(ask_once, peer, True)
                # an author among the closest is asked as the author only (with its retry): it may be the only
                # holder of its record (issue 25: records are stored in directories, each author keeps its own)
                for peer in dht.routing_table.find_local_closest_peers(key_bytes, BUCKET_SIZE):
                    if peer not in firsts:
                        nursery.start_soon(ask_once, peer)
                for peer in await _closest(dht, key_bytes):
                    if peer not in firsts:
                        nursery.start_soon(ask_once, peer)
        finally:
            done.set()

    # the queries run in the node's nursery: an early answer returns at once, and the others finish by themselves
    # (cancelling a query in the middle of its RPC broke later lookups on the same connection)
    node.nursery.start_soon(queries)
    await done.wait()
    return list(values)
