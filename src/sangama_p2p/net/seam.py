"""The seam between the network and the code above it (issue 25): what ``client/`` and ``stage/`` use of a node.

``client/`` and ``stage/`` hold a :class:`Network` - the libp2p :class:`~sangama_p2p.net.node.Node` is the one
implementation - and reach the network through it and through these entry points of ``net/``, each given that
node: :func:`~sangama_p2p.net.discovery.find_serving_peers` and :func:`~sangama_p2p.net.walk.find_starting_at` (find
the peers of a model or of a range), :class:`~sangama_p2p.net.discovery.Announcer` (publish our records),
:func:`~sangama_p2p.net.stage_stream.open_stage_stream` with a :class:`~sangama_p2p.net.lane.LaneDialer` (open a
stream to a peer), :class:`~sangama_p2p.net.lane.LaneListener` and
:class:`~sangama_p2p.net.movable.MovableAcceptor` (serve one). Time comes from :mod:`sangama_p2p.clock`. A simulated
network would implement this protocol and those entry points in memory (not built yet: docs/architecture.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, runtime_checkable

import multiaddr
from libp2p.abc import INetStream
from libp2p.peer.id import ID

__all__ = ["Network", "StreamHandler"]

StreamHandler = Callable[[INetStream], Awaitable[None]]


@runtime_checkable
class Network(Protocol):
    """A node as ``client/`` and ``stage/`` use it: its identity and addresses, the protocols it serves, and (for a
    peer that publishes records) its DHT, None on a node that runs none."""

    dht: Any

    @property
    def peer_id(self) -> ID: ...

    def advertised_addrs(self) -> list[multiaddr.Multiaddr]: ...

    def serve(self, protocol: str, handler: StreamHandler) -> None: ...

    def stop_serving(self, protocol: str) -> None: ...
