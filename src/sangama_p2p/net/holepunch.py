"""Hole punching (DCUtR) on relayed links, and :class:`LinkInfo`: is a link ``direct`` or ``relayed via <relay id>``?

A relayed link stays usable as the fallback; the side that *accepted* it runs DCUtR (:class:`HolePuncher`) and, when
the punch succeeds, new streams go over the direct connection (py-libp2p picks direct over relayed). Dialling itself
(direct first, then relays) is ``Traversal.connect`` in ``traversal.py``.

:class:`HolePuncher` is py-libp2p 0.8.1's ``DCUtRProtocol`` with the three traps measured in namespaces removed
(measured through two real NATs in network namespaces: ``tests/net/test_nat.py``):

1. both sides drive: the stock auto-drive loop runs on both peers every 2 s, and two simultaneous sessions both dial as
   Noise responder. We switch it off; the relay client calls :meth:`HolePuncher.punch_soon` on the accepting side only.
2. a 10 s stall: the spec's step 0 (plain dial of the peer's known addresses) is capped at ``step0_timeout_s``.
3. announce addresses break punching: the punch binds its source to the first address of ``host.get_addrs()``,
   which is the announced (not local) IP when announce addresses are set; the bind fails and py-libp2p silently
   dials from an ephemeral port that the NAT maps elsewhere. We bind the wildcard address with our real listen port.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Literal

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from .addrs import remote_addr
from .relay import RelayClient, relay_of

__all__ = [
    "HolePuncher",
    "LinkInfo",
    "link_info",
    "run_hole_puncher",
    "stream_link",
    "tcp_listen_port",
    "wait_direct",
]

logger = logging.getLogger(__name__)

PUNCH_RETRY_S = (2.0, 6.0)
"""Pauses before a failed hole punch is tried again (so at most three attempts per relayed link accepted). A punch that
cannot succeed (port-randomising NATs, a firewall) costs the relayed link nothing but these few messages."""


@dataclass(frozen=True)
class LinkInfo:
    """How we are connected to a peer right now: ``str(info)`` is ``direct`` or ``relayed via <relay id>``."""

    peer_id: str
    kind: Literal["direct", "relayed"]
    remote_addr: str
    relay_id: str | None = None

    @property
    def direct(self) -> bool:
        return self.kind == "direct"

    def __str__(self) -> str:
        return "direct" if self.direct else f"relayed via {self.relay_id}"


def _info(peer_id: ID, conn: Any) -> LinkInfo:
    """Describe a swarm connection or a muxed connection (``stream.muxed_conn``) alike."""
    relay = relay_of(conn)
    if relay is not None:
        addrs = conn.get_transport_addresses()
        return LinkInfo(str(peer_id), "relayed", str(addrs[0]) if addrs else "", str(relay))
    remote = remote_addr(conn) if hasattr(conn, "muxed_conn") else conn.get_remote_address()
    text = ""
    if remote:
        text = f"/ip6/{remote[0]}/tcp/{remote[1]}" if ":" in remote[0] else f"/ip4/{remote[0]}/tcp/{remote[1]}"
    return LinkInfo(str(peer_id), "direct", text)


def stream_link(stream: INetStream) -> LinkInfo:
    """The link one stream runs over (a peer may have a direct and a relayed connection at once)."""
    return _info(stream.muxed_conn.peer_id, stream.muxed_conn)


def link_info(host: IHost, peer_id: ID) -> LinkInfo | None:
    """The best open link to ``peer_id`` (direct preferred), or ``None`` when not connected."""
    conns = [c for c in host.get_network().get_connections(peer_id) if not getattr(c, "is_closed", False)]
    infos = [_info(peer_id, c) for c in conns]
    direct = [i for i in infos if i.direct]
    return (direct or infos or [None])[0]


async def wait_direct(host: IHost, peer_id: ID, timeout_s: float) -> LinkInfo | None:
    """Wait up to ``timeout_s`` for a direct link to ``peer_id``; the direct link, or ``None`` if none came up."""
    with trio.move_on_after(timeout_s):
        while True:
            info = link_info(host, peer_id)
            if info is not None and info.direct:
                return info
            await trio.sleep(0.05)
    return None


def tcp_listen_port(host: IHost) -> int | None:
    """The TCP port this host really listens on (not an announced one), from its listeners."""
    for listener in getattr(host.get_network(), "listeners", {}).values():
        for addr in listener.get_addrs():
            try:
                port = addr.value_for_protocol("tcp")
            except Exception:
                continue
            if port:
                return int(port)
    return None


class HolePuncher(DCUtRProtocol):
    """DCUtR driven only by the side that accepted the relayed connection, with step 0 capped and the wildcard bind.

    Run it as a service (``async with run_hole_puncher(host) as puncher``) on every peer: the accepting side
    initiates, the dialling side answers through the protocol handler.
    """

    def __init__(self, host: IHost, step0_timeout_s: float = 1.0, dial_timeout_s: int = 5) -> None:
        super().__init__(host, dial_timeout=dial_timeout_s)
        self.step0_timeout_s = step0_timeout_s
        self.attempts = 0

    async def _auto_drive_loop(self) -> None:
        """Disabled (trap 1): both peers driving at once makes both dial as Noise responder."""
        return None

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        """Spec step 0, capped (trap 2): a peer behind NAT would otherwise stall us for ``dial_timeout``."""
        with trio.move_on_after(self.step0_timeout_s):
            return await super()._try_unilateral_upgrade(peer_id)
        return await self._verify_direct_connection(peer_id)

    async def _dial_peer(
        self,
        peer_id: ID,
        addr: Multiaddr,
        source: tuple[str, int] | None = None,
        as_responder: bool = False,
    ) -> None:
        """Bind punch dials to the wildcard address and our real listen port (trap 3), never to an announced IP."""
        if source is not None:
            port = tcp_listen_port(self.host) or source[1]
            source = ("::" if ":" in source[0] else "0.0.0.0", port)
        await super()._dial_peer(peer_id, addr, source, as_responder)

    async def initiate_hole_punch(self, peer_id: ID) -> bool:
        """Count every DCUtR session we start (tests check that only the accepting side starts any)."""
        self.attempts += 1
        return await super().initiate_hole_punch(peer_id)

    def punch_soon(self, peer_id: ID, relay_id: ID | None = None) -> None:
        """Start a hole punch to ``peer_id`` in the background (the relay client calls this on accept)."""
        if self._nursery is None:
            logger.debug("hole puncher not running; no punch to %s", peer_id)
            return
        self._nursery.start_soon(self._punch, peer_id)

    async def _punch(self, peer_id: ID) -> None:
        """Punch, and punch again after each of :data:`PUNCH_RETRY_S` while the link is still relayed only: the two
        sides' simultaneous dials are timed by one measured round trip, and on a busy machine one can miss."""
        for attempt, pause in enumerate((*PUNCH_RETRY_S, None), 1):
            try:
                ok = await self.initiate_hole_punch(peer_id)
                why = "" if ok else "no direct connection"
            except Exception as exc:  # a failed punch only costs the upgrade; the relayed link stays
                ok, why = False, str(exc)
            if ok:
                logger.info("hole punch to %s succeeded (attempt %d)", peer_id, attempt)
                return
            if pause is None:
                logger.info("hole punch to %s failed (%s); staying relayed after %d attempts", peer_id, why, attempt)
                return
            logger.info("hole punch to %s failed (%s); again in %.0f s", peer_id, why, pause)
            await trio.sleep(pause)
            info = link_info(self.host, peer_id)
            if info is None or info.direct:  # gone, or direct after all (the other side's dial got through)
                return


@asynccontextmanager
async def run_hole_puncher(
    host: IHost,
    relay_client: RelayClient | None = None,
    *,
    step0_timeout_s: float = 1.0,
    dial_timeout_s: int = 5,
) -> AsyncIterator[HolePuncher]:
    """Run DCUtR on ``host`` and let ``relay_client`` start a punch for every relayed connection it accepts."""
    puncher = HolePuncher(host, step0_timeout_s, dial_timeout_s)
    async with background_trio_service(puncher):
        await puncher.event_started.wait()
        if relay_client is not None:
            relay_client.on_inbound = puncher.punch_soon
        try:
            yield puncher
        finally:
            if relay_client is not None:
                relay_client.on_inbound = None
