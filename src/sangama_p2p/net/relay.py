"""Circuit relay v2: serve as a relay, hold reservations on relays, dial peers through them.

Why our own client pieces on top of py-libp2p 0.8.1's ``relay.circuit_v2``:

* its reservation refresher gives up when the relay connection drops and never tells us the reservation's relay
  addresses, so we run the RESERVE exchange ourselves and keep each reservation alive in a task that re-connects,
  refreshes at ``refresh_fraction`` of the granted lifetime and retries on failure;
* it advertises no ``/p2p-circuit`` address; :meth:`RelayClient.circuit_addrs` computes them (see :func:`circuit_addr`)
  for ``Node.extra_addrs`` and our DHT records;
* ``host.connect`` refuses ``/p2p-circuit`` addresses and its transport's ``dial`` makes a reservation first, so
  :meth:`RelayClient.dial` sends the HOP CONNECT itself and upgrades the circuit stream to a Noise + Yamux connection;
* the destination labels an accepted relayed connection as relayed "via itself"; our STOP handler labels it with the
  real relay, so every connection can report ``relayed via <relay id>``, and it tells the hole puncher that a relayed
  connection was accepted (only the accepting side drives DCUtR).

The relay side (``open_relay_client(host, relay_config=RelayServiceConfig())``) is stock ``CircuitV2Protocol`` with
``allow_hop=True`` and limits sized for a bootstrap node.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetConn, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.protocol_muxer.exceptions import MultiselectClientError, ProtocolNotSupportedError
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as CircuitPeerId
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL_ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from libp2p.tools.anyio_service import background_trio_service
from multiaddr import Multiaddr

from ..errors import NotARelayError, RelayError
from .node import offers_protocol

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

InboundCallback = Callable[[ID, ID], None]
"""Called as ``callback(peer_id, relay_id)`` when a relayed connection from ``peer_id`` was accepted."""

ConnectFn = Callable[[PeerInfo], Awaitable[object]]
"""How to reach a relay, e.g. ``lambda info: node.connect(info.peer_id, info.addrs)``; default ``host.connect``."""

MAX_RETRY_S = 60.0


@dataclass(frozen=True)
class RelayServiceConfig:
    """Limits of a relay node. py-libp2p's defaults (4 reservations, 8 circuits) are too small for a bootstrap node."""

    max_reservations: int = 128
    max_circuits: int = 64
    reservation_ttl_s: int = 3600
    circuit_duration_s: int = 3600
    circuit_bytes: int = 1 << 30

    def limits(self) -> RelayLimits:
        return RelayLimits(
            duration=self.circuit_duration_s,
            data=self.circuit_bytes,
            max_circuit_conns=self.max_circuits,
            max_reservations=self.max_reservations,
            reservation_ttl=self.reservation_ttl_s,
        )


@dataclass(frozen=True)
class Reservation:
    """A slot held on a relay: until ``expires_at`` (Unix time) peers can reach us at ``circuit_addrs``."""

    relay_id: str
    expires_at: float
    circuit_addrs: tuple[str, ...]

    def valid(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) < self.expires_at


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


class _CircuitProtocol(CircuitV2Protocol):
    """CircuitV2Protocol whose STOP side labels accepted connections with the real relay and reports them."""

    def __init__(self, host: IHost, on_inbound: InboundCallback | None = None, **kwargs: object) -> None:
        super().__init__(host, **kwargs)  # type: ignore[arg-type]
        self.on_inbound = on_inbound
        self.relayed_bytes = 0  # what this relay carried for others, both directions (status --json shows it)

    async def handle_incoming_connection(self, stream: INetStream, remote_peer_id: bytes) -> None:
        peer_id = ID(remote_peer_id)
        relay_id = stream.muxed_conn.peer_id
        addr = Multiaddr(f"/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}")
        raw = RawConnection(stream=stream, initiator=False, connection_type=ConnectionType.RELAYED, addresses=[addr])
        try:
            muxed = await self.host.upgrade_inbound_connection(raw, addr)
        except Exception as exc:
            await stream.close()
            raise ConnectionError(f"relayed connection from {peer_id} failed to upgrade: {exc}") from exc
        for conn in self.host.get_network().get_connections(peer_id):
            if getattr(conn, "muxed_conn", None) is muxed:
                conn.set_transport_info([addr], ConnectionType.RELAYED)  # type: ignore[attr-defined]
        logger.debug("accepted relayed connection from %s via %s", peer_id, relay_id)
        if self.on_inbound is not None:
            self.on_inbound(peer_id, relay_id)

    async def _relay_data(self, src_stream: INetStream, dst_stream: INetStream, peer_id: ID,
                          deadline: float | None = None, circuit_data_limit: list[int] | None = None) -> None:
        """One direction of a circuit: copy ``src`` to ``dst``; on EOF close (FIN) ``dst``, on error reset both.

        Replaces py-libp2p 0.8.1's, which keys active circuits by one peer id and, when a circuit ends, closes the
        streams stored under that id - another circuit's when a peer has two (a client's and a stage's circuit to
        the same stage: the second died ~1 s after the first ended, measured in namespaces).
        """
        try:
            while True:
                if deadline is not None and time.monotonic() > deadline:
                    logger.info("circuit to/from %s reached its duration limit", peer_id)
                    raise RelayError("circuit duration limit")
                try:
                    data = await src_stream.read(1 << 16)
                except Exception:  # EOF or reset: this direction is done
                    data = b""
                if not data:
                    with trio.move_on_after(self.close_timeout):
                        await dst_stream.close()
                    return
                if circuit_data_limit is not None:
                    if len(data) > circuit_data_limit[0]:
                        logger.info("circuit to/from %s reached its data limit", peer_id)
                        raise RelayError("circuit data limit")
                    circuit_data_limit[0] -= len(data)
                with trio.fail_after(self.write_timeout):
                    await dst_stream.write(data)
                self.relayed_bytes += len(data)
        except Exception as exc:  # a limit, a write timeout or a broken stream: the circuit is over
            logger.debug("circuit to/from %s ends: %s", peer_id, exc)
            for stream in (src_stream, dst_stream):
                try:
                    await stream.reset()
                except Exception:
                    pass


class RelayClient:
    """Accepts relayed connections, keeps reservations on relays alive, and dials peers through relays.

    Use through :func:`open_relay_client`, which owns the tasks. ``on_inbound`` (settable later) hears of every
    relayed connection this peer accepts; the hole puncher hooks in there.
    """

    def __init__(
        self,
        host: IHost,
        nursery: trio.Nursery,
        protocol: _CircuitProtocol,
        refresh_fraction: float = 0.75,
        retry_s: float = 5.0,
        timeout_s: float = 10.0,
        connect: ConnectFn | None = None,
    ) -> None:
        if not 0.0 < refresh_fraction < 1.0:
            raise ValueError(f"refresh_fraction must lie in (0, 1), got {refresh_fraction}")
        self.host = host
        self._nursery = nursery
        self._protocol = protocol
        self._refresh_fraction = refresh_fraction
        self._retry_s = retry_s
        self._timeout_s = timeout_s
        self._connect: ConnectFn = connect or host.connect
        self._reservations: dict[str, Reservation] = {}
        self._kept: set[str] = set()
        self.not_relays: set[str] = set()
        """Peers (ids as strings) that were asked to keep a reservation but offer no relay service."""
        self.refreshes = 0
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
        now = time.time()
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
        if not math.isfinite(expires) or expires <= time.time():
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

    def keep_reservation(self, relay: PeerInfo) -> None:
        """Hold a reservation on ``relay`` for as long as the client is open: refresh early, retry on failure.

        A peer that turns out not to be a relay (:class:`NotARelayError`) is given up on at once and listed in
        :attr:`not_relays`, until ``keep_reservation`` is called for it again.
        """
        key = str(relay.peer_id)
        if key not in self._kept:
            self._kept.add(key)
            self.not_relays.discard(key)
            self._nursery.start_soon(self._keep, relay)

    async def _keep(self, relay: PeerInfo) -> None:
        first = True
        retry = self._retry_s
        while True:
            try:
                reservation = await self.reserve(relay)
            except NotARelayError as exc:
                logger.info("%s; not reserving a slot on it", exc)
                key = str(relay.peer_id)
                self._reservations.pop(key, None)
                self._kept.discard(key)
                self.not_relays.add(key)
                self._changed()
                return
            except RelayError as exc:
                logger.warning("%s; retrying in %.1f s", exc, retry)
                self._changed()
                await trio.sleep(retry)
                retry = min(2 * retry, MAX_RETRY_S)  # a full or dead relay is not hammered
                continue
            retry = self._retry_s
            if not first:
                self.refreshes += 1
            first = False
            self._changed()
            lifetime = reservation.expires_at - time.time()
            await trio.sleep(max(0.5, lifetime * self._refresh_fraction))

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
    retry_s: float = 5.0,
    timeout_s: float = 10.0,
    relay_config: RelayServiceConfig | None = None,
    connect: ConnectFn | None = None,
) -> AsyncIterator[RelayClient]:
    """Run a :class:`RelayClient` on ``host``; pass ``relay_config`` to also relay for others (a public node)."""
    kwargs: dict[str, object] = {}
    if relay_config is not None:
        kwargs = {"limits": relay_config.limits(), "allow_hop": True}
    protocol = _CircuitProtocol(host, **kwargs)
    async with background_trio_service(protocol), trio.open_nursery() as nursery:
        await protocol.event_started.wait()
        client = RelayClient(host, nursery, protocol, refresh_fraction, retry_s, timeout_s, connect)
        try:
            yield client
        finally:
            nursery.cancel_scope.cancel()
