"""A Kademlia routing table that holds DHT servers only, whoever adds to it.

py-libp2p 0.8.1 adds peers to the routing table from many places: ``KadDHT._do_handle_stream`` (every peer that
opens a KAD stream to us, with ``skip_server_mode_check=True``), peer routing (``_query_peer_for_closest`` adds the
peer it asks and every peer in its answer, ``refresh_routing_table`` what a lookup found), the random-walk refresh,
and a bucket's replacement of an unresponsive peer. Its own check only refuses a peer whose identify has *already*
listed protocols without KAD; a peer not identified yet goes in. A throwaway client (``generate``, ``status``: a DHT
client) that was named in an answer, or queried us before identify finished, stayed in the table after it left,
and every later lookup and stale-peer ping dialled it again (issue 27).

:class:`ServerTable` is the one door: :meth:`ServerTable.add_peer` admits a peer only once identify says it serves
the KAD protocol; a peer not identified yet is added later if identify then says so (within ``IDENTIFY_WAIT`` s,
while it is still connected), never before. ``skip_server_mode_check=True`` is kept for callers that know the peer
is a server without identify: py-libp2p passes it only through ``KadDHT.add_peer``, which ``_ServerDHT`` overrides
to drop it, so only our own code (bootstrap nodes, peers that answered a KAD query) uses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from libp2p.kad_dht.common import PROTOCOL_ID
from libp2p.kad_dht.routing_table import RoutingTable
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from .node import offers_protocol

__all__ = ["IDENTIFY_WAIT", "ServerTable", "offers_dht"]

log = logging.getLogger(__name__)
IDENTIFY_WAIT = 10.0  # seconds a peer has for identify to tell whether it is a DHT server


def offers_dht(host: Any, peer_id: ID) -> bool | None:
    """Whether ``peer_id`` serves the KAD protocol (a DHT server), per identify; ``None`` while nobody knows."""
    return offers_protocol(host, peer_id, PROTOCOL_ID)


class ServerTable(RoutingTable):
    """py-libp2p's routing table that admits DHT servers only (see the module docstring).

    ``nursery`` runs the short waits for identify; it must outlive the table's use.
    """

    def __init__(self, local_id: ID, host: Any, nursery: trio.Nursery, **kwargs: Any) -> None:
        super().__init__(local_id, host, **kwargs)
        self._nursery = nursery
        self._identifying: set[ID] = set()
        self.refused = 0  # peers kept out (clients, or not identified), for tests and logs
        self.on_added: list[Callable[[ID], None]] = []  # told of each server new to the table

    async def _admit(self, peer_obj: PeerInfo | ID, peer_id: ID) -> bool:
        new = not self.peer_in_table(peer_id)
        added = await super().add_peer(peer_obj, skip_server_mode_check=True)
        if added and new:
            for tell in list(self.on_added):
                tell(peer_id)
        return added

    async def add_peer(self, peer_obj: PeerInfo | ID, *, skip_server_mode_check: bool = False) -> bool:
        peer_id = peer_obj.peer_id if isinstance(peer_obj, PeerInfo) else peer_obj
        if skip_server_mode_check:  # our own callers only: a bootstrap node, a peer that answered a KAD query
            return await self._admit(peer_obj, peer_id)
        server = offers_dht(self.host, peer_id)
        if server:
            return await self._admit(peer_obj, peer_id)
        self.refused += 1
        if server is False:
            self.remove_peer(peer_id)
        elif peer_id not in self._identifying and peer_id != self.local_id:
            try:
                self._nursery.start_soon(self._add_once_identified, peer_id)
            except RuntimeError:  # the node is closing (its nursery takes no new tasks): nothing to add to
                return False
            self._identifying.add(peer_id)
        return False

    async def _add_once_identified(self, peer_id: ID) -> None:
        try:
            with trio.move_on_after(IDENTIFY_WAIT):
                while offers_dht(self.host, peer_id) is None:
                    await trio.sleep(0.05)
                if offers_dht(self.host, peer_id) and self.host.get_network().get_connections(peer_id):
                    await self._admit(peer_id, peer_id)
        finally:
            self._identifying.discard(peer_id)
