"""Circuit relay v2: serve as a relay, hold reservations on relays, dial peers through them.

Why our own client pieces on top of py-libp2p 0.8.1's ``relay.circuit_v2``:

* its reservation refresher gives up when the relay connection drops and never tells us the reservation's relay
  addresses, so we run the RESERVE exchange ourselves and keep each reservation alive (:mod:`.reservations`): refreshed
  at ``refresh_fraction`` of the granted lifetime, re-made at once when the relay connection closes (a restarted
  relay forgets every reservation), retried with backoff on failure;
* it advertises no ``/p2p-circuit`` address; :meth:`RelayClient.circuit_addrs` computes them (see :func:`circuit_addr`)
  for ``Node.extra_addrs`` and our DHT records;
* ``host.connect`` refuses ``/p2p-circuit`` addresses and its transport's ``dial`` makes a reservation first, so
  :meth:`RelayClient.dial` sends the HOP CONNECT itself and upgrades the circuit stream to a Noise + Yamux connection;
* the destination labels an accepted relayed connection as relayed "via itself"; our STOP handler labels it with the
  real relay, so every connection can report ``relayed via <relay id>``, and it tells the hole puncher that a relayed
  connection was accepted (only the accepting side drives DCUtR).

The relay side (``open_relay_client(host, relay_config=RelayServiceConfig())``) is ``CircuitV2Protocol`` with
``allow_hop=True`` and limits sized for a bootstrap node (:mod:`.relay_hop`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetConn
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.exceptions import MultiselectClientError, ProtocolNotSupportedError
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from .. import clock
from ..errors import NotARelayError, RelayError
from .node import offers_protocol
from .relay_hop import CircuitProtocol, InboundCallback, RelayServiceConfig
from .reservations import ReservationKeeper
from .watch import PeerWatch, watch_peers

__all__ = [
    "ConnectFn",
    "RelayClient",
    "RelayServiceConfig",
    "Reservation",
    "circuit_addr",
    "offers_hop",
    "open_relay_client",
    "parse_circuit_addr",
    "relay_of",
]

logger = logging.getLogger(__name__)

ConnectFn = Callable[[PeerInfo], Awaitable[object]]
"""How to reach a relay, e.g. ``lambda info: node.connect(info.peer_id, info.addrs)``; default ``host.connect``."""

@dataclass(frozen=True)
class Reservation:
    """A slot held on a relay: until ``expires_at`` (Unix time) peers can reach us at ``circuit_addrs``."""

    relay_id: str
    expires_at: float
    circuit_addrs: tuple[str, ...]

    def valid(self, now: float | None = None) -> bool:
        return (clock.wall() if now is None else now) < self.expires_at


def circuit_addr(relay_addr: Multiaddr | str, relay_id: ID | str, peer_id: ID | str) -> Multiaddr:
    """``<relay transport addr>/p2p/<relay>/p2p-circuit/p2p/<peer>``: how others reach ``peer_id`` through a relay."""
    base = Multiaddr(str(relay_addr))
    try:
        if base.value_for_protocol("p2p") is not None:
            base = base.decapsulate(Multiaddr(f"/p2p/{base.value_for_protocol('p2p')}"))
    except Exception:  # no /p2p component: nothing to strip
        pass
    return Multiaddr(f"{base}/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}")


def parse_circuit_addr(addr: Multiaddr | str) -> tuple[Multiaddr, ID, ID]:
    """Split a circuit address into (relay transport address, relay id, destination id); :class:`RelayError` if not one."""
    text = str(addr)
    try:
        Multiaddr(text)  # validates every component, peer ids included (ID.from_base58 takes any base58 text)
    except Exception as exc:
        raise RelayError(f"not a valid multiaddr: {text!r}: {exc}") from exc
    head, sep, tail = text.partition("/p2p-circuit")
    if not sep or not tail.startswith("/p2p/") or "/p2p/" not in head:
        raise RelayError(f"not a circuit address: {text!r}")
    transport, _, relay = head.rpartition("/p2p/")
    try:
        return Multiaddr(transport or "/"), ID.from_base58(relay), ID.from_base58(tail[len("/p2p/") :].split("/")[0])
    except Exception as exc:
        raise RelayError(f"bad peer id in circuit address {text!r}: {exc}") from exc


def relay_of(conn: INetConn) -> ID | None:
    """The relay a connection runs through, or ``None`` for a direct connection."""
    try:
        addrs = conn.get_transport_addresses()
    except Exception:
        return None
    for addr in addrs or ():
        text = str(addr)
        if "/p2p-circuit" in text:
            head = text.partition("/p2p-circuit")[0]
            try:
                return ID.from_base58(head.rpartition("/p2p/")[2])
            except Exception:
                return None
    return None


class RelayClient:
    """Accepts relayed connections, keeps reservations on relays alive, and dials peers through relays.

    Use through :func:`open_relay_client`, which owns the tasks. ``on_inbound`` (settable later) hears of every
    relayed connection this peer accepts; the hole puncher hooks in there.
    """

    def __init__(
        self,
        host: IHost,
        nursery: trio.Nursery,
        protocol: CircuitProtocol,
        watch: PeerWatch,
        refresh_fraction: float = 0.75,
        retry_s: float = 1.0,
        timeout_s: float = 10.0,
        connect: ConnectFn | None = None,
    ) -> None:
        if not 0.0 < refresh_fraction < 1.0:
            raise ValueError(f"refresh_fraction must lie in (0, 1), got {refresh_fraction}")
        self.host = host
        self._nursery = nursery
        self._protocol = protocol
        self._timeout_s = timeout_s
        self._connect: ConnectFn = connect or host.connect
        self._reservations: dict[str, Reservation] = {}
        self.keeper = ReservationKeeper(self, nursery, watch, refresh_fraction=refresh_fraction, retry_s=retry_s,
                                        on_change=self._changed)
        self.on_change: Callable[[], None] | None = None
        """Called whenever a kept reservation was granted, refreshed or lost (e.g. to re-advertise addresses)."""

    @property
    def on_inbound(self) -> InboundCallback | None:
        return self._protocol.on_inbound

    @on_inbound.setter
    def on_inbound(self, callback: InboundCallback | None) -> None:
        self._protocol.on_inbound = callback

    # -- reservations ----------------------------------------------------------------------------------------------
    @property
    def reservations(self) -> tuple[Reservation, ...]:
        """Reservations that are still valid now."""
        now = clock.wall()
        return tuple(r for r in self._reservations.values() if r.valid(now))

    def circuit_addrs(self) -> list[Multiaddr]:
        """The ``/p2p-circuit`` addresses to advertise (py-libp2p advertises none by itself)."""
        return [Multiaddr(a) for r in self.reservations for a in r.circuit_addrs]

    async def reserve(self, relay: PeerInfo) -> Reservation:
        """Connect to ``relay`` and reserve (or refresh) a slot on it; :class:`RelayError` if refused or unreachable."""
        try:
            with trio.fail_after(self._timeout_s):
                await self._connect(relay)
                try:
                    stream = await self.host.new_stream(relay.peer_id, [HOP_PROTOCOL_ID])
                except Exception as exc:  # the multistream "na" decides; identify only backs it up
                    if _protocol_unsupported(exc) or offers_hop(self.host, relay.peer_id) is False:
                        message = f"peer {relay.peer_id} is not a relay (it refused {HOP_PROTOCOL_ID})"
                        raise NotARelayError(message) from exc
                    raise
                try:
                    await write_delimited_msg(stream, HopMessage(type=HopMessage.RESERVE))
                    reply = await read_delimited_msg(stream, HopMessage)
                finally:
                    await stream.close()
        except trio.TooSlowError as exc:
            raise RelayError(f"relay {relay.peer_id} did not answer a reservation within {self._timeout_s} s") from exc
        except RelayError:
            raise
        except Exception as exc:
            raise RelayError(f"reservation on relay {relay.peer_id} failed: {exc}") from exc
        status = int(reply.status) if reply.HasField("status") else 0
        if status != StatusCode.OK or not reply.HasField("reservation"):
            raise RelayError(f"relay {relay.peer_id} refused the reservation (status {status})", status)
        expires = float(reply.reservation.expire)
        if not math.isfinite(expires) or expires <= clock.wall():
            raise RelayError(f"relay {relay.peer_id} granted an already expired reservation ({expires})")
        relay_addrs = [str(a) for a in relay.addrs]
        for raw in reply.reservation.addrs:
            try:
                text = str(Multiaddr(raw))
            except Exception:  # one bad address from the relay must not cost the reservation
                continue
            if not text.startswith(("/ip4/127.", "/ip6/::1/")):  # loopback is nobody else's way in
                relay_addrs.append(text)
        me = self.host.get_id()
        circuits = tuple(dict.fromkeys(str(circuit_addr(a, relay.peer_id, me)) for a in relay_addrs))
        reservation = Reservation(str(relay.peer_id), expires, circuits)
        self._reservations[str(relay.peer_id)] = reservation
        logger.info("reserved a slot on relay %s until %.0f", relay.peer_id, expires)
        return reservation

    def forget(self, relay_id: str) -> bool:
        """Drop our reservation on ``relay_id`` (it was lost or refused); True if there was one."""
        return self._reservations.pop(relay_id, None) is not None

    def keep_reservation(self, relay: PeerInfo) -> None:
        """Hold a reservation on ``relay`` while the client is open (:meth:`.ReservationKeeper.keep`)."""
        self.keeper.keep(relay)

    def keep_reservations(self, relays: Sequence[PeerInfo], want: int) -> None:
        """Hold reservations on at least ``want`` of ``relays`` (:meth:`.ReservationKeeper.keep_some`)."""
        self.keeper.keep_some(relays, want)

    @property
    def not_relays(self) -> set[str]:
        """Peers (ids as strings) that were asked to keep a reservation but offer no relay service."""
        return self.keeper.not_relays

    @property
    def refreshes(self) -> int:
        """Reservations refreshed in place (not counting first grants and regained ones)."""
        return self.keeper.refreshes

    def _changed(self) -> None:
        if self.on_change is not None:
            self.on_change()

    # -- dialling --------------------------------------------------------------------------------------------------
    async def dial(self, addr: Multiaddr | str) -> INetConn:
        """Open a connection to the peer named by circuit address ``addr`` through its relay."""
        relay_addr, relay_id, peer_id = parse_circuit_addr(addr)
        label = Multiaddr(f"/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}")
        try:
            with trio.fail_after(self._timeout_s):
                if str(relay_addr) not in ("", "/"):
                    await self._connect(PeerInfo(relay_id, [relay_addr]))
                stream = await self.host.new_stream(relay_id, [HOP_PROTOCOL_ID])
                await write_delimited_msg(
                    stream, HopMessage(type=HopMessage.CONNECT, peer=CircuitPeerId(id=peer_id.to_bytes()))
                )
                reply = await read_delimited_msg(stream, HopMessage)
                status = int(reply.status) if reply.HasField("status") else 0
                if status != StatusCode.OK:
                    await stream.reset()
                    raise RelayError(f"relay {relay_id} refused a circuit to {peer_id} (status {status})", status)
                raw = RawConnection(
                    stream=stream, initiator=True, connection_type=ConnectionType.RELAYED, addresses=[label]
                )
                conn = await self.host.upgrade_outbound_connection(raw, peer_id)
        except trio.TooSlowError as exc:
            raise RelayError(f"no circuit to {peer_id} via {relay_id} within {self._timeout_s} s") from exc
        except RelayError:
            raise
        except Exception as exc:
            raise RelayError(f"circuit to {peer_id} via {relay_id} failed: {exc}") from exc
        conn.set_transport_info([label], ConnectionType.RELAYED)  # type: ignore[attr-defined]
        return conn


def offers_hop(host: IHost, peer_id: ID) -> bool | None:
    """Whether identify lists the circuit relay v2 HOP protocol for ``peer_id``; ``None`` while nobody knows."""
    return offers_protocol(host, peer_id, HOP_PROTOCOL_ID)


def _protocol_unsupported(exc: BaseException | None) -> bool:
    """True if ``exc`` (or what caused it) is the peer's multistream "na": it does not speak the protocol.

    py-libp2p 0.8.1's ``select_one_of`` catches the typed :class:`ProtocolNotSupportedError` and raises a plain
    :class:`MultiselectClientError` whose message starts "protocols not supported" instead; nothing else tells.
    """
    for _ in range(16):
        if exc is None:
            return False
        if isinstance(exc, ProtocolNotSupportedError):
            return True
        if isinstance(exc, MultiselectClientError) and str(exc).startswith("protocols not supported"):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


@asynccontextmanager
async def open_relay_client(
    host: IHost,
    *,
    refresh_fraction: float = 0.75,
    retry_s: float = 1.0,
    timeout_s: float = 10.0,
    relay_config: RelayServiceConfig | None = None,
    connect: ConnectFn | None = None,
) -> AsyncIterator[RelayClient]:
    """Run a :class:`RelayClient` on ``host``; pass ``relay_config`` to also relay for others (a public node)."""
    kwargs: dict[str, object] = {}
    if relay_config is not None:
        kwargs = {"limits": relay_config.limits(), "allow_hop": True}
    protocol = CircuitProtocol(host, **kwargs)
    async with background_trio_service(protocol), watch_peers(host) as watch, trio.open_nursery() as nursery:
        await protocol.event_started.wait()
        client = RelayClient(host, nursery, protocol, watch, refresh_fraction, retry_s, timeout_s, connect)
        try:
            yield client
        finally:
            nursery.cancel_scope.cancel()
