"""KAD requests of our own, and the network lookup every DHT operation of a node uses (:func:`closest_servers`).

py-libp2p's lookup (``PeerRouting.find_closest_peers_network``) tops a thin routing table up with every peerstore
peer and returns peers that never answered among the closest; :class:`ServerRouting` replaces it on our DHT
(:mod:`.dht`). :func:`get_providers` keeps the closer peers' addresses, which py-libp2p's own drops.
"""

from __future__ import annotations

import logging
from typing import Any

import multiaddr
import trio
import varint
from libp2p.custom_types import TProtocol
from libp2p.kad_dht.common import BUCKET_SIZE, MAX_DHT_MESSAGE_SIZE, PROTOCOL_ID
from libp2p.kad_dht.pb.kademlia_pb2 import Message
from libp2p.kad_dht.peer_routing import PeerRouting
from libp2p.kad_dht.utils import maybe_consume_signed_record, sort_peer_ids_by_distance
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.peer.peerstore import env_to_send_in_RPC
from libp2p.utils.varint import read_varint_prefixed_bytes_limited

from .node import offers_protocol
from .watch import open_connections

__all__ = ["CONCURRENCY", "MIN_SEEDS", "QUERY_TIMEOUT", "RETRY_PAUSE_S", "ServerRouting", "closest_servers", "get_providers", "kad_request",
           "peer_infos", "twice"]

log = logging.getLogger(__name__)
QUERY_TIMEOUT = 5.0  # per RPC; py-libp2p's own is 10 s
CONCURRENCY = 10
MIN_SEEDS = 5  # a routing table thinner than this is topped up with connected DHT servers (py-libp2p's threshold)
RETRY_PAUSE_S = 0.1  # before a failed query is asked once more


async def twice(rpc: Any, *args: Any, **kwargs: Any) -> Any:
    """``rpc(*args, **kwargs)``, once more after :data:`RETRY_PAUSE_S` when it raised (within the caller's
    QUERY_TIMEOUT). On a loaded machine py-libp2p's stream negotiation fails now and then ("fail to read from
    multiselect communicator"): a lookup whose few queries all failed so found no record (the loaded suite's "no live
    peer serves"), though every peer was up."""
    try:
        return await rpc(*args, **kwargs)
    except Exception as exc:
        log.debug("DHT query failed (%s): once more", exc)
    await trio.sleep(RETRY_PAUSE_S)
    return await rpc(*args, **kwargs)


async def kad_request(host: Any, peer: ID, kind: int, key: bytes) -> Message | None:
    """One KAD request of type ``kind`` for ``key`` to ``peer``: its answer, or None when it answered another type.
    Raises what the dial or the stream raised (a peer that cannot be reached, or that hung up)."""
    stream = await host.new_stream(peer, [TProtocol(PROTOCOL_ID)])
    try:
        message = Message()
        message.type = kind
        message.key = key
        message.senderRecord = env_to_send_in_RPC(host)[0]
        body = message.SerializeToString()
        await stream.write(varint.encode(len(body)) + body)
        response = Message()
        response.ParseFromString(await read_varint_prefixed_bytes_limited(stream, MAX_DHT_MESSAGE_SIZE))
    finally:
        await stream.close()
    if response.type != kind:
        return None
    maybe_consume_signed_record(response, host, peer)
    return response


def peer_infos(host: Any, peer: ID, protos: Any) -> list[PeerInfo]:
    """The peer entries of an answer from ``peer``, with their addresses (a malformed entry is skipped)."""
    out = []
    for proto in protos:
        try:
            maybe_consume_signed_record(proto, host)
            addrs = [multiaddr.Multiaddr(a) for a in proto.addrs]
            out.append(PeerInfo(ID(proto.id), addrs))
        except Exception as exc:  # one malformed entry must not spoil the answer
            log.debug("bad peer entry from %s: %s", peer, exc)
    return out


async def get_providers(node: Any, peer: ID, key: bytes) -> tuple[list[PeerInfo], list[PeerInfo]]:
    """One GET_PROVIDERS RPC: (providers, closer peers), both with addresses.

    py-libp2p's own version drops the closer peers' addresses, which an iterative lookup needs to dial them.
    """
    response = await kad_request(node.host, peer, Message.MessageType.GET_PROVIDERS, key)
    if response is None:
        return [], []
    return (peer_infos(node.host, peer, response.providerPeers), peer_infos(node.host, peer, response.closerPeers))


async def closest_servers(host: Any, table: Any, key: bytes, count: int = BUCKET_SIZE) -> list[ID]:
    """The ``count`` DHT servers closest to ``key`` that answered a FIND_NODE lookup for it, closest first.

    The lookup starts from the routing table (topped up with the connected peers identify shows serving the DHT when
    it holds fewer than ``MIN_SEEDS``), asks the closest ``count`` peers seen until all of them answered or failed,
    and keeps the peers that answered, then (where fewer answered than ``count``) those that were only slow: still
    connected, DHT servers per identify, no answer within ``QUERY_TIMEOUT`` (a busy server still takes a store). A
    peer that could not be reached is never returned: see :class:`ServerRouting` for why py-libp2p's own lookup is
    not used.
    """
    local = host.get_id()
    peerstore = host.get_peerstore()
    seen: set[ID] = set(table.find_local_closest_peers(key, count))
    if len(seen) < MIN_SEEDS:
        seen.update(p for p in host.get_connected_peers() if offers_protocol(host, p, PROTOCOL_ID))
    seen.discard(local)
    asked: set[ID] = set()
    answered: set[ID] = set()
    slow: set[ID] = set()
    limiter = trio.CapacityLimiter(CONCURRENCY)

    async def ask(peer: ID) -> None:
        async with limiter:
            with trio.move_on_after(QUERY_TIMEOUT):
                try:
                    response = await kad_request(host, peer, Message.MessageType.FIND_NODE, key)
                except Exception as exc:  # a dead or misbehaving peer must not stop the lookup
                    log.debug("FIND_NODE from %s failed: %s", peer, exc)
                    seen.discard(peer)  # its place among the closest goes to the next peer
                    return
                answered.add(peer)
                for info in peer_infos(host, peer, response.closerPeers if response is not None else ()):
                    if info.peer_id != local and info.addrs:
                        peerstore.add_addrs(info.peer_id, info.addrs, 600)
                        seen.add(info.peer_id)
                return
            seen.discard(peer)  # no answer within QUERY_TIMEOUT
            slow.add(peer)

    while True:  # until the closest ``count`` peers seen have all been asked
        todo = [p for p in sort_peer_ids_by_distance(key, list(seen))[:count] if p not in asked]
        if not todo:
            break
        asked.update(todo)
        async with trio.open_nursery() as nursery:
            for peer in todo:
                nursery.start_soon(ask, peer)
    for peer in answered:  # a peer that answered a KAD query is a DHT server
        await table.add_peer(peer, skip_server_mode_check=True)
    # a slow peer counts only while a connection to it is open and identify lists the KAD protocol: a DHT client (a
    # NATed stage) or a departed peer would take record stores meant for servers (issue 27 counted stores failing
    # with "protocol not supported" and dial errors)
    late = [p for p in sort_peer_ids_by_distance(key, list(slow - answered))
            if offers_protocol(host, p, PROTOCOL_ID) and open_connections(host, p)]
    return (sort_peer_ids_by_distance(key, list(answered)) + late)[:count]


class ServerRouting(PeerRouting):
    """py-libp2p's peer routing with :func:`closest_servers` as the network lookup (``put_value``, ``provide``,
    ``get_value``, routing-table refresh and our own callers all use it).

    py-libp2p's ``find_closest_peers_network`` tops a thin routing table (under 5 peers: every small fleet) up with
    every connected peer and then with every peer in the peerstore, and returns peers that never answered among the
    closest. A stage that had looked up who serves its model held the other NATed stages' private addresses in its
    peerstore, so its PUT_VALUE and ADD_PROVIDER dialled those first, 5 s per lookup and 5 s per store: its provider
    record reached the bootstrap ~15 s after ``ready``, and a client started then found nobody for its layers
    (tests/net/test_nat_fleet.py; bisected to the join's pre-flight lookup).
    """

    async def find_closest_peers_network(self, target_key: bytes, count: int = BUCKET_SIZE) -> list[ID]:
        return await closest_servers(self.host, self.routing_table, target_key, count)
