"""Outgoing frames of a stage: one ``Outbox`` per stream, drained in order by one writer task.

Why a queue per stream: the compute worker must hand its outputs off without waiting for the network, frames of
one session must leave in the order they were produced, and a frame's ``send`` stamp must be taken when it really
leaves. Items are messages or zero-argument builders called just before the write (they take the stamp).

When nothing is queued or being written and the stream can write without waiting (a lane), ``put`` writes the frame
itself, at once: the frame leaves without a hop through the writer task (measured per stage and trip on the 2-core
dev machine: see docs/benchmarks.md, Pipeline). Order is kept: anything queued or in flight sends the item to the
queue instead.

An outbox to the next stage is created at once and dials in its writer task (``opener``), so frames produced while
the link comes up simply wait. When the link fails, every frame it still holds is handed to ``on_failed``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Union

import trio

from ..errors import SangamaError
from ..streams import FramedStream
from ..wire.messages import Message

__all__ = ["Item", "Outbox"]

log = logging.getLogger(__name__)

Item = Union[Message, Callable[[], Message]]
_FLUSH = object()  # queued after a frame the socket took only in part: the writer sends its rest


class Outbox:
    """Frames waiting for one stream. ``put`` never blocks; ``run`` (in a nursery) writes them in order."""

    def __init__(
        self,
        stream: FramedStream | None = None,
        *,
        peer: str = "",
        opener: Callable[[], Awaitable[FramedStream]] | None = None,
        on_failed: Callable[[Outbox, list[Item], BaseException], None] | None = None,
    ) -> None:
        if stream is None and opener is None:
            raise ValueError("an outbox needs a stream or an opener")
        self.stream = stream
        self.peer = stream.peer if stream is not None else peer
        self._opener = opener
        self._on_failed = on_failed
        self._send, self._recv = trio.open_memory_channel[Item](math.inf)
        self.failed: BaseException | None = None
        self.ready = trio.Event()  # set once the stream is open (or the outbox has failed)
        self.done = trio.Event()  # set when the writer has stopped
        self._queued = 0  # items put in the queue and not yet written (or failed) by the writer
        self._closed = False

    def put(self, item: Item) -> bool:
        """Send ``item`` now if the stream can take it at once with nothing ahead of it, else queue it; False when
        the outbox has already failed or closed (the caller reports the loss). A write that fails here fails the
        outbox as the writer's would (``on_failed`` gets the item)."""
        if self.failed is not None or self._closed:
            return False
        fs = self.stream
        if not self._queued and fs is not None and fs.can_send_nowait and self.ready.is_set():
            msg = item() if callable(item) else item
            try:
                sent = fs.send_nowait(msg)
            except SangamaError as exc:
                self._fail([item], exc)
                return True
            if not sent:
                return self._enqueue(msg)  # built (and stamped) already: queue the message itself
            if fs.pending:  # the socket took part of the frame: the writer sends the rest before anything else
                self._enqueue(_FLUSH)
            return True
        return self._enqueue(item)

    def _enqueue(self, item: Item | object) -> bool:
        try:
            self._send.send_nowait(item)  # type: ignore[arg-type]
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        self._queued += 1
        return True

    def close(self) -> None:
        """No more items; the writer finishes what is queued, then stops."""
        self._closed = True
        self._send.close()

    async def run(self) -> None:
        """Open the stream if needed, then write items until closed; report what is left on failure."""
        try:
            if self.stream is None:
                assert self._opener is not None  # checked in __init__
                self.stream = await self._opener()
            self.ready.set()
            async for item in self._recv:
                try:
                    if item is _FLUSH:
                        await self.stream.flush()
                    else:
                        await self.stream.send(item() if callable(item) else item)
                except SangamaError as exc:
                    self._fail([] if item is _FLUSH else [item], exc)
                    return
                finally:
                    self._queued -= 1
        except Exception as exc:  # a failed dial (any library error) fails this link, never the server
            self._fail([], exc)
        finally:
            self.ready.set()
            self.done.set()

    def _fail(self, lost: list[Item], exc: BaseException) -> None:
        self.failed = exc
        self._send.close()
        while True:
            try:
                item = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if item is not _FLUSH:
                lost.append(item)
        log.debug("link to %s failed (%s); %d frames lost", self.peer, exc, len(lost))
        if self._on_failed is not None:
            self._on_failed(self, lost, exc)
