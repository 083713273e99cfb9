"""The Kademlia DHT of a node, and network-wide queries that py-libp2p's shortcuts would answer locally.

py-libp2p's ``find_providers`` returns only the local provider store when it is non-empty, and ``get_value``
returns a local copy without asking anyone else. Discovery must see the whole swarm and the newest record, so
:func:`providers_from_network` and :func:`values_from_network` ask the peers closest to the key directly (the same
GET_PROVIDERS / GET_VALUE RPCs, without the local short-cut) and merge in the local answer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import trio
from libp2p.kad_dht.kad_dht import DHTMode, KadDHT
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.peer.id import ID
from libp2p.records.pubkey import PublicKeyValidator
from libp2p.records.validator import NamespacedValidator
from libp2p.tools.anyio_service import background_trio_service

from ..errors import NetworkError
from .host import Node
from .records import NAMESPACE, RecordValidator

__all__ = ["bootstrap", "providers_from_network", "run_dht", "values_from_network"]

log = logging.getLogger(__name__)
QUERY_TIMEOUT = 5.0  # per RPC; py-libp2p's own is 10 s
_CONCURRENCY = 10


def _require_dht(node: Node) -> KadDHT:
    if node.dht is None:
        raise NetworkError("this node runs no DHT")
    return node.dht


async def run_dht(node: Node, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
    """Run the node's DHT until cancelled: server mode answers queries, client mode only asks.

    Validation is strict: only our namespace (and ``/pk``) is stored, so nobody can park arbitrary data on us.
    """
    validator = NamespacedValidator(
        {NAMESPACE: RecordValidator(), "pk": PublicKeyValidator()}, strict_validation=True
    )
    mode = DHTMode.SERVER if node.config.dht_server else DHTMode.CLIENT
    dht = KadDHT(node.host, mode, validator=validator, validator_changed=True, strict_validation=True)
    node.dht = dht
    async with background_trio_service(dht):
        task_status.started()
        await trio.sleep_forever()


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
        await dht.add_peer(peer, skip_server_mode_check=True)
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
    with trio.move_on_after(QUERY_TIMEOUT):
        for peer in await dht.peer_routing.find_closest_peers_network(node.peer_id.to_bytes()):
            await dht.add_peer(peer)
    return reached


async def _closest(dht: KadDHT, key: bytes) -> list[ID]:
    with trio.move_on_after(QUERY_TIMEOUT):
        peers = await dht.peer_routing.find_closest_peers_network(key)
        return [p for p in peers if p != dht.local_peer_id]
    return []


async def providers_from_network(node: Node, key: bytes) -> set[ID]:
    """Every provider of ``key`` known to the peers closest to it, plus our local store (deduplicated)."""
    dht = _require_dht(node)
    found: set[ID] = {info.peer_id for info in dht.provider_store.get_providers(key)}
    limiter = trio.CapacityLimiter(_CONCURRENCY)

    async def ask(peer: ID) -> None:
        async with limiter:
            with trio.move_on_after(QUERY_TIMEOUT):
                try:
                    providers, _ = await dht.provider_store._get_providers_from_peer_with_closers(peer, key)
                except Exception as exc:  # a dead or misbehaving peer must not stop the query
                    log.debug("GET_PROVIDERS from %s failed: %s", peer, exc)
                    return
                for info in providers:
                    if info.addrs:
                        node.host.get_peerstore().add_addrs(info.peer_id, info.addrs, 600)
                    found.add(info.peer_id)

    async with trio.open_nursery() as nursery:
        for peer in await _closest(dht, key):
            nursery.start_soon(ask, peer)
    return found


async def values_from_network(node: Node, key: str, *, ask_first: Iterable[ID] = (), enough: int = 1) -> list[bytes]:
    """Valid values stored under ``key``: our local copy, then peers in ``ask_first``, then the closest peers.

    Stops once ``enough`` valid values came from the network (the caller picks the best with ``select``). Values
    that fail the namespace validator are dropped.
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
        except Exception as exc:
            log.debug("dropping invalid value for %s: %s", key, exc)
            return False
        values.append(value)
        return True

    async def ask(peer: ID) -> bool:
        with trio.move_on_after(QUERY_TIMEOUT):
            try:
                record = await dht.value_store._get_from_peer(peer, key_bytes, return_record=True)
            except Exception as exc:
                log.debug("GET_VALUE from %s failed: %s", peer, exc)
                return False
            return keep(record.value if isinstance(record, Record) else None)
        return False

    got = 0
    for peer in ask_first:
        if peer != node.peer_id and await ask(peer):
            got += 1
    if got >= enough:
        return values
    async with trio.open_nursery() as nursery:
        for peer in await _closest(dht, key_bytes):
            nursery.start_soon(ask, peer)
    return values
