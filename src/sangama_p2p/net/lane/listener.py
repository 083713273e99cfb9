"""The stage side of lanes: offers over ``/sangama/lane/3``, the TCP listener and the handshake's checks (see
:mod:`sangama_p2p.net.lane`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ... import clock
from ...errors import ErrorCode, LaneError, StreamClosed, WireError, translate
from ...wire.framing import DEFAULT_MAX_FRAME, ByteBudget
from ...wire.messages import LANE_TOKEN_BYTES, ErrorMessage, LaneOffer
from ...wire.protocols import LANE_PROTOCOL
from ..streams import FramedStream
from .handshake import HELLO_BYTES, NONCE_BYTES, READY, lane_key, open_hello, parse_hello
from .records import LaneStream, receive_exactly, remote_label

__all__ = ["LaneListener", "lanes_offered", "listen_hosts"]

log = logging.getLogger(__name__)


def lanes_offered(node: Any, port: int) -> bool:
    """Whether a stage on ``node`` should offer lanes on ``port`` (0: any free port): not when it announces addresses
    (a port forward, a cloud VM's public IP) and its lane port is picked at random. Upstream peers dial the lane at
    the IP they reached the stage on; a random port there is neither forwarded nor announced, so every new link waited
    for the lane's timeout (2 s) before falling back to libp2p. ``--lane-port`` forwarded like the libp2p port turns
    them on again."""
    announced = tuple(getattr(getattr(node, "config", None), "announce_addrs", ()) or ())
    if announced and port == 0:
        log.info("lanes off: this stage announces %s and its lane port would be random (not forwarded); set "
                 "--lane-port to a port forwarded like the libp2p one to use lanes", ", ".join(announced))
        return False
    return True


class LaneListener:
    """Accept lanes for a stage server: register ``/sangama/lane/3`` on ``node`` and listen on TCP.

    ``on_lane(lane)`` receives each ready :class:`LaneStream` (the server treats it as a new stage stream).
    ``hosts`` are the IPs to listen on (default: those of the node's listen addresses); ``port`` 0 picks a free
    port. Run it in a nursery: ``await nursery.start(listener.run)``.
    """

    def __init__(self, node: Any, on_lane: Callable[[LaneStream], Awaitable[None]], *, port: int = 0,
                 hosts: tuple[str, ...] | None = None, max_frame: int = DEFAULT_MAX_FRAME, offer_ttl: float = 10.0,
                 max_offers: int = 256, max_offers_per_peer: int = 4, max_handshakes: int = 64,
                 max_handshakes_per_source: int = 8, handshake_timeout: float = 2.0, max_lanes_per_peer: int = 8,
                 budget: ByteBudget | None = None) -> None:
        self.node = node
        self.on_lane = on_lane
        self.port = port
        self.hosts = hosts
        self.max_frame = max_frame
        self.offer_ttl = offer_ttl
        self.max_offers = max_offers
        self.max_offers_per_peer = max_offers_per_peer
        self.max_handshakes = max_handshakes
        self.max_handshakes_per_source = max_handshakes_per_source
        self.handshake_timeout = handshake_timeout
        self.max_lanes_per_peer = max_lanes_per_peer
        self.budget = budget
        self._lanes: dict[str, list[LaneStream]] = {}  # peer id (base58) -> its lanes handed over, not yet closed
        self._handshakes: dict[trio.CancelScope, str] = {}  # handshakes in progress, oldest first -> source IP
        self._offers: dict[bytes, tuple[Any, bytes, float]] = {}  # token -> (peer id, key, expiry)
        self._listeners: list[trio.SocketListener] = []
        self._nursery: trio.Nursery | None = None

    @property
    def bound_port(self) -> int:
        """The TCP port lanes are accepted on (after ``__aenter__``)."""
        return self._listeners[0].socket.getsockname()[1] if self._listeners else 0

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen (``await nursery.start(listener.run)`` returns once bound) and accept lanes until cancelled or
        :meth:`stop`; raises :class:`LaneError` when the port cannot be bound."""
        hosts = self.hosts if self.hosts is not None else listen_hosts(self.node)
        port = self.port
        try:
            for host in hosts:
                # one port for every listen IP: the first bind picks it, the others reuse it
                self._listeners.extend(await trio.open_tcp_listeners(port, host=host))
                port = self.bound_port
        except OSError as exc:
            await self._close_listeners()
            raise translate(exc, LaneError, f"cannot listen for lanes on port {self.port} of {', '.join(hosts)}")
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for listener in self._listeners:
                    nursery.start_soon(self._accept_loop, listener)
                self.node.serve(LANE_PROTOCOL, self._on_offer_stream)
                task_status.started()
        finally:
            self.stop()
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self._close_listeners()

    def stop(self) -> None:
        """Stop offering and accepting lanes (lanes already handed over are not affected)."""
        self.node.stop_serving(LANE_PROTOCOL)
        self._offers.clear()
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    async def _close_listeners(self) -> None:
        for listener in self._listeners:
            await listener.aclose()
        self._listeners.clear()

    def offer(self, peer_id: Any) -> LaneOffer:
        """A fresh single-use offer for ``peer_id``. At most ``max_offers_per_peer`` stay pending per peer and
        ``max_offers`` in all (the oldest go first), so one peer asking again and again cannot push out the
        offers of others."""
        now = clock.now()
        for token in [t for t, (_, _, expiry) in self._offers.items() if expiry < now]:
            del self._offers[token]
        mine = [t for t, (pid, _, _) in self._offers.items() if pid == peer_id]
        for token in mine[: max(0, len(mine) - self.max_offers_per_peer + 1)]:
            del self._offers[token]
        while len(self._offers) >= self.max_offers:
            del self._offers[next(iter(self._offers))]
        token, key = os.urandom(LANE_TOKEN_BYTES), AESGCM.generate_key(bit_length=256)
        self._offers[token] = (peer_id, key, now + self.offer_ttl)
        return LaneOffer(self.bound_port, token, key)

    def lanes_of(self, peer_id: Any) -> int:
        """Open lanes of ``peer_id`` (closed ones are forgotten here)."""
        key = peer_id.to_base58() if hasattr(peer_id, "to_base58") else str(peer_id)
        live = [lane for lane in self._lanes.get(key, ()) if not lane.closed]
        if live:
            self._lanes[key] = live
        else:
            self._lanes.pop(key, None)
        return len(live)

    async def _on_offer_stream(self, stream: Any) -> None:
        fs = FramedStream(stream, max_frame=4096)
        peer_id = stream.muxed_conn.peer_id
        try:
            with trio.move_on_after(self.handshake_timeout):
                if self.lanes_of(peer_id) >= self.max_lanes_per_peer:
                    await fs.send(ErrorMessage(None, None, ErrorCode.CAPACITY,
                                               f"at most {self.max_lanes_per_peer} lanes per peer"))
                else:
                    await fs.send(self.offer(peer_id))
        except (StreamClosed, WireError) as exc:
            log.debug("lane offer to %s failed: %s", fs.peer, exc)
        finally:
            await fs.aclose()

    async def _accept_loop(self, listener: trio.SocketListener) -> None:
        """Accept connections until cancelled (trio.serve_listeners would close each when its handler returns; a
        lane outlives the handshake)."""
        assert self._nursery is not None
        while True:
            try:
                sock = await listener.accept()
            except OSError as exc:  # out of file descriptors and the like: wait, as trio's own server does
                log.warning("accepting a lane failed: %s", exc)
                await trio.sleep(0.1)
                continue
            self._nursery.start_soon(self._on_tcp, sock)

    def _handshake_slot(self, source: str) -> trio.CancelScope:
        """A cancel scope for one more handshake from ``source``, ending after ``handshake_timeout``. When the
        source already holds ``max_handshakes_per_source`` (or all ``max_handshakes`` are taken) the oldest of them
        (of all) is cut: a handshake takes milliseconds, so only connections that idle are ever old."""
        mine = [scope for scope, ip in self._handshakes.items() if ip == source]
        victim = None
        if len(mine) >= self.max_handshakes_per_source:
            victim = mine[0]
        elif len(self._handshakes) >= self.max_handshakes:
            victim = next(iter(self._handshakes))
        if victim is not None:
            victim.cancel()
            del self._handshakes[victim]
        scope = trio.CancelScope(deadline=trio.current_time() + self.handshake_timeout)
        self._handshakes[scope] = source
        return scope

    async def _on_tcp(self, sock: trio.SocketStream) -> None:
        lane = None
        scope = self._handshake_slot(remote_label(sock).rsplit(":", 1)[0])
        try:
            with scope:
                lane = await self._accept(sock)
        except (LaneError, WireError, StreamClosed, trio.BrokenResourceError, OSError) as exc:
            log.debug("lane from %s refused: %s", remote_label(sock), exc)
        finally:
            self._handshakes.pop(scope, None)
        if lane is None:
            if scope.cancelled_caught:
                log.debug("lane handshake from %s cut (idle, or crowded out)", remote_label(sock))
            with trio.CancelScope(shield=True):
                await sock.aclose()
            return
        self._lanes.setdefault(lane.muxed_conn.peer_id.to_base58(), []).append(lane)
        await self.on_lane(lane)

    async def _accept(self, sock: trio.SocketStream) -> LaneStream:
        """Read the whole hello, then (without yielding) check it and claim its offer; answer ready."""
        hello = parse_hello(await receive_exactly(sock, HELLO_BYTES, "the lane hello"))
        entry = self._offers.get(hello.token)
        if entry is None or entry[2] < clock.now():
            raise LaneError("unknown, used or expired lane token")
        peer_id, offer_key, _ = entry
        if not open_hello(hello, offer_key):  # a stolen token without the key: the offer stays for its owner
            raise LaneError("a lane hello that does not authenticate under its offer's key")
        del self._offers[hello.token]  # claimed: no await since the lookup, so no second connection gets it
        if self.lanes_of(peer_id) >= self.max_lanes_per_peer:  # several offers were pending
            raise LaneError(f"{peer_id} already holds {self.max_lanes_per_peer} lanes")
        stage_nonce = os.urandom(NONCE_BYTES)
        key = lane_key(offer_key, hello.token, hello.dialler_nonce, stage_nonce)
        lane = LaneStream(sock, key, peer_id, dialer=False, max_frame=self.max_frame, budget=self.budget)
        await lane.write_raw(stage_nonce + lane.seal(READY))
        return lane



def listen_hosts(node: Any) -> tuple[str, ...]:
    """The IPs of the node's TCP listen addresses (``0.0.0.0`` / ``::`` stay wildcards), in order, unique."""
    hosts: list[str] = []
    for addr in node.listen_addrs():
        for proto in ("ip4", "ip6"):
            try:
                value = addr.value_for_protocol(proto)
            except LookupError:  # that protocol is not in the address (multiaddr's ProtocolLookupError)
                continue
            if value and value not in hosts:
                hosts.append(value)
    return tuple(hosts) or ("0.0.0.0",)

