"""A ``/sangama/stage/2`` stream as a sequence of messages: framed reads, whole-frame locked writes.

Shared by ``stage/`` and ``client/`` (which never import each other). It applies the wire engineer's rules for
py-libp2p streams in one place:

* ``stream.read`` raises on end of stream instead of returning ``b""``; :meth:`FramedStream.read` translates that
  so :class:`~sangama_p2p.wire.framing.FrameReader` sees a clean end;
* each frame is one ``write`` of ``encode_message_frame(msg)``, under a per-stream lock, so concurrent senders
  never interleave partial frames; on a lane (:mod:`sangama_p2p.net.lane`) with no write in flight, the frame goes
  to the socket at once instead (``try_write``: no lock, no cancel scopes, no yield), and only a part the socket
  did not take waits for the lock.

:func:`memory_stream_pair` gives two connected in-process streams with the same surface, so a peer that serves a
stage and also generates can put its own stage in its chains (libp2p cannot dial its own peer id).

Decoding errors are left to the caller (an ``InvalidMessageError`` with a ``session_id`` fails only that session;
any other ``WireError`` fails the stream), see docs/protocol.md.
"""

from __future__ import annotations

from functools import cached_property
from typing import Any

import trio

from ..errors import StreamClosed, translate
from ..wire.codec import decode, encode_message_frame
from ..wire.framing import DEFAULT_MAX_FRAME, ByteBudget, FrameReader
from ..wire.messages import Message
from .addrs import stream_source

__all__ = ["FRAME_BYTES", "FramedStream", "MemoryStream", "PeerConn", "memory_stream_pair"]

FRAME_BYTES: dict[tuple[str, str], int] = {}
"""Bytes this process's framed streams received and sent, by (link kind, ``"in"``/``"out"``): ``lane``, ``libp2p``,
``local`` (the stage's ``/metrics``, ``sangama_stage_frame_bytes_total``)."""


def _count(kind: str, direction: str, n: int) -> None:
    FRAME_BYTES[kind, direction] = FRAME_BYTES.get((kind, direction), 0) + n


class FramedStream:
    """Messages over one py-libp2p stream (``INetStream``). ``peer`` is the authenticated remote peer id (base58)."""

    def __init__(self, stream: Any, *, max_frame: int = DEFAULT_MAX_FRAME, budget: ByteBudget | None = None) -> None:
        """``budget``: shared with other streams, it bounds the bytes of partial frames they hold together and per
        peer, and how long a partial frame may take (a frame over what is left, or past its deadline, fails this
        stream with :class:`~sangama_p2p.errors.BufferBudgetError`)."""
        self.stream = stream
        self.max_frame = max_frame
        self.peer: str = stream.muxed_conn.peer_id.to_base58()
        self._reader = FrameReader(self.read, max_frame, budget=budget, peer=self.peer)
        self._lock = trio.Lock()
        self.closed = False
        # streams that can write without waiting (lanes): ``try_write(frame) -> unwritten rest``, ``write_raw(rest)``
        self._try_write = getattr(stream, "try_write", None)
        self._tail: memoryview | bytes = b""  # the unwritten rest of a frame written without waiting

    @cached_property
    def source(self) -> tuple[str, ...]:
        """The far end's address and network (:func:`~sangama_p2p.net.addrs.source_keys`), read once, when a stage
        counts a session it opens."""
        return stream_source(self.stream)

    async def read(self, n: int) -> bytes:
        """``read`` for FrameReader: ``b""`` at end of stream; a reset or a closed connection also ends it. While a
        partial frame is buffered, it waits at most until that frame's deadline (then BufferBudgetError)."""
        decoder = self._reader.decoder
        left = decoder.time_left()
        if left is None:
            return await self._read(n)
        with trio.move_on_after(max(left, 0.0)):
            return await self._read(n)
        raise decoder.expire()

    async def _read(self, n: int) -> bytes:
        try:
            data = await self.stream.read(n)
            _count(self.link_kind, "in", len(data))
            return data
        except Exception as exc:  # StreamEOF, StreamReset, MuxedConnUnavailable, ...: all end this stream
            if type(exc).__name__ in ("StreamEOF", "StreamClosed"):  # libp2p's end of stream, or ours (a reset)
                return b""
            raise translate(exc, StreamClosed, f"stream from {self.peer} failed")  # a lane's LaneError stays one

    @property
    def link_kind(self) -> str:
        """What carries the stream: ``"lane"`` (a direct lane), ``"local"`` (in-process) or ``"libp2p"``."""
        return getattr(self.stream, "link_kind", "libp2p")

    @property
    def has_frames(self) -> bool:
        """More frames were already received (or, on a lane, decrypted) and wait to be read: a caller deciding
        whether to act on a frame at once or to wait for the ones behind it asks this."""
        return self._reader.has_frames or bool(getattr(self.stream, "has_data", False))

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

    @property
    def can_send_nowait(self) -> bool:
        """Whether :meth:`send_nowait` would write now: an open lane with no write in flight."""
        return self._try_write is not None and not self.closed and not self._lock.locked() and not self._tail

    def send_nowait(self, msg: Message) -> bool:
        """Send ``msg`` at once, without waiting or yielding, where the stream allows it (:attr:`can_send_nowait`).
        Returns False, having sent nothing, where it does not (the caller then uses :meth:`send`). If the socket
        takes only part of the frame, the rest waits here for :meth:`flush` (any later send flushes it first).
        Raises :class:`StreamClosed` when the stream is gone, WireError for a message that cannot be encoded."""
        if not self.can_send_nowait:
            return False
        frame = encode_message_frame(msg, self.max_frame)
        self._write_now(frame)
        _count(self.link_kind, "out", len(frame))
        return True

    @property
    def pending(self) -> bool:
        """Part of a frame sent by :meth:`send_nowait` still waits for :meth:`flush`."""
        return bool(self._tail)

    async def flush(self, *, timeout: float = 60.0) -> None:
        """Write what :meth:`send_nowait` left unwritten (nothing if the socket took it all)."""
        if self._tail:
            await self._send_locked(None, timeout)

    def _write_now(self, frame: bytes) -> None:
        assert self._try_write is not None
        try:
            self._tail = self._try_write(frame)
        except StreamClosed:
            self.closed = True
            raise

    async def send_frame(self, frame: bytes, *, timeout: float = 60.0) -> None:
        """Write one whole frame. The write is shielded from cancellation: a frame cut off halfway would corrupt a
        stream that other sessions share; a write stuck for ``timeout`` seconds closes the stream instead. On a
        lane with no write in flight the frame goes straight to the socket (no lock, no yield) when it fits."""
        if self.closed:
            raise StreamClosed(f"stream to {self.peer} is closed")
        _count(self.link_kind, "out", len(frame))
        if self.can_send_nowait:
            self._write_now(frame)
            if not self._tail:
                return
            with trio.CancelScope(shield=True):  # part of the frame is out: the rest must follow, cancelled or not
                await self._send_locked(None, timeout)
            return
        await self._send_locked(frame, timeout)

    async def _send_locked(self, frame: bytes | None, timeout: float) -> None:
        """Under the lock: the rest of an earlier frame first (if any), then ``frame`` (if any)."""
        async with self._lock:
            with trio.CancelScope(shield=True):
                with trio.move_on_after(timeout) as scope:
                    try:
                        if self._tail:
                            tail, self._tail = self._tail, b""
                            await self.stream.write_raw(tail)
                        if frame is not None:
                            await self.stream.write(frame)
                    except Exception as exc:  # py-libp2p raises several unrelated types on a dead stream
                        self.closed = True
                        raise translate(exc, StreamClosed, f"cannot write to {self.peer}")
                if scope.cancelled_caught:
                    self.closed = True
                    try:
                        await self.stream.reset()
                    except Exception:  # already gone
                        pass
                    raise StreamClosed(f"a write to {self.peer} took over {timeout} s")

    async def aclose(self, *, reset: bool = False) -> None:
        """Close (or reset) the stream; never raises. A partial frame read so far is dropped (its budget share
        returned)."""
        self.closed = True
        self._reader.close()
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

    link_kind = "local"

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
                raise translate(exc, StreamClosed, "stream was reset")
        k = len(self._buf) if n is None else n
        out, self._buf = self._buf[:k], self._buf[k:]
        return out

    async def write(self, data: bytes) -> None:
        try:
            await self._send.send(bytes(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise translate(exc, StreamClosed, "the other end is gone")

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
