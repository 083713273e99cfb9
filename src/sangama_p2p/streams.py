"""A ``/sangama/stage/2`` stream as a sequence of messages: framed reads, whole-frame locked writes.

Shared by ``stage/`` and ``client/`` (which never import each other). It applies the wire engineer's rules for
py-libp2p streams in one place:

* ``stream.read`` raises on end of stream instead of returning ``b""``; :meth:`FramedStream.read` translates that
  so :class:`~sangama_p2p.wire.framing.FrameReader` sees a clean end;
* each frame is one ``write`` of ``encode_message_frame(msg)``, under a per-stream lock, so concurrent senders
  never interleave partial frames.

:func:`memory_stream_pair` gives two connected in-process streams with the same surface, so a peer that serves a
stage and also generates can put its own stage in its chains (libp2p cannot dial its own peer id).

Decoding errors are left to the caller (an ``InvalidMessageError`` with a ``session_id`` fails only that session;
any other ``WireError`` fails the stream), see docs/protocol.md.
"""

from __future__ import annotations

from typing import Any

import trio

from .errors import NetworkError
from .wire.codec import decode, encode_message_frame
from .wire.framing import DEFAULT_MAX_FRAME, FrameReader
from .wire.messages import Message

__all__ = ["FramedStream", "MemoryStream", "PeerConn", "StreamClosed", "memory_stream_pair"]


class StreamClosed(NetworkError):
    """The stream ended or was reset; nothing more can be sent or received on it."""


class FramedStream:
    """Messages over one py-libp2p stream (``INetStream``). ``peer`` is the authenticated remote peer id (base58)."""

    def __init__(self, stream: Any, *, max_frame: int = DEFAULT_MAX_FRAME) -> None:
        self.stream = stream
        self.max_frame = max_frame
        self.peer: str = stream.muxed_conn.peer_id.to_base58()
        self._reader = FrameReader(self.read, max_frame)
        self._lock = trio.Lock()
        self.closed = False

    async def read(self, n: int) -> bytes:
        """``read`` for FrameReader: ``b""`` at end of stream; a reset or a closed connection also ends it."""
        try:
            return await self.stream.read(n)
        except Exception as exc:  # StreamEOF, StreamReset, MuxedConnUnavailable, ...: all end this stream
            if type(exc).__name__ in ("StreamEOF", "StreamClosed"):
                return b""
            raise StreamClosed(f"stream from {self.peer} failed: {type(exc).__name__}: {exc}") from exc

    async def recv(self) -> Message | None:
        """The next message, or ``None`` at a clean end of stream. Raises WireError for bad bytes."""
        payload = await self._reader.next_frame()
        if payload is None:
            return None
        return decode(payload)

    async def send(self, msg: Message) -> None:
        """Send one message as one write; raises :class:`StreamClosed` when the stream is gone."""
        frame = encode_message_frame(msg, self.max_frame)
        await self.send_frame(frame)

    async def send_frame(self, frame: bytes, *, timeout: float = 60.0) -> None:
        """Write one whole frame. The write is shielded from cancellation: a frame cut off halfway would corrupt a
        stream that other sessions share; a write stuck for ``timeout`` seconds closes the stream instead."""
        if self.closed:
            raise StreamClosed(f"stream to {self.peer} is closed")
        async with self._lock:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(timeout) as scope:
                    try:
                        await self.stream.write(frame)
                    except Exception as exc:  # py-libp2p raises several unrelated types on a dead stream
                        self.closed = True
                        raise StreamClosed(f"cannot write to {self.peer}: {type(exc).__name__}: {exc}") from exc
                if scope.cancelled_caught:
                    self.closed = True
                    try:
                        await self.stream.reset()
                    except Exception:  # already gone
                        pass
                    raise StreamClosed(f"a write to {self.peer} took over {timeout} s")

    async def aclose(self, *, reset: bool = False) -> None:
        """Close (or reset) the stream; never raises."""
        self.closed = True
        with trio.move_on_after(1.0) as scope:
            scope.shield = True
            try:
                await (self.stream.reset() if reset else self.stream.close())
            except Exception:  # already gone
                pass


class PeerConn:
    """What FramedStream reads from ``stream.muxed_conn``: the remote peer id (for streams that are not py-libp2p's:
    in-process streams, direct lanes)."""

    def __init__(self, peer_id: Any) -> None:
        self.peer_id = peer_id


class MemoryStream:
    """One end of an in-process stream with py-libp2p's stream surface: ``read``, ``write``, ``close``, ``reset``."""

    def __init__(self, remote: Any, send: trio.MemorySendChannel[bytes], recv: trio.MemoryReceiveChannel[bytes]):
        self.muxed_conn = PeerConn(remote)
        self._send = send
        self._recv = recv
        self._buf = b""
        self._reset = False

    async def read(self, n: int | None = None) -> bytes:
        if not self._buf:
            if self._reset:
                raise StreamClosed("stream was reset")
            try:
                self._buf = await self._recv.receive()
            except (trio.EndOfChannel, trio.ClosedResourceError):
                return b""
            except trio.BrokenResourceError as exc:
                raise StreamClosed("stream was reset") from exc
        k = len(self._buf) if n is None else n
        out, self._buf = self._buf[:k], self._buf[k:]
        return out

    async def write(self, data: bytes) -> None:
        try:
            await self._send.send(bytes(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise StreamClosed("the other end is gone") from exc

    async def close(self) -> None:
        await self._send.aclose()

    async def reset(self) -> None:
        self._reset = True
        await self._send.aclose()
        await self._recv.aclose()


def memory_stream_pair(a: Any, b: Any) -> tuple[MemoryStream, MemoryStream]:
    """Two connected streams: the first is held by peer ``a`` (its remote is ``b``), the second by ``b``."""
    a_send, b_recv = trio.open_memory_channel[bytes](64)
    b_send, a_recv = trio.open_memory_channel[bytes](64)
    return MemoryStream(b, a_send, a_recv), MemoryStream(a, b_send, b_recv)
