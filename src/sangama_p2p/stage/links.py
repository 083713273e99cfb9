"""Outgoing frames of a stage: one ``Outbox`` per stream, drained in order by one writer task.

Why a queue per stream: the compute worker must hand its outputs off without waiting for the network, frames of
one session must leave in the order they were produced, and a frame's ``send`` stamp must be taken when it really
leaves. Items are messages or zero-argument builders called just before the write (they take the stamp).

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

    def put(self, item: Item) -> bool:
        """Queue ``item``; False when the outbox has already failed or closed (the caller reports the loss)."""
        if self.failed is not None:
            return False
        try:
            self._send.send_nowait(item)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    def close(self) -> None:
        """No more items; the writer finishes what is queued, then stops."""
        self._send.close()

    async def run(self) -> None:
        """Open the stream if needed, then write items until closed; report what is left on failure."""
        try:
            if self.stream is None:
                assert self._opener is not None  # checked in __init__
                self.stream = await self._opener()
            self.ready.set()
            async for item in self._recv:
                msg = item() if callable(item) else item
                try:
                    await self.stream.send(msg)
                except SangamaError as exc:
                    self._fail([item], exc)
                    return
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
                lost.append(self._recv.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
        log.debug("link to %s failed (%s); %d frames lost", self.peer, exc, len(lost))
        if self._on_failed is not None:
            self._on_failed(self, lost, exc)
