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
:class:`NextHops` keeps a stage's outboxes to its next stages, one per peer, and turns what they lose (and the
errors the next stage sends back) into ``ErrorMessage`` frames for the sessions' owners.

Bounded: each queued item counts its size (``put(item, nbytes)``; small frames count ``SMALL_ITEM`` bytes) against
``max_bytes``. Over that, :attr:`congested` is true and :meth:`wait_uncongested` blocks, which a reader of the
stream whose replies these are awaits before reading more (back-pressure: a peer that does not read its replies
stops being read). A ``put`` that would take the queue past ``2 x max_bytes`` fails the outbox instead (the write
is stuck; the items are dropped and ``on_failed`` gets them), so a stream's queue never holds more than that; with
``fail_when_full=False`` (a link to the next stage, which other sessions share) only that item is refused (``put``
returns False and the caller reports it to the session's owner).

Bounded across streams too: every outbox of a stage charges its queued bytes to one :class:`OutboxBudget`
(``outbox_budget``). An item that would take the total over it first fails the outbox holding the most bytes
(``OutboxFull``), then the next largest, until the item fits: a stream whose replies are read keeps an almost empty
queue, so the largest queues are those of peers that do not read (issue 23: 16 such lanes held 127 MB). A failed
reply outbox resets its stream (``on_failed``); a failed link to a next stage reports its frames to their sessions'
owners, who re-route.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from typing import Any, Union

import trio

from .. import clock
from ..errors import ErrorCode, NetworkError, OutboxFull, SangamaError, translate
from ..net.streams import FramedStream
from ..wire.messages import ErrorMessage, InfoRequest, InfoResponse, Message

__all__ = ["SMALL_ITEM", "Item", "NextHops", "Outbox", "OutboxBudget", "tensor_bytes"]

log = logging.getLogger(__name__)

Item = Union[Message, Callable[[], Message]]
_FLUSH = object()  # queued after a frame the socket took only in part: the writer sends its rest
SMALL_ITEM = 1024  # what a frame without tensors counts in the queue (its Python objects, roughly)


def tensor_bytes(tensor: Any) -> int:
    """Bytes of a tensor (or anything with ``nbytes``) to be sent; 0 for none (what a queued frame counts beyond
    ``SMALL_ITEM``)."""
    if tensor is None:
        return 0
    n = getattr(tensor, "nbytes", None)
    if isinstance(n, int):
        return n
    try:
        return int(tensor.numel() * tensor.element_size())
    except AttributeError:  # neither nbytes nor numel: counted as no tensor bytes
        return 0


class OutboxBudget:
    """Bytes queued by every outbox of a stage together, at most ``limit`` (pure bookkeeping: no I/O, no trio).

    Members are anything with ``peer`` and ``evict(exc)`` (an :class:`Outbox`); only those holding bytes are kept.
    :meth:`admit` charges an item to its outbox, first evicting (largest first) until it fits; :meth:`release`
    returns bytes as they are written, :meth:`drop` all of an outbox's when it fails.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"an outbox budget must be positive, got {limit}")
        self.limit = limit
        self.used = 0
        self.peak = 0
        self.evicted = 0  # outboxes failed to make room
        self._held: dict[Any, int] = {}

    def held(self, box: Any) -> int:
        return self._held.get(box, 0)

    def admit(self, box: Any, nbytes: int) -> bool:
        """Charge ``nbytes`` to ``box``. While they do not fit, the outbox holding the most is dropped and evicted
        (``OutboxFull``); False when that was ``box`` itself (the item is not charged). An item alone over the
        limit goes once nothing else is held (the stage's config keeps ``limit`` at least one largest frame)."""
        while self.used + nbytes > self.limit and self._held:
            victim = max(self._held, key=self._held.__getitem__)
            held = self.drop(victim)
            self.evicted += 1
            log.info("outbox to %s failed: %d bytes queued, the most of the %d the stage's outboxes hold", victim.peer,
                     held, self.used + held)
            victim.evict(OutboxFull(f"{held} bytes queued for {victim.peer}, the most of any stream, and the stage's"
                                    f" outboxes are at their budget ({self.limit} bytes)"))
            if victim is box or getattr(box, "failed", None) is not None:  # (an eviction's reports may fail it)
                return False
        self._held[box] = self._held.get(box, 0) + nbytes
        self.used += nbytes
        self.peak = max(self.peak, self.used)
        return True

    def release(self, box: Any, nbytes: int) -> None:
        """``nbytes`` of ``box``'s were written (or dropped)."""
        held = self._held.get(box, 0)
        n = min(nbytes, held)
        if held > n:
            self._held[box] = held - n
        else:
            self._held.pop(box, None)
        self.used -= n

    def drop(self, box: Any) -> int:
        """Forget all of ``box``'s bytes (it failed); returns how many it held."""
        held = self._held.pop(box, 0)
        self.used -= held
        return held


class Outbox:
    """Frames waiting for one stream. ``put`` never blocks; ``run`` (in a nursery) writes them in order."""

    def __init__(
        self,
        stream: FramedStream | None = None,
        *,
        peer: str = "",
        opener: Callable[[], Awaitable[FramedStream]] | None = None,
        on_failed: Callable[[Outbox, list[Item], BaseException], None] | None = None,
        max_bytes: int = 64 << 20,
        fail_when_full: bool = True,
        budget: OutboxBudget | None = None,
    ) -> None:
        if stream is None and opener is None:
            raise ValueError("an outbox needs a stream or an opener")
        self.stream = stream
        self.peer = stream.peer if stream is not None else peer
        self._opener = opener
        self._on_failed = on_failed
        self._send, self._recv = trio.open_memory_channel[tuple[Item, int]](math.inf)
        self.max_bytes = max_bytes
        self.fail_when_full = fail_when_full
        self._budget = budget
        self.queued_bytes = 0  # sizes of the items queued and not yet written
        self.peak_bytes = 0
        self._drained = trio.Event()  # set while the queue is under max_bytes
        self._drained.set()
        self.failed: BaseException | None = None
        self.ready = trio.Event()  # set once the stream is open (or the outbox has failed)
        self.done = trio.Event()  # set when the writer has stopped
        self._queued = 0  # items put in the queue and not yet written (or failed) by the writer
        self._closed = False

    @property
    def congested(self) -> bool:
        return self.queued_bytes > self.max_bytes

    async def wait_uncongested(self) -> None:
        """Return once the queue is back under ``max_bytes`` (or the outbox failed or closed)."""
        while self.congested and self.failed is None and not self._closed:
            self._drained = trio.Event()
            await self._drained.wait()

    def put(self, item: Item, nbytes: int = SMALL_ITEM) -> bool:
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
                return self._enqueue(msg, nbytes)  # built (and stamped) already: queue the message itself
            if fs.pending:  # the socket took part of the frame: the writer sends the rest before anything else
                self._enqueue(_FLUSH, nbytes)
            return True
        return self._enqueue(item, nbytes)

    def _enqueue(self, item: Item | object, nbytes: int) -> bool:
        if self.queued_bytes + nbytes > 2 * self.max_bytes and self._queued:
            if not self.fail_when_full:
                return False
            self._fail([] if item is _FLUSH else [item], OutboxFull(  # type: ignore[list-item]
                f"{self.queued_bytes} bytes queued for {self.peer} and its writes do not drain"))
            return False
        if self._budget is not None and not self._budget.admit(self, nbytes):
            return False  # this outbox held the most of the stage's queued bytes: it was failed to make room
        try:
            self._send.send_nowait((item, nbytes))  # type: ignore[arg-type]
        except (trio.ClosedResourceError, trio.BrokenResourceError):  # closed or failed: the caller reports the loss
            if self._budget is not None and self.failed is None:
                self._budget.release(self, nbytes)
            return False
        self._queued += 1
        self.queued_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.queued_bytes)
        return True

    def _written(self, nbytes: int) -> None:
        self._queued -= 1
        self.queued_bytes -= nbytes
        if self._budget is not None and self.failed is None:  # a failed outbox's bytes left the budget at once
            self._budget.release(self, nbytes)
        if not self.congested:
            self._drained.set()

    def evict(self, exc: BaseException) -> None:
        """Fail this outbox to make room in the stage's budget (its queued items go to ``on_failed``)."""
        if self.failed is None:
            self._fail([], exc)

    def close(self) -> None:
        """No more items; the writer finishes what is queued, then stops."""
        self._closed = True
        self._send.close()
        self._drained.set()

    async def run(self) -> None:
        """Open the stream if needed, then write items until closed; report what is left on failure."""
        try:
            if self.stream is None:
                assert self._opener is not None  # checked in __init__
                self.stream = await self._opener()
            self.ready.set()
            async for item, nbytes in self._recv:
                try:
                    if item is _FLUSH:
                        await self.stream.flush()
                    else:
                        await self.stream.send(item() if callable(item) else item)
                except SangamaError as exc:
                    self._fail([] if item is _FLUSH else [item], exc)
                    return
                finally:
                    self._written(nbytes)
                del item  # not held while the next one is awaited
        except Exception as exc:  # a failed dial (any library error) fails this link, never the server
            self._fail([], translate(exc, NetworkError, "opening or writing the stream"))
        finally:
            self.ready.set()
            self.done.set()

    def _fail(self, lost: list[Item], exc: BaseException) -> None:
        if self.failed is None:
            self.failed = exc
            if self._budget is not None:
                self._budget.drop(self)  # before on_failed, whose reports may queue elsewhere
        self._send.close()
        while True:
            try:
                item, nbytes = self._recv.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            self._queued -= 1
            self.queued_bytes -= nbytes
            if item is not _FLUSH:
                lost.append(item)
        self._drained.set()
        log.debug("link to %s failed (%s); %d frames lost", self.peer, exc, len(lost))
        if self._on_failed is not None:
            self._on_failed(self, lost, exc)


class NextHops:
    """A stage's links to its next stages: one :class:`Outbox` per peer, dialled in its writer task on first use.

    ``open_stream(peer)`` dials and opens the stream; ``spawn(fn, *args)`` starts a task while the stage runs (and
    does nothing once it stopped); ``report(msg)`` hands an ``ErrorMessage`` to the owner of ``msg.session_id``: every
    error the next stage sends back, and an ``INTERNAL`` one for each frame a failed link still held.
    """

    def __init__(self, open_stream: Callable[[str], Awaitable[FramedStream]], *, spawn: Callable[..., None],
                 report: Callable[[ErrorMessage], None], max_bytes: int, budget: OutboxBudget | None = None) -> None:
        self._open_stream = open_stream
        self._spawn = spawn
        self._report = report
        self.max_bytes = max_bytes
        self.budget = budget
        self.links: dict[str, Outbox] = {}
        self._pings: dict[str, deque[trio.MemorySendChannel[float]]] = {}

    def get(self, peer: str) -> Outbox:
        """The live outbox to ``peer``, or a fresh one (dialling in its writer task) in place of a failed one."""
        link = self.links.get(peer)
        if link is not None and link.failed is None:
            return link
        link = Outbox(peer=peer, opener=lambda: self._open(peer), on_failed=self._failed, max_bytes=self.max_bytes,
                      fail_when_full=False, budget=self.budget)
        self.links[peer] = link
        self._spawn(link.run)
        return link

    async def ping(self, peer: str) -> float:
        """The round trip in seconds of an ``InfoRequest`` to ``peer`` over the link this stage's frames to it take
        (dialled first if none is up, which the first ping's time includes: measure more than once). The caller
        bounds the wait; a link that fails meanwhile raises :class:`NetworkError`."""
        link = self.get(peer)
        send, recv = trio.open_memory_channel[float](1)
        t0 = clock.now()
        if not link.put(InfoRequest()):
            raise NetworkError(f"the link to {peer} is full")
        # answers come back in the order the requests left: a ping given up on keeps its place (closed), so that
        # its late answer is not taken for the next one's
        self._pings.setdefault(peer, deque()).append(send)
        try:
            answered = await recv.receive()
        except trio.EndOfChannel as exc:
            raise NetworkError(f"the link to {peer} closed during a ping") from exc
        finally:
            send.close()
        return answered - t0

    def streams(self) -> Iterator[FramedStream]:
        """The streams opened so far."""
        return (o.stream for o in self.links.values() if o.stream is not None)

    def clear(self) -> None:
        self.links.clear()

    async def _open(self, peer: str) -> FramedStream:
        fs = await self._open_stream(peer)
        self._spawn(self._read, fs)
        return fs

    async def _read(self, fs: FramedStream) -> None:
        """The next stage sends back errors, which go to the sessions' owners, and the answers to our pings."""
        try:
            while True:
                msg = await fs.recv()
                if msg is None:
                    break
                if isinstance(msg, ErrorMessage) and msg.session_id is not None:
                    self._report(msg)
                elif isinstance(msg, InfoResponse):
                    waiting = self._pings.get(fs.peer)
                    if waiting:
                        try:
                            waiting.popleft().send_nowait(clock.now())
                        except trio.ClosedResourceError:  # that ping was given up on
                            pass
        except (SangamaError, trio.BrokenResourceError) as exc:
            log.debug("stream to next hop %s ended: %s", fs.peer, exc)
        finally:
            link = self.links.get(fs.peer)
            if link is not None and link.stream is fs:
                self.links.pop(fs.peer, None)
                link.close()
                for waiter in self._pings.pop(fs.peer, ()):  # pings in flight on it end at once
                    waiter.close()

    def _failed(self, link: Outbox, lost: list[Item], exc: BaseException) -> None:
        if self.links.get(link.peer) is link:
            self.links.pop(link.peer, None)
            for waiter in self._pings.pop(link.peer, ()):  # its pings get no answer
                waiter.close()
        if link.stream is not None and not link.stream.closed:  # evicted: its writer may be stuck in a write
            self._spawn(partial(link.stream.aclose, reset=True))
        code = ErrorCode.OVERLOADED if isinstance(exc, OutboxFull) else ErrorCode.INTERNAL  # evicted: not taking
        for item in lost:
            msg: Any = item() if callable(item) else item
            sid = getattr(msg, "session_id", None)
            if sid is not None:
                self._report(ErrorMessage(sid, getattr(msg, "step", None), code,
                                          f"next hop {link.peer} failed: {exc}"))
