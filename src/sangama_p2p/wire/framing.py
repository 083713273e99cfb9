"""Length-prefixed framing: ``[u32 big-endian length][payload]``, with a hard maximum length.

Why two readers: :class:`FrameDecoder` is push-style and transport-agnostic (feed it whatever bytes arrived), and
:class:`FrameReader` / :func:`read_frame` pull from any ``async def read(n) -> bytes`` callable, because trio and
py-libp2p streams return short reads (``read(n)`` may give fewer than ``n`` bytes). Neither imports an async
library: the net layer passes its stream's read method, translating its end-of-stream exception to ``b""``::

    async def read(n: int) -> bytes:  # in net/, around a py-libp2p stream
        try:
            return await stream.read(n)
        except StreamEOF:
            return b""

Other exceptions (a reset stream) pass through untouched.

A length above the maximum raises :class:`FrameTooLargeError` before a single payload byte is buffered, so a peer
cannot make us allocate by lying about a length.

A :class:`ByteBudget` shared by many decoders bounds the bytes they hold together for frames not yet complete (a
stage's every stream and lane): a frame that does not arrive whole in one chunk reserves its announced length from
the budget first, and one the budget cannot cover raises :class:`BufferBudgetError` (the stream is closed; the
budget is not touched). The reservation is returned when the frame completes or the decoder is closed, and the
buffer that held it is dropped (not kept at its high-water mark), so memory returns once a flood ends.
"""

from __future__ import annotations

import struct
from collections.abc import Awaitable, Callable
from typing import Final

from sangama_p2p.errors import BufferBudgetError, FrameTooLargeError, TruncatedFrameError, WireError

__all__ = [
    "DEFAULT_MAX_FRAME",
    "ByteBudget",
    "PREFIX_SIZE",
    "FrameDecoder",
    "FrameReader",
    "ReadFn",
    "encode_frame",
    "read_exactly",
    "read_frame",
]

DEFAULT_MAX_FRAME: Final = 64 * 1024 * 1024
"""Largest payload accepted by default (64 MiB): a long prefill's hidden states fit, a lying peer's 4 GiB does not."""

PREFIX_SIZE: Final = 4
_PREFIX = struct.Struct(">I")
_U32_MAX: Final = 0xFFFFFFFF

ReadFn = Callable[[int], Awaitable[bytes]]
"""``await read(n)`` returns between 1 and ``n`` bytes, or ``b""`` at end of stream."""


def _check_max(max_frame: int) -> int:
    if type(max_frame) is not int or not 0 <= max_frame <= _U32_MAX:
        raise ValueError(f"max_frame must be an int in [0, 2**32), got {max_frame!r}")
    return max_frame


def _check_length(length: int, max_frame: int) -> None:
    if length > max_frame:
        raise FrameTooLargeError(f"frame of {length} bytes exceeds the maximum of {max_frame} bytes")


def encode_frame(*parts: bytes | bytearray | memoryview, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Prefix the payload (the concatenation of ``parts``) with its length, copying each part once.

    Refuses to send what the other side must refuse to read.
    """
    length = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    _check_length(length, _check_max(max_frame))
    return b"".join((_PREFIX.pack(length), *parts))


class ByteBudget:
    """Bytes that many readers may hold together for partial frames (no I/O, not thread-safe: one event loop).

    ``reserve(n)`` takes ``n`` bytes or nothing; ``release(n)`` gives them back. ``peak`` is the high-water mark."""

    __slots__ = ("limit", "peak", "used")

    def __init__(self, limit: int) -> None:
        if type(limit) is not int or limit < 0:
            raise ValueError(f"a byte budget must be a non-negative int, got {limit!r}")
        self.limit = limit
        self.used = 0
        self.peak = 0

    @property
    def left(self) -> int:
        return self.limit - self.used

    def reserve(self, n: int) -> bool:
        if n > self.limit - self.used:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        return True

    def release(self, n: int) -> None:
        self.used = max(0, self.used - n)


class FrameDecoder:
    """Incremental decoder: ``feed`` any chunk, get back every frame it completed, in order.

    Frames may be split anywhere and several may arrive in one chunk. After a :class:`FrameTooLargeError` (or a
    :class:`BufferBudgetError`) the decoder stays failed (the stream has lost sync and must be closed). With a
    ``budget``, a frame that is not complete in the chunk that brought its prefix reserves its length there first
    (see the module docstring); call :meth:`close` when the stream ends so that a frame cut off returns its share.
    """

    __slots__ = ("_budget", "_buf", "_failed", "_max", "_need", "_reserved")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, budget: ByteBudget | None = None) -> None:
        self._max = _check_max(max_frame)
        self._buf = bytearray()
        self._need: int | None = None  # payload length of the frame being assembled, once its prefix is read
        self._failed: WireError | None = None
        self._budget = budget
        self._reserved = 0  # bytes of the budget held for the frame being assembled

    def close(self) -> None:
        """Drop any partial frame and return its reservation (the decoder is failed from now on)."""
        self._release()
        self._buf = bytearray()
        self._need = None
        if self._failed is None:
            self._failed = WireError("decoder closed")

    def _release(self) -> None:
        if self._reserved and self._budget is not None:
            self._budget.release(self._reserved)
        self._reserved = 0

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete."""
        return len(self._buf)

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return not self._buf and self._need is None

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add ``data``; return the payloads of all frames now complete.

        Each payload is copied once: straight out of ``data`` when no partial frame was pending (the common case of
        whole frames per read), else out of the internal buffer.
        """
        if self._failed is not None:
            raise type(self._failed)(f"decoder already failed: {self._failed}")
        buf = self._buf
        source: bytes | bytearray | memoryview = data
        if buf:
            buf += data
            source = buf
        frames: list[bytes] = []
        try:
            with memoryview(source) as view:
                flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
                pos = self._split(flat, frames)
                if source is not buf:
                    buf += flat[pos:]
        except (FrameTooLargeError, BufferBudgetError) as exc:
            self._failed = exc
            self._release()
            self._buf = bytearray()
            raise
        if source is buf and pos:
            if pos == len(buf):
                self._buf = bytearray()  # a fresh one: the old one's capacity (up to a whole frame) goes now
            else:
                del buf[:pos]
        if self._need is not None and not self._reserved and self._budget is not None:
            # a frame is left partial: it reserves its whole length before its bytes are held
            want = self._need + PREFIX_SIZE
            if not self._budget.reserve(want):
                exc = BufferBudgetError(
                    f"a frame of {self._need} bytes would exceed the input budget ({self._budget.left} of "
                    f"{self._budget.limit} bytes left)")
                self._failed = exc
                self._buf = bytearray()
                raise exc
            self._reserved = want
        return frames

    def _split(self, view: memoryview, frames: list[bytes]) -> int:
        """Append every complete payload in ``view`` to ``frames``; return how many bytes were consumed."""
        pos = 0
        end = view.nbytes
        while True:
            if self._need is None:
                if end - pos < PREFIX_SIZE:
                    return pos
                (length,) = _PREFIX.unpack_from(view, pos)
                _check_length(length, self._max)
                pos += PREFIX_SIZE
                self._need = length
            need = self._need
            if end - pos < need:
                return pos
            frames.append(bytes(view[pos : pos + need]))
            pos += need
            self._need = None
            self._release()

    def finish(self) -> None:
        """Call at end of stream: raise :class:`TruncatedFrameError` if a frame was cut off."""
        if self._buf or self._need is not None:
            raise TruncatedFrameError(f"stream ended inside a frame ({len(self._buf)} bytes buffered)")


async def read_exactly(read: ReadFn, n: int) -> bytes:
    """Read exactly ``n`` bytes through short reads; raise :class:`TruncatedFrameError` on an early end."""
    if n == 0:
        return b""
    first = await read(n)
    _check_chunk(first, n)
    if len(first) == n:
        return bytes(first)
    chunks = [first]
    got = len(first)
    while got < n:
        chunk = await read(n - got)
        _check_chunk(chunk, n - got)
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)  # the one copy


def _check_chunk(chunk: bytes, asked: int) -> None:
    if not chunk:
        raise TruncatedFrameError(f"stream ended with {asked} bytes of a frame still to read")
    if len(chunk) > asked:
        raise WireError(f"transport returned {len(chunk)} bytes when {asked} were asked for")


async def read_frame(read: ReadFn, max_frame: int = DEFAULT_MAX_FRAME) -> bytes | None:
    """Read one frame's payload without reading past it; ``None`` if the stream ended cleanly before it.

    Suits request/response streams (``/sangama/info/2``) where nothing may be over-read. For a long-lived stream,
    :class:`FrameReader` makes fewer, larger reads.
    """
    _check_max(max_frame)
    first = await read(PREFIX_SIZE)
    if not first:
        return None
    _check_chunk(first, PREFIX_SIZE)
    prefix = first if len(first) == PREFIX_SIZE else first + await read_exactly(read, PREFIX_SIZE - len(first))
    (length,) = _PREFIX.unpack(prefix)
    _check_length(length, max_frame)
    return await read_exactly(read, length)


class FrameReader:
    """Pull frames from a long-lived stream with large reads, buffering whatever follows the current frame.

    One ``read`` may bring several frames (of many sessions); they are handed out one by one.
    """

    __slots__ = ("_chunk", "_decoder", "_eof", "_read", "_ready")

    def __init__(self, read: ReadFn, max_frame: int = DEFAULT_MAX_FRAME, chunk_size: int = 256 * 1024,
                 budget: ByteBudget | None = None) -> None:
        if type(chunk_size) is not int or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self._read = read
        self._decoder = FrameDecoder(max_frame, budget)
        self._chunk = chunk_size
        self._ready: list[bytes] = []
        self._eof = False

    def close(self) -> None:
        """Drop what is buffered and return its share of the budget."""
        self._decoder.close()
        self._ready = []

    @property
    def has_frames(self) -> bool:
        """Whole frames are already read and waiting (the next :meth:`next_frame` returns without reading)."""
        return bool(self._ready)

    async def next_frame(self) -> bytes | None:
        """Return the next payload, or ``None`` at a clean end of stream; raise on a cut-off frame."""
        while not self._ready:
            if self._eof:
                return None
            data = await self._read(self._chunk)
            if not data:
                self._eof = True
                self._decoder.finish()
                return None
            if len(data) > self._chunk:
                raise WireError(f"transport returned {len(data)} bytes when {self._chunk} were asked for")
            self._ready = self._decoder.feed(data)
            self._ready.reverse()
        return self._ready.pop()
