"""Staying joined: the configured bootstrap nodes are reconnected when they drop, and told our records again.

Before, a node connected to its bootstrap nodes once, at start. A bootstrap node that restarted came back with an empty
DHT store and routing table, and nobody reconnected to it: a dial that failed meanwhile had dropped it from the routing
table (``_ServerDHT.forget``), so every record store and lookup went to nobody, and the fleet stayed invisible until
every stage was restarted (issue 27: 14 of 14 generations failed over 11 minutes with "no live peer serves").

:func:`keep_bootstrap` runs for the node's lifetime (``open_host`` starts it). For each bootstrap node it waits until no
connection to it is left (network notifees, :mod:`.watch`, and a check every ``CHECK_S`` s), then reconnects with a
growing backoff (``RETRY_S`` doubling up to ``MAX_RETRY_S``; a connection that someone else opens meanwhile, such as the
relay keeper's, counts too), puts it back into the DHT routing table, logs at INFO how long it was gone, and calls
``Node.bootstrap_back``: the :class:`~.discovery.Announcer` re-publishes every record and provider entry at once, so a
restarted bootstrap node holds them again seconds after it is back instead of after the next periodic re-publish.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import trio
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from ..errors import NetworkError
from .node import Node
from .watch import PeerWatch, open_connections, watch_peers

__all__ = ["CHECK_S", "MAX_RETRY_S", "RETRY_S", "keep_bootstrap"]

log = logging.getLogger(__name__)

RETRY_S = 1.0  # the first wait before dialling a lost bootstrap node again
MAX_RETRY_S = 15.0  # the longest wait between two dials of a bootstrap node that stays away
CHECK_S = 30.0  # how often the connection is looked at besides the notifees (a close nobody was told of)


async def keep_bootstrap(node: Node, addrs: Sequence[str]) -> None:
    """Keep ``node`` connected to every bootstrap node in ``addrs`` until cancelled (see the module docstring)."""
    infos: list[PeerInfo] = []
    for addr in addrs:
        try:
            info = info_from_p2p_addr(Multiaddr(addr))
        except Exception:  # HostConfig checked them; one that cannot be parsed cannot be kept either
            continue
        if info.peer_id != node.peer_id and info.peer_id not in {i.peer_id for i in infos}:
            infos.append(info)
    if not infos:
        return
    async with watch_peers(node.host) as watch, trio.open_nursery() as nursery:
        for info in infos:
            nursery.start_soon(_keep_one, node, watch, info)


async def _keep_one(node: Node, watch: PeerWatch, info: PeerInfo) -> None:
    peer = info.peer_id
    while True:
        while True:  # until no connection to it is left
            changed = watch.changed(peer)
            if not open_connections(node.host, peer):
                break
            with trio.move_on_after(CHECK_S):
                await changed.wait()
        lost_at = trio.current_time()
        log.info("bootstrap node %s: not connected; reconnecting", peer)
        retry = RETRY_S
        while not open_connections(node.host, peer):
            try:
                await node.connect(peer, list(info.addrs))
                break
            except NetworkError as exc:
                log.debug("bootstrap node %s still unreachable (%s); next try within %.0f s", peer, exc, retry)
            changed = watch.changed(peer)
            if open_connections(node.host, peer):
                break
            with trio.move_on_after(retry):
                await changed.wait()
            retry = min(2 * retry, MAX_RETRY_S)
        if node.dht is not None:  # trusted: a bootstrap node is a DHT server (a failed dial dropped it)
            await node.dht.routing_table.add_peer(peer, skip_server_mode_check=True)
        log.info("bootstrap node %s back after %.1f s: re-publishing our records to it", peer,
                 trio.current_time() - lost_at)
        for callback in list(node.bootstrap_back):
            callback(peer)
