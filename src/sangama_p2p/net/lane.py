"""Direct lanes: stage frames on a plain TCP connection, keyed through an authenticated libp2p stream.

Why: py-libp2p's Noise + Yamux spends about 0.2 ms of Python per 8 KiB frame on each side (measured in
../shared/notes/py-libp2p-0.8.1.md: a four-hop trip of 8 KiB frames takes 1.55 ms over Noise + Yamux and 0.24 ms over
plain trio TCP). A pipeline trip is four such hops, so for small models the transport cost more than the compute.
A lane keeps libp2p for what it is good at (identity, discovery, NAT traversal, relays) and moves only the
long-lived stage traffic between two directly connected peers onto a TCP connection of its own.

Handshake (the upstream side, a client or the previous stage, always dials; only stage servers listen)::

    upstream                                             stage (LaneListener)
    -- /sangama/lane/3 stream (Noise, peer ids checked) -->
    <-------------- LaneOffer(port, token, key) ----------   used once, expires after ``offer_ttl`` s
    == TCP connect to <remote IP of that libp2p connection>:port ==>
    -- token + dialler nonce + record(hello) ------------->   all of it read, then checked and claimed at once
    <------------- stage nonce + record(ready) -----------   the lane now serves /sangama/stage/2 frames

The bytes and the key schedule are in :mod:`sangama_p2p.net.lane_handshake`: each connection's key is derived from
the offer's key and fresh nonces of both sides, and the offer is claimed without yielding between looking it up and
removing it, so a handshake replayed on a second connection is refused and no two lanes ever share a key.

After the handshake every write is one record ``[u32 big-endian length][AES-256-GCM ciphertext + 16-byte tag]``
with the nonce ``direction byte (0 upstream->stage, 1 back) + 3 zero bytes + u64 record counter``: records cannot be
forged, replayed, dropped or reordered without failing authentication, which closes the lane. The key derives from
one that travelled inside the Noise-encrypted stream to the authenticated peer, so the lane belongs to that peer id
(:attr:`LaneStream.muxed_conn` ``.peer_id``) exactly as the libp2p stream did, and session ownership checks work
unchanged. Relayed connections never get a lane (the address would be the relay's). Anything that fails before
``ready`` (no lane protocol, a closed port, a reset, NAT, a timeout) raises :class:`LaneError`, and the caller uses
a ``/sangama/stage/2`` stream over libp2p instead.

Handshakes are bounded before anyone has proved anything: at most ``max_handshakes`` at once and
``max_handshakes_per_source`` per source IP (a new connection over either bound cuts the oldest handshake, so idle
connections cannot hold the slots), each cut after ``handshake_timeout`` (2 s). Lanes are bounded per peer: one
that holds ``max_lanes_per_peer`` open lanes is answered ``CAPACITY`` instead of an offer (it uses libp2p streams),
so no peer can take the stage's file descriptors. With a ``budget`` (a
:class:`~sangama_p2p.wire.framing.ByteBudget` shared with the stage's other streams), a record that does not arrive
whole reserves its length from it first, and the lane fails when the budget cannot cover it.

:class:`LaneStream` has the surface :class:`~sangama_p2p.streams.FramedStream` reads from a py-libp2p stream
(``read``, ``write``, ``close``, ``reset``, ``muxed_conn.peer_id``), so everything above it is unchanged.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import ErrorCode, NetworkError, WireError
from ..streams import FramedStream, PeerConn, StreamClosed
from ..wire.framing import DEFAULT_MAX_FRAME, ByteBudget, FrameDecoder
from ..wire.messages import LANE_TOKEN_BYTES, ErrorMessage, LaneOffer
from ..wire.protocols import LANE_PROTOCOL, STAGE_PROTOCOL
from .holepunch import stream_link
from .lane_handshake import (DOWN, HELLO, HELLO_BYTES, NONCE_BYTES, READY, TAG_BYTES, UP, lane_key, open_hello,
                             parse_hello, record_nonce, seal_hello)

__all__ = ["HELLO", "READY", "LaneDialer", "LaneError", "LaneListener", "LaneStream", "open_lane"]

log = logging.getLogger(__name__)

_LEN = struct.Struct(">I")
RECV_CHUNK: Final = 256 * 1024
_SYNC_WRITES: Final = os.name == "posix"  # os.write on a socket's fd; elsewhere try_write leaves it all to write_raw


class LaneError(NetworkError):
    """A lane could not be set up (the caller falls back to libp2p) or a lane's record failed authentication.

    ``lasting`` is False when the reason may pass soon (the link is relayed until hole punching upgrades it)."""

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


class LaneStream:
    """One end of a lane: plaintext ``read``/``write`` over AES-GCM records on a trio TCP stream."""

    def __init__(self, sock: trio.SocketStream, key: bytes, peer_id: Any, *, dialer: bool,
                 max_frame: int = DEFAULT_MAX_FRAME, decoder: FrameDecoder | None = None,
                 budget: ByteBudget | None = None) -> None:
        self.sock = sock
        self.muxed_conn = PeerConn(peer_id)
        self._key = key
        self._aead = AESGCM(key)
        self._send_dir, self._recv_dir = (UP, DOWN) if dialer else (DOWN, UP)
        self._send_n = 0
        self._recv_n = 0
        # a record holds one frame: its 4-byte prefix, at most max_frame bytes, and the tag
        self._records = decoder or FrameDecoder(max_frame + 4 + TAG_BYTES, budget)
        self._plain: list[bytes] = []  # decrypted records not yet read, oldest last
        self._buf = b""
        self._eof = False
        self.closed = False
        self._failed: LaneError | None = None
        self.remote = _remote(sock)

    # ---- records -------------------------------------------------------------------------------------------
    def seal(self, data: bytes | bytearray | memoryview) -> bytes:
        nonce = record_nonce(self._send_dir, self._send_n)
        self._send_n += 1
        body = self._aead.encrypt(nonce, bytes(data), None)
        return _LEN.pack(len(body)) + body

    def open(self, body: bytes) -> bytes:
        nonce = record_nonce(self._recv_dir, self._recv_n)
        self._recv_n += 1
        try:
            return self._aead.decrypt(nonce, body, None)
        except InvalidTag as exc:
            raise LaneError(f"a record from {self.remote} failed authentication (forged, replayed or reordered)") \
                from exc

    async def read_record(self) -> bytes | None:
        """The next record's plaintext, or ``None`` at a clean end of the connection."""
        while not self._plain:
            if self._failed is not None:
                raise self._failed
            if self._eof:
                return None
            try:
                data = await self.sock.receive_some(RECV_CHUNK)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
                raise StreamClosed(f"lane to {self.remote} failed: {type(exc).__name__}: {exc}") from exc
            if not data:
                self._eof = True
                self._records.finish()  # a record cut off raises TruncatedFrameError
                return None
            plain = []
            for body in self._records.feed(data):
                try:
                    plain.append(self.open(body))
                except LaneError as exc:  # hand out the authentic records before it, then fail for good
                    self._failed = exc
                    break
            plain.reverse()
            self._plain = plain
        return self._plain.pop()

    @property
    def has_data(self) -> bool:
        """Decrypted bytes are waiting (the next :meth:`read` returns without touching the socket)."""
        return bool(self._plain) or bool(self._buf)

    # ---- the py-libp2p stream surface ----------------------------------------------------------------------
    async def read(self, n: int | None = None) -> bytes:
        """Up to ``n`` plaintext bytes; ``b""`` at a clean end."""
        if not self._buf:
            record = await self.read_record()
            if record is None:
                return b""
            self._buf = record
        if n is None or n >= len(self._buf):
            out, self._buf = self._buf, b""
            return out
        out, self._buf = self._buf[:n], self._buf[n:]
        return out

    async def write(self, data: bytes | bytearray | memoryview) -> None:
        """One record per write (FramedStream writes whole frames under its lock)."""
        await self.write_raw(self.seal(data))

    def try_write(self, data: bytes | bytearray | memoryview) -> memoryview:
        """Seal ``data`` as one record and hand the socket what it takes now, without waiting or yielding to trio.

        Returns the part of the record not yet written (empty when all of it went, the usual case for a stage's
        frames); the caller must write it with :meth:`write_raw` before anything else. Why: ``send_all`` costs a
        trip through trio's scheduler per frame (a yield after the send), on every hop of every trip.
        """
        record = memoryview(self.seal(data))
        if not _SYNC_WRITES:
            return record
        try:
            sent = os.write(self.sock.socket.fileno(), record)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise StreamClosed(f"cannot write to lane {self.remote}: {type(exc).__name__}: {exc}") from exc
        return record[sent:]

    async def write_raw(self, data: bytes | bytearray | memoryview) -> None:
        """Write bytes that are already records (or the rest of one, from :meth:`try_write`)."""
        try:
            await self.sock.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise StreamClosed(f"cannot write to lane {self.remote}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        self._drop()
        await self.sock.aclose()

    async def reset(self) -> None:
        self._drop()
        await self.sock.aclose()

    def _drop(self) -> None:
        """The lane is done: a partial record's buffer (and its budget share) goes now."""
        self.closed = True
        self._records.close()
        self._plain, self._buf = [], b""


def _remote(sock: trio.SocketStream) -> str:
    try:
        host, port = sock.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# ---- the stage side ----------------------------------------------------------------------------------------
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
            raise LaneError(f"cannot listen for lanes on port {self.port} of {', '.join(hosts)}: {exc}") from exc
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for listener in self._listeners:
                    nursery.start_soon(self._accept_loop, listener)
                self.node.host.set_stream_handler(LANE_PROTOCOL, self._on_offer_stream)
                task_status.started()
        finally:
            self.stop()
            self._nursery = None
            with trio.CancelScope(shield=True):
                await self._close_listeners()

    def stop(self) -> None:
        """Stop offering and accepting lanes (lanes already handed over are not affected)."""
        try:
            self.node.host.remove_stream_handler(LANE_PROTOCOL)
        except Exception:  # the host may already be gone
            pass
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
        now = time.monotonic()
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
        scope = self._handshake_slot(_remote(sock).rsplit(":", 1)[0])
        try:
            with scope:
                lane = await self._accept(sock)
        except (LaneError, WireError, StreamClosed, trio.BrokenResourceError, OSError) as exc:
            log.debug("lane from %s refused: %s", _remote(sock), exc)
        finally:
            self._handshakes.pop(scope, None)
        if lane is None:
            if scope.cancelled_caught:
                log.debug("lane handshake from %s cut (idle, or crowded out)", _remote(sock))
            with trio.CancelScope(shield=True):
                await sock.aclose()
            return
        self._lanes.setdefault(lane.muxed_conn.peer_id.to_base58(), []).append(lane)
        await self.on_lane(lane)

    async def _accept(self, sock: trio.SocketStream) -> LaneStream:
        """Read the whole hello, then (without yielding) check it and claim its offer; answer ready."""
        hello = parse_hello(await _receive_exactly(sock, HELLO_BYTES, "the lane hello"))
        entry = self._offers.get(hello.token)
        if entry is None or entry[2] < time.monotonic():
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


async def _receive_exactly(sock: trio.SocketStream, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes (never more: what follows stays in the socket); :class:`LaneError` if it closes first."""
    data = b""
    while len(data) < n:
        try:
            chunk = await sock.receive_some(n - len(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise LaneError(f"connection failed before {what}: {type(exc).__name__}: {exc}") from exc
        if not chunk:
            raise LaneError(f"connection closed before {what}")
        data += chunk
    return data


def listen_hosts(node: Any) -> tuple[str, ...]:
    """The IPs of the node's TCP listen addresses (``0.0.0.0`` / ``::`` stay wildcards), in order, unique."""
    hosts: list[str] = []
    for addr in node.listen_addrs():
        for proto in ("ip4", "ip6"):
            try:
                value = addr.value_for_protocol(proto)
            except Exception:  # that protocol is not in the address
                continue
            if value and value not in hosts:
                hosts.append(value)
    return tuple(hosts) or ("0.0.0.0",)


# ---- the upstream side -------------------------------------------------------------------------------------
async def open_lane(node: Any, peer_id: Any, *, timeout: float = 2.0, max_frame: int = DEFAULT_MAX_FRAME
                    ) -> LaneStream:
    """A ready lane to ``peer_id`` over an open direct libp2p connection; :class:`LaneError` when none can be set
    up within ``timeout`` seconds (no lane protocol there, a relayed link, a port that does not answer)."""
    with trio.move_on_after(timeout) as scope:
        return await _open_lane(node, peer_id, max_frame)
    assert scope.cancelled_caught
    raise LaneError(f"no lane to {peer_id} within {timeout} s")


async def _open_lane(node: Any, peer_id: Any, max_frame: int) -> LaneStream:
    try:
        stream = await node.host.new_stream(peer_id, [LANE_PROTOCOL])
    except Exception as exc:  # py-libp2p raises several unrelated types when the protocol is not served
        raise LaneError(f"{peer_id} offers no lanes: {type(exc).__name__}: {exc}") from exc
    fs = FramedStream(stream, max_frame=4096)
    try:
        link = stream_link(stream)
        if not link.direct:
            raise LaneError(f"the link to {peer_id} is {link}: lanes need a direct connection", lasting=False)
        ip = _ip_of(link.remote_addr)
        try:
            msg = await fs.recv()
        except (WireError, StreamClosed) as exc:
            raise LaneError(f"bad lane offer from {peer_id}: {exc}") from exc
    finally:
        await fs.aclose()
    if isinstance(msg, ErrorMessage):
        raise LaneError(f"{peer_id} refused a lane: {msg.code.name} {msg.message}")
    if not isinstance(msg, LaneOffer):
        raise LaneError(f"{peer_id} answered the lane request with {type(msg).__name__}")
    try:
        sock = await trio.open_tcp_stream(ip, msg.port)
    except OSError as exc:
        raise LaneError(f"cannot reach the lane port {ip}:{msg.port}: {exc}") from exc
    try:
        hello, dialler_nonce = seal_hello(msg.token, msg.key)
        try:
            await sock.send_all(hello)
            stage_nonce = await _receive_exactly(sock, NONCE_BYTES, "the lane's ready")
            lane = LaneStream(sock, lane_key(msg.key, msg.token, dialler_nonce, stage_nonce), peer_id, dialer=True,
                              max_frame=max_frame)
            ready = await lane.read_record()
        except (StreamClosed, WireError, trio.BrokenResourceError, OSError) as exc:  # a reset, a cut record
            raise LaneError(f"the lane handshake with {peer_id} failed: {type(exc).__name__}: {exc}") from exc
        if ready != READY:
            raise LaneError(f"{peer_id} did not confirm the lane")
    except BaseException:
        with trio.CancelScope(shield=True):
            await sock.aclose()
        raise
    return lane


class LaneDialer:
    """Open lanes for one node, remembering peers where a lane failed so that they are not tried again (and the
    setup timeout is not paid again) for ``retry_after`` seconds. ``enabled=False`` never tries."""

    def __init__(self, node: Any, *, enabled: bool = True, timeout: float = 2.0, retry_after: float = 600.0,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.node = node
        self.enabled = enabled
        self.timeout = timeout
        self.retry_after = retry_after
        self.max_frame = max_frame
        self.failed: dict[str, tuple[float, str]] = {}  # peer id -> (when, why)

    async def open(self, peer_id: Any) -> LaneStream | None:
        """A ready lane to ``peer_id`` (already connected over libp2p), or ``None``: use a libp2p stream."""
        if not self.enabled:
            return None
        key = peer_id.to_base58()
        failed = self.failed.get(key)
        if failed is not None and time.monotonic() - failed[0] < self.retry_after:
            return None
        try:
            lane = await open_lane(self.node, peer_id, timeout=self.timeout, max_frame=self.max_frame)
        except NetworkError as exc:  # LaneError, and anything else a hostile or broken port makes us see
            exc = exc if isinstance(exc, LaneError) else LaneError(f"{type(exc).__name__}: {exc}")
            log.info("no lane to %s, using libp2p streams: %s", key, exc)
            if exc.lasting:
                self.failed[key] = (time.monotonic(), str(exc))
            return None
        self.failed.pop(key, None)
        return lane

    async def stage_stream(self, peer_id: Any) -> Any:
        """The stream for ``/sangama/stage/2`` frames to ``peer_id`` (already connected): a lane where one can be
        set up, else a libp2p stream; raises :class:`NetworkError` when neither opens."""
        lane = await self.open(peer_id)
        if lane is not None:
            return lane
        from .movable import MovableStream, open_movable, watch_and_move

        try:
            stream = await open_movable(self.node.host, peer_id, STAGE_PROTOCOL)
        except Exception as exc:  # py-libp2p raises several unrelated types
            raise NetworkError(f"cannot open a stage stream to {peer_id}: {exc}") from exc
        if isinstance(stream, MovableStream):  # relayed now: onto the punched connection once there is one
            self.node.nursery.start_soon(watch_and_move, self.node.host, stream, peer_id)
        return stream


def _ip_of(remote_addr: str) -> str:
    """``/ip4/1.2.3.4/tcp/5`` -> ``1.2.3.4`` (validated)."""
    parts = remote_addr.split("/")
    if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
        raise LaneError(f"no IP in the connection's remote address {remote_addr!r}")
    try:
        return str(ipaddress.ip_address(parts[2]))
    except ValueError as exc:
        raise LaneError(f"bad IP in {remote_addr!r}") from exc
