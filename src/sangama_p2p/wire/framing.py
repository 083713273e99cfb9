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
stage's every stream and lane), as those bytes arrive: a length prefix alone takes nothing, and a partial frame
holds exactly what it has buffered, so a peer that announces lengths without sending them holds no budget. A chunk
that would take the budget past its ``limit``, or the decoders of one ``peer`` past ``per_peer``, raises
:class:`BufferBudgetError` (the stream is closed and its share returns). One stream holds at most one partial frame
(at most ``max_frame`` + 4 bytes). With ``partial_timeout`` set, a partial frame of ``n`` announced bytes must
complete within ``partial_timeout + n / partial_rate`` seconds of its first byte: :meth:`FrameDecoder.time_left`
says how long the reader may still wait (the net layer, which owns the clock's awaits, enforces it and closes the
stream with the decoder's :meth:`FrameDecoder.expire` error). The reservation is returned when the frame completes
or the decoder is closed, and the buffer that held it is dropped (not kept at its high-water mark), so memory
returns once a flood ends.
"""

from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Final

from sangama_p2p.errors import BufferBudgetError, FrameTooLargeError, TruncatedFrameError, WireError

from .budget import ByteBudget

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
_MAPPED_AT: Final = 1 << 20  # a partial frame announcing this much is kept in a mapping of its own (see FrameDecoder)
_MAP_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)

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


class FrameDecoder:
    """Incremental decoder: ``feed`` any chunk, get back every frame it completed, in order.

    Frames may be split anywhere and several may arrive in one chunk. After a :class:`FrameTooLargeError` (or a
    :class:`BufferBudgetError`) the decoder stays failed (the stream has lost sync and must be closed). With a
    ``budget``, the bytes of a partial frame are reserved from it (in ``peer``'s share) as they arrive, and the
    frame gets a deadline (see the module docstring; ``clock`` is a monotonic clock in seconds); call :meth:`close`
    when the stream ends so that a frame cut off returns its share.

    A partial frame is kept as the pieces that arrived (joined once, when it completes), never as one buffer grown
    by reallocation: many streams' buffers growing at once fragmented the heap so that freed memory did not return.
    One of at least 1 MiB goes into an anonymous private mapping of its announced length instead: its pages are
    only backed once its bytes arrive, and they go back to the system the moment the frame completes or is dropped.
    """

    __slots__ = ("_budget", "_clock", "_failed", "_held", "_map", "_max", "_need", "_peer", "_pieces", "_reserved",
                 "_started")

    def __init__(self, max_frame: int = DEFAULT_MAX_FRAME, budget: ByteBudget | None = None, *, peer: str = "",
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._max = _check_max(max_frame)
        self._pieces: list[bytes | memoryview] = []  # what arrived of the partial frame (its payload, or its prefix)
        self._held = 0  # their bytes
        self._need: int | None = None  # payload length of the frame being assembled, once its prefix is read
        self._failed: WireError | None = None
        self._budget = budget
        self._peer = peer
        self._clock = clock
        self._reserved = 0  # bytes of the budget held for the frame being assembled: what it has buffered
        self._started: float | None = None  # when the partial frame's first byte arrived (with a budget)
        self._map: mmap.mmap | None = None  # a large partial payload's mapping (its bytes [0, _held) arrived)

    def close(self) -> None:
        """Drop any partial frame and return its reservation (the decoder is failed from now on)."""
        self._drop()
        if self._failed is None:
            self._failed = WireError("decoder closed")

    def _drop(self) -> None:
        self._release()
        self._pieces = []
        self._held = 0
        self._need = None
        self._unmap()

    def _unmap(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None

    def _keep(self, piece: memoryview, data: object = None) -> None:
        """Add bytes of the partial payload (``data``: the whole chunk they are, when it may be kept uncopied)."""
        n = piece.nbytes
        if self._map is None and self._need is not None and self._need >= _MAPPED_AT and _MAP_PRIVATE is not None:
            self._map = mmap.mmap(-1, self._need, flags=_MAP_PRIVATE)
            for old in self._pieces:  # nothing yet, unless an earlier chunk of this payload came first
                self._map.write(old)
            self._pieces = []
        if self._map is not None:
            self._map.write(piece)
        else:
            self._pieces.append(data if data is not None else bytes(piece))  # type: ignore[arg-type]
        self._held += n

    def _complete(self, tail: memoryview) -> bytes:
        """The payload: what was kept and ``tail``, in one copy."""
        if self._map is None:
            return b"".join([*self._pieces, tail])
        self._map.write(tail)
        payload = self._map[:]
        self._unmap()
        return payload

    def _release(self) -> None:
        if self._reserved and self._budget is not None:
            self._budget.release(self._reserved, self._peer)
        self._reserved = 0
        self._started = None

    @property
    def reserved(self) -> int:
        """Bytes of the budget this decoder holds (what its partial frame has buffered)."""
        return self._reserved

    def time_left(self) -> float | None:
        """Seconds the partial frame may still take (<= 0: overdue; None: no partial frame, or no time limit)."""
        if self._started is None or self._budget is None or self._failed is not None:
            return None
        deadline = self._budget.deadline(self._started, self._need or 0)
        return None if deadline is None else deadline - self._clock()

    def expire(self) -> BufferBudgetError:
        """The partial frame ran past its deadline: fail the decoder, return its share, and give the error that
        closes the stream."""
        budget = self._budget
        length = "a length prefix" if self._need is None else f"a frame of {self._need} bytes"
        limit = "" if budget is None else (
            f" ({budget.partial_timeout:g} s + 1 s per {budget.partial_rate} bytes)" if budget.partial_rate else
            f" ({budget.partial_timeout:g} s)")
        exc = BufferBudgetError(f"{length} did not arrive within its deadline{limit}: {self._held} bytes came")
        self._failed = exc
        self._drop()
        return exc

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete."""
        return self._held

    @property
    def at_boundary(self) -> bool:
        """True when no partial frame is buffered (a clean place for the stream to end)."""
        return not self._held and self._need is None

    def feed(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Add ``data``; return the payloads of all frames now complete.

        Each payload is copied once: straight out of ``data`` when no partial frame was pending (the common case of
        whole frames per read), else joined from its pieces.
        """
        if self._failed is not None:
            raise type(self._failed)(f"decoder already failed: {self._failed}")
        frames: list[bytes] = []
        try:
            with memoryview(data) as view:
                flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
                whole = type(data) is bytes  # immutable: a partial frame may keep it whole, uncopied
                pos = self._continue(flat, frames, whole)
                if pos is not None:
                    pos = self._split(flat, pos, frames)
                    rest = flat[pos:]
                    if rest.nbytes:
                        self._keep(rest, data if whole and pos == 0 else None)
        except FrameTooLargeError as exc:
            self._failed = exc
            self._drop()
            raise
        if self._budget is not None:
            self._account()
        return frames

    def _continue(self, view: memoryview, frames: list[bytes], whole: bool) -> int | None:
        """Add ``view`` to the pending partial frame: where whole frames start in it, or None if all of it went to
        the partial frame."""
        if not self._held and self._need is None:
            return 0
        pos = 0
        if self._need is None:  # an incomplete prefix (1-3 bytes): glue just enough to it to read the length
            take = PREFIX_SIZE - self._held
            if view.nbytes < take:
                self._keep(view)
                return None
            (length,) = _PREFIX.unpack(b"".join([*self._pieces, view[:take]]))
            _check_length(length, self._max)
            self._need, self._pieces, self._held, pos = length, [], 0, take
        more = self._need - self._held
        if view.nbytes - pos < more:
            if view.nbytes > pos:
                self._keep(view[pos:], view.obj if whole and pos == 0 else None)
            return None
        frames.append(self._complete(view[pos:pos + more]))
        self._pieces, self._held, self._need, self._started = [], 0, None, None
        return pos + more

    def _account(self) -> None:
        """Hold exactly what the partial frame has buffered (no more: a length prefix takes nothing)."""
        assert self._budget is not None
        held = self._held
        if held or self._need is not None:
            if self._started is None:
                self._started = self._clock()
        else:
            self._started = None
        more = held - self._reserved
        if more > 0:
            why = self._budget.refusal(more, self._peer)
            if why is not None:
                what = "a length prefix" if self._need is None else f"a frame of {self._need} bytes"
                exc = BufferBudgetError(f"{what} would hold {held} buffered bytes: {why}")
                self._failed = exc
                self._drop()
                raise exc
            self._budget.reserve(more, self._peer)
        elif more < 0:
            self._budget.release(-more, self._peer)
        self._reserved = held

    def _split(self, view: memoryview, pos: int, frames: list[bytes]) -> int:
        """Append every complete payload in ``view`` from ``pos`` on to ``frames``; return where the rest starts
        (after a prefix whose payload is incomplete, which ``_need`` then holds)."""
        end = view.nbytes
        while True:
            if end - pos < PREFIX_SIZE:
                return pos
            (length,) = _PREFIX.unpack_from(view, pos)
            _check_length(length, self._max)
            if end - pos - PREFIX_SIZE < length:
                self._need = length
                return pos + PREFIX_SIZE
            pos += PREFIX_SIZE
            frames.append(bytes(view[pos : pos + length]))
            pos += length

    def finish(self) -> None:
        """Call at end of stream: raise :class:`TruncatedFrameError` if a frame was cut off."""
        if self._held or self._need is not None:
            raise TruncatedFrameError(f"stream ended inside a frame ({self._held} bytes buffered)")


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
                 budget: ByteBudget | None = None, *, peer: str = "") -> None:
        if type(chunk_size) is not int or chunk_size <= 0:
            raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
        self._read = read
        self._decoder = FrameDecoder(max_frame, budget, peer=peer)
        self._chunk = chunk_size
        self._ready: list[bytes] = []
        self._eof = False

    def close(self) -> None:
        """Drop what is buffered and return its share of the budget."""
        self._decoder.close()
        self._ready = []

    @property
    def decoder(self) -> FrameDecoder:
        """The decoder: its :meth:`~FrameDecoder.time_left` is how long ``read`` may wait for a partial frame."""
        return self._decoder

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
