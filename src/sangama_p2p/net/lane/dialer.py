"""The upstream side of lanes (a client or the previous stage): ask for an offer, connect, prove it, and fall back
to a libp2p stream when no lane can be had (see :mod:`sangama_p2p.net.lane`)."""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

import trio

from ... import clock
from ...errors import LaneError, NetworkError, StreamClosed, WireError, describe, translate
from ...wire.framing import DEFAULT_MAX_FRAME
from ...wire.messages import ErrorMessage, LaneOffer
from ...wire.protocols import LANE_PROTOCOL, STAGE_PROTOCOL
from ..holepunch import stream_link
from ..movable import MovableStream, open_movable, watch_and_move
from ..streams import FramedStream
from .handshake import NONCE_BYTES, READY, lane_key, seal_hello
from .records import LaneStream, receive_exactly

__all__ = ["LaneDialer", "open_lane"]

log = logging.getLogger(__name__)


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
        raise translate(exc, LaneError, f"{peer_id} offers no lanes")
    fs = FramedStream(stream, max_frame=4096)
    try:
        link = stream_link(stream)
        if not link.direct:
            raise LaneError(f"the link to {peer_id} is {link}: lanes need a direct connection", lasting=False)
        ip = _ip_of(link.remote_addr)
        try:
            msg = await fs.recv()
        except (WireError, StreamClosed) as exc:  # ours, re-classed on purpose: any failure here means "no lane"
            raise LaneError(f"bad lane offer from {peer_id}: {describe(exc)}") from exc
    finally:
        await fs.aclose()
    if isinstance(msg, ErrorMessage):
        raise LaneError(f"{peer_id} refused a lane: {msg.code.name} {msg.message}")
    if not isinstance(msg, LaneOffer):
        raise LaneError(f"{peer_id} answered the lane request with {type(msg).__name__}")
    try:
        sock = await trio.open_tcp_stream(ip, msg.port)
    except OSError as exc:
        raise translate(exc, LaneError, f"cannot reach the lane port {ip}:{msg.port}")
    try:
        hello, dialler_nonce = seal_hello(msg.token, msg.key)
        try:
            await sock.send_all(hello)
            stage_nonce = await receive_exactly(sock, NONCE_BYTES, "the lane's ready")
            lane = LaneStream(sock, lane_key(msg.key, msg.token, dialler_nonce, stage_nonce), peer_id, dialer=True,
                              max_frame=max_frame)
            ready = await lane.read_record()
        except (StreamClosed, WireError, trio.BrokenResourceError, OSError) as exc:  # a reset, a cut record: no lane
            raise LaneError(f"the lane handshake with {peer_id} failed: {describe(exc)}") from exc
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
        if failed is not None and clock.now() - failed[0] < self.retry_after:
            return None
        try:
            lane = await open_lane(self.node, peer_id, timeout=self.timeout, max_frame=self.max_frame)
        except NetworkError as exc:  # LaneError, and anything else a hostile or broken port makes us see
            exc = exc if isinstance(exc, LaneError) else LaneError(f"{type(exc).__name__}: {exc}")
            log.info("no lane to %s, using libp2p streams: %s", key, exc)
            if exc.lasting:
                self.failed[key] = (clock.now(), str(exc))
            return None
        self.failed.pop(key, None)
        return lane

    async def stage_stream(self, peer_id: Any) -> Any:
        """The stream for ``/sangama/stage/2`` frames to ``peer_id`` (already connected): a lane where one can be
        set up, else a libp2p stream; raises :class:`NetworkError` when neither opens."""
        lane = await self.open(peer_id)
        if lane is not None:
            return lane
        try:
            stream = await open_movable(self.node.host, peer_id, STAGE_PROTOCOL)
        except Exception as exc:  # py-libp2p raises several unrelated types
            raise translate(exc, NetworkError, f"cannot open a stage stream to {peer_id}")
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
        raise translate(exc, LaneError, f"bad IP in {remote_addr!r}")
