"""One end of a lane: plaintext ``read``/``write`` over AES-GCM records on a trio TCP stream (the record format is
in :mod:`sangama_p2p.net.lane`), and the exact reads both sides' handshakes make."""

from __future__ import annotations

import os
import struct
from typing import Any, Final

import trio
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ...errors import LaneError, StreamClosed, WireError, translate
from ...wire.framing import DEFAULT_MAX_FRAME, ByteBudget, FrameDecoder
from ..streams import PeerConn
from .handshake import DOWN, TAG_BYTES, UP, record_nonce

__all__ = ["RECV_CHUNK", "LaneStream", "receive_exactly", "remote_label"]

_LEN = struct.Struct(">I")
RECV_CHUNK: Final = 256 * 1024
_SYNC_WRITES: Final = os.name == "posix"  # os.write on a socket's fd; elsewhere try_write leaves it all to write_raw


class LaneStream:
    """One end of a lane: plaintext ``read``/``write`` over AES-GCM records on a trio TCP stream."""

    link_kind = "lane"

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
        # a record holds one frame: its 4-byte prefix, at most max_frame bytes, and the tag; its bytes count in the
        # peer's share of the budget as they arrive
        peer = peer_id.to_base58() if hasattr(peer_id, "to_base58") else str(peer_id)
        self._records = decoder or FrameDecoder(max_frame + 4 + TAG_BYTES, budget, peer=peer)
        self._plain: list[bytes] = []  # decrypted records not yet read, oldest last
        self._buf = b""
        self._eof = False
        self.closed = False
        self._failed: LaneError | WireError | None = None  # an unauthentic record, or a partial one overdue
        self.remote = remote_label(sock)

    def get_remote_address(self) -> tuple[str, int] | None:
        """The far end's (ip, port), as a libp2p stream gives it."""
        try:
            host, port = self.sock.socket.getpeername()[:2]
        except OSError:
            return None
        return host, port

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
            data = await self._receive()
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

    async def _receive(self) -> bytes:
        """One read from the socket; while a record is partial, only until its deadline (BufferBudgetError)."""
        left = self._records.time_left()
        try:
            if left is None:
                return await self.sock.receive_some(RECV_CHUNK)
            with trio.move_on_after(max(left, 0.0)):
                return await self.sock.receive_some(RECV_CHUNK)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise translate(exc, StreamClosed, f"lane to {self.remote} failed")
        self._failed = self._records.expire()
        raise self._failed

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
            raise translate(exc, StreamClosed, f"cannot write to lane {self.remote}")
        return record[sent:]

    async def write_raw(self, data: bytes | bytearray | memoryview) -> None:
        """Write bytes that are already records (or the rest of one, from :meth:`try_write`)."""
        try:
            await self.sock.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise translate(exc, StreamClosed, f"cannot write to lane {self.remote}")

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


def remote_label(sock: trio.SocketStream) -> str:
    try:
        host, port = sock.socket.getpeername()[:2]
    except OSError:
        return "?"
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"



async def receive_exactly(sock: trio.SocketStream, n: int, what: str) -> bytes:
    """Exactly ``n`` bytes (never more: what follows stays in the socket); :class:`LaneError` if it closes first."""
    data = b""
    while len(data) < n:
        try:
            chunk = await sock.receive_some(n - len(data))
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            raise translate(exc, LaneError, f"connection failed before {what}")
        if not chunk:
            raise LaneError(f"connection closed before {what}")
        data += chunk
    return data

