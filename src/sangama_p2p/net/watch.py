"""Hear at once when a connection to a given peer opens or closes (py-libp2p's network notifees).

The reservation keeper (``net/relay.py``) and the bootstrap keeper (``net/rejoin.py``) wait on it instead of polling:
a relay or bootstrap node that restarts closes its connections, and the keepers reserve and reconnect right then::

    async with watch_peers(host) as watch:
        changed = watch.changed(peer_id)            # take the event before looking at the state
        if not connected(peer_id):
            ...
        await changed.wait()                        # a connection to peer_id opened or closed since
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.peer.id import ID
from multiaddr import Multiaddr

__all__ = ["PeerWatch", "open_connections", "watch_peers"]


class PeerWatch(INotifee):
    """A notifee that sets a per-peer event whenever a connection to that peer opens or closes."""

    def __init__(self) -> None:
        self._events: dict[ID, trio.Event] = {}

    def changed(self, peer_id: ID) -> trio.Event:
        """An event set at the next connection opened or closed with ``peer_id`` (a fresh one after each)."""
        event = self._events.get(peer_id)
        if event is None or event.is_set():
            event = self._events[peer_id] = trio.Event()
        return event

    def _poke(self, conn: INetConn) -> None:
        try:
            peer_id = conn.muxed_conn.peer_id
        except Exception:  # a connection without a peer yet: nobody waits on it
            return
        event = self._events.pop(peer_id, None)
        if event is not None:
            event.set()

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        self._poke(conn)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        self._poke(conn)

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        pass

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        pass


def open_connections(host: IHost, peer_id: ID) -> list[INetConn]:
    """The connections to ``peer_id`` that are still open."""
    return [c for c in host.get_network().get_connections(peer_id) if not c.is_closed]


@asynccontextmanager
async def watch_peers(host: IHost) -> AsyncIterator[PeerWatch]:
    """A :class:`PeerWatch` registered on ``host``'s network for the block's duration."""
    watch = PeerWatch()
    network = host.get_network()
    network.register_notifee(watch)
    try:
        yield watch
    finally:
        remove = getattr(network, "remove_notifee", None)
        if remove is not None:
            remove(watch)
