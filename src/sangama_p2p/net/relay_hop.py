"""The relay side of circuit relay v2, and the STOP side every peer runs: py-libp2p 0.8.1's ``CircuitV2Protocol``
with two fixes (see :class:`CircuitProtocol`) and limits sized for a bootstrap node (:class:`RelayServiceConfig`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio
from libp2p.abc import IHost, INetStream
from libp2p.connection_types import ConnectionType
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from multiaddr import Multiaddr

from ..errors import RelayError

__all__ = ["CircuitProtocol", "InboundCallback", "RelayServiceConfig"]

logger = logging.getLogger(__name__)

InboundCallback = Callable[[ID, ID], None]
"""Called as ``callback(peer_id, relay_id)`` when a relayed connection from ``peer_id`` was accepted."""


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




class CircuitProtocol(CircuitV2Protocol):
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


