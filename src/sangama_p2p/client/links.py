"""The client's streams: one long-lived ``/sangama/stage/2`` stream per stage peer, shared by every session.

The stream is a direct lane (:mod:`sangama_p2p.net.lane`) where the stage offers one, else a libp2p stream.

A :class:`Link`'s reader task hands each frame to the session it names (``session_id``); ``InfoResponse`` frames
answer :meth:`Link.probe` in order. When the stream ends, every subscribed session gets a :class:`LinkLost`, which is
how a chain notices a dead peer without waiting for a timeout.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import trio

from .. import clock
from ..errors import NetworkError, SangamaError
from ..net.lane import LaneDialer
from ..net.seam import Network
from ..net.stage_stream import open_stage_stream
from ..net.streams import FramedStream
from ..wire.messages import InfoRequest, InfoResponse, Message

__all__ = ["Link", "LinkLost", "LinkPool"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkLost:
    """Delivered to a session's channel when the stream to ``peer`` ended."""

    peer: str
    reason: str


Delivery = tuple[str, Message | LinkLost]


class Link:
    """One stream to one stage peer."""

    def __init__(self, fs: FramedStream) -> None:
        self.fs = fs
        self.peer = fs.peer
        self.subscribers: dict[bytes, trio.MemorySendChannel[Delivery]] = {}
        self._probes: deque[trio.MemorySendChannel[InfoResponse]] = deque()
        self.lost: str | None = None

    def subscribe(self, session_id: bytes, channel: trio.MemorySendChannel[Delivery]) -> None:
        self.subscribers[session_id] = channel
        if self.lost is not None:
            channel.send_nowait((self.peer, LinkLost(self.peer, self.lost)))

    def unsubscribe(self, session_id: bytes) -> None:
        self.subscribers.pop(session_id, None)

    async def send(self, msg: Message) -> None:
        await self.fs.send(msg)

    async def probe(self) -> tuple[InfoResponse, float]:
        """``InfoRequest`` on this stream: the peer's fresh figures and the round-trip time in seconds."""
        send, recv = trio.open_memory_channel[InfoResponse](1)
        self._probes.append(send)
        t0 = clock.now()
        await self.fs.send(InfoRequest())
        try:
            info = await recv.receive()
        except trio.EndOfChannel as exc:
            raise NetworkError(f"link to {self.peer} closed during a probe") from exc
        return info, clock.now() - t0

    async def read_loop(self) -> None:
        reason = "stream closed"
        try:
            while True:
                msg = await self.fs.recv()
                if msg is None:
                    break
                if isinstance(msg, InfoResponse):
                    if self._probes:
                        self._probes.popleft().send_nowait(msg)
                    continue
                sid = getattr(msg, "session_id", None)
                channel = self.subscribers.get(sid) if sid is not None else None
                if channel is not None:
                    try:
                        channel.send_nowait((self.peer, msg))
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self.subscribers.pop(sid, None)
                else:
                    log.debug("frame from %s for no session here: %s", self.peer, type(msg).__name__)
        except (SangamaError, trio.BrokenResourceError) as exc:
            reason = f"{type(exc).__name__}: {exc}"
        finally:
            self.lost = reason
            for channel in list(self.subscribers.values()):
                try:
                    channel.send_nowait((self.peer, LinkLost(self.peer, reason)))
                except (trio.BrokenResourceError, trio.ClosedResourceError):  # that session's reader is gone
                    pass
            while self._probes:
                self._probes.popleft().close()
            with trio.CancelScope(shield=True):
                await self.fs.aclose(reset=True)


class LinkPool:
    """Links by peer id, opened on first use; a lost link is replaced by a fresh one on the next ``get``."""

    def __init__(self, node: Network, nursery: trio.Nursery, *, max_frame: int, connect_timeout: float,
                 local_stage: Callable[[], Awaitable[Any]] | None = None, lanes: bool = True,
                 lane_timeout: float = 2.0) -> None:
        self.node = node
        self.lanes = LaneDialer(node, enabled=lanes, timeout=lane_timeout, max_frame=max_frame)
        self.local_stage = local_stage  # opens an in-process stream to this node's own stage server
        self.nursery = nursery
        self.max_frame = max_frame
        self.connect_timeout = connect_timeout
        self.links: dict[str, Link] = {}
        self._opening: dict[str, trio.Event] = {}

    async def get(self, peer: str, addrs: tuple[str, ...] = ()) -> Link:
        while peer in self._opening:
            await self._opening[peer].wait()
        link = self.links.get(peer)
        if link is not None and link.lost is None:
            return link
        self._opening[peer] = trio.Event()
        try:
            link = Link(await self._open(peer, addrs))
            self.links[peer] = link
            self.nursery.start_soon(link.read_loop)
            return link
        finally:
            self._opening.pop(peer).set()

    async def _open(self, peer: str, addrs: tuple[str, ...]) -> FramedStream:
        if self.local_stage is not None and peer == self.node.peer_id.to_base58():
            return FramedStream(await self.local_stage(), max_frame=self.max_frame)
        return await open_stage_stream(self.node, self.lanes, peer, addrs=addrs, timeout=self.connect_timeout,
                                       max_frame=self.max_frame)

    async def aclose(self) -> None:
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            for link in list(self.links.values()):
                await link.fs.aclose(reset=True)
        self.links.clear()

