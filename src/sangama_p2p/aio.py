"""``sangama_p2p.aio.Peer``: the same peer inside an asyncio program.

py-libp2p runs only under trio, so the trio :class:`sangama_p2p.peer.Peer` is the core and this is a thin face over
it (the httpx habit: one core, two faces). Trio runs as a *guest* of the asyncio loop
(``trio.lowlevel.start_guest_run``): both run on the loop's thread, trio's I/O waits happen in a helper thread and
its ticks are scheduled with ``loop.call_soon_threadsafe``. Measured to work with py-libp2p (two hosts, a stream, an
echo) while an asyncio task kept its 10 ms tick (``tests/test_aio.py`` holds a generation to it).

The bridge, both ways:

* asyncio -> trio: each call becomes a job ``async def job(peer)`` handed to the trio side through the trio token
  (``TrioToken.run_sync_soon``, safe from outside trio's context) and a memory channel; the job runs in the trio
  peer's nursery, under its own cancel scope.
* trio -> asyncio: the job's result, error or streamed item resolves an asyncio future or fills an asyncio queue
  via ``loop.call_soon_threadsafe``. Cancelling the awaiting asyncio task cancels the job's scope.

Trio allows one run per thread, so an event loop thread hosts one ``aio.Peer`` at a time; a second raises
:class:`~sangama_p2p.errors.SangamaError` (run it in another thread's loop if you need two).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import trio

from .api.server import ApiConfig
from .config import PeerConfig
from .errors import SangamaError, translate
from .model.tokenizer import Tokenizer
from .net.identity import KeyPair
from .peer import Generation, Peer as TrioPeer

__all__ = ["Peer"]

T = TypeVar("T")
_END = object()


class Peer:
    """An embedded Sangama peer for asyncio programs; the API mirrors :class:`sangama_p2p.Peer`.

    ``async with aio.Peer(config) as peer: text = (await peer.generate("hello", 16)).text``
    """

    def __init__(self, config: PeerConfig | None = None, *, key_pair: KeyPair | None = None) -> None:
        self.config = config or PeerConfig()
        self._key_pair = key_pair
        self._loop: asyncio.AbstractEventLoop | None = None
        self._token: trio.lowlevel.TrioToken | None = None
        self._jobs: trio.MemorySendChannel | None = None
        self._done: asyncio.Future | None = None
        self._peer: TrioPeer | None = None
        self._closing = False

    # lifetime ---------------------------------------------------------------------------------------------------

    async def __aenter__(self) -> "Peer":
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Start trio as a guest of the running loop and the trio peer inside it; returns once the peer is up."""
        if self._done is not None:
            raise SangamaError("this aio.Peer was already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        ready: asyncio.Future = loop.create_future()
        self._done = loop.create_future()

        def done_callback(outcome: Any) -> None:
            assert self._done is not None  # set above, before the guest run starts
            if self._done.done():
                return
            try:
                outcome.unwrap()
            except BaseException as exc:  # the trio side's failure is the caller's error
                self._done.set_exception(exc)
                if not ready.done():
                    ready.set_exception(exc)
            else:
                self._done.set_result(None)
                if not ready.done():
                    ready.set_exception(SangamaError("the trio peer stopped before it started"))

        try:
            trio.lowlevel.start_guest_run(
                self._trio_main,
                ready,
                run_sync_soon_threadsafe=loop.call_soon_threadsafe,
                run_sync_soon_not_threadsafe=loop.call_soon,
                done_callback=done_callback,
                host_uses_signal_set_wakeup_fd=True,
            )
        except RuntimeError as exc:  # "Attempted to call run() from inside a run()"
            raise translate(exc, SangamaError, "cannot start trio in this thread (one aio.Peer per event loop thread)")
        try:
            await asyncio.shield(ready)
        except BaseException:
            await self.aclose()
            raise

    async def _trio_main(self, ready: asyncio.Future) -> None:
        send, receive = trio.open_memory_channel[Callable[[TrioPeer], Awaitable[None]]](math.inf)
        async with TrioPeer(self.config, key_pair=self._key_pair) as peer, trio.open_nursery() as nursery:
            self._peer = peer
            self._jobs = send
            self._token = trio.lowlevel.current_trio_token()
            self._call_soon(ready.set_result, None)
            async with receive:
                async for job in receive:
                    nursery.start_soon(job, peer)
            nursery.cancel_scope.cancel()  # closing: jobs still running end with Cancelled

    async def aclose(self) -> None:
        """Stop the peer and the trio run; calls still running are cancelled. Idempotent."""
        if self._done is None:
            return
        self._closing = True
        if self._token is not None and self._jobs is not None:
            try:
                self._token.run_sync_soon(self._jobs.close)
            except trio.RunFinishedError:  # the trio run has ended already
                pass
        await asyncio.shield(self._done)  # the trio run ends: jobs cancelled, peer closed

    # helpers ----------------------------------------------------------------------------------------------------

    def _call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(fn, *args)

    def _check_running(self) -> asyncio.AbstractEventLoop:
        if self._loop is None or self._token is None or self._jobs is None or self._closing:
            raise SangamaError("the peer is not running (use `async with aio.Peer(...)`)")
        return self._loop

    def _submit(self, job: Callable[[TrioPeer], Awaitable[None]]) -> None:
        self._check_running()
        assert self._token is not None and self._jobs is not None  # checked above
        jobs = self._jobs

        def put() -> None:
            try:
                jobs.send_nowait(job)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass  # closing: the job's future is cancelled below by its scope never running

        try:
            self._token.run_sync_soon(put)
        except trio.RunFinishedError as exc:
            raise SangamaError("the peer has stopped") from exc

    async def _call(self, fn: Callable[[TrioPeer], Awaitable[T]]) -> T:
        """Run ``await fn(trio_peer)`` on the trio side and return its result here."""
        fut: asyncio.Future = self._check_running().create_future()
        scope_box: list[trio.CancelScope] = []

        def settle(setter: Callable[[Any], None], value: Any) -> None:
            if not fut.done():
                setter(value)

        async def job(peer: TrioPeer) -> None:
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                try:
                    result = await fn(peer)
                except trio.Cancelled:
                    self._call_soon(settle, fut.set_exception, SangamaError("cancelled: the peer is closing"))
                    raise
                except BaseException as exc:  # noqa: BLE001 - every error travels to the awaiting caller
                    self._call_soon(settle, fut.set_exception, exc)
                    return
                self._call_soon(settle, fut.set_result, result)

        self._submit(job)
        try:
            return await fut
        except asyncio.CancelledError:
            self._cancel_job(scope_box)
            raise

    def _cancel_job(self, scope_box: list[trio.CancelScope]) -> None:
        if self._token is None:
            return

        def cancel() -> None:
            for scope in scope_box:
                scope.cancel()

        try:
            self._token.run_sync_soon(cancel)
        except trio.RunFinishedError:  # the trio run has ended: nothing left to cancel
            pass

    # the peer's API ---------------------------------------------------------------------------------------------

    @property
    def peer_id(self) -> str:
        if self._peer is None:
            raise SangamaError("the peer is not running")
        return self._peer.peer_id

    @property
    def addrs(self) -> list[str]:
        if self._peer is None:
            raise SangamaError("the peer is not running")
        return self._peer.addrs

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer of the served model or of ``config.tokenizer_path`` (None when neither is known)."""
        return None if self._peer is None else self._peer.tokenizer

    async def serve(self, model: str, layers: str | tuple[int, int], **kwargs: Any) -> tuple[int, int]:
        """Serve ``layers`` of ``model`` (see :meth:`sangama_p2p.Peer.serve`)."""
        return await self._call(lambda p: p.serve(model, layers, **kwargs))

    async def serve_api(self, model: str | Path | None = None, config: ApiConfig | None = None,
                        **kwargs: Any) -> str:
        """Serve the OpenAI-compatible HTTP API until the peer closes; its base URL (see
        :meth:`sangama_p2p.Peer.serve_api`)."""
        return await self._call(lambda p: p.serve_api(model, config, **kwargs))

    async def generate(self, prompt: str | Sequence[int], max_new_tokens: int = 32, **kwargs: Any) -> Generation:
        """Generate through the swarm (see :meth:`sangama_p2p.Peer.generate`)."""
        return await self._call(lambda p: p.generate(prompt, max_new_tokens, **kwargs))

    async def stream(self, prompt: str | Sequence[int], max_new_tokens: int = 32, **kwargs: Any) -> AsyncIterator[int]:
        """Yield token ids as the last stage accepts them (see :meth:`sangama_p2p.Peer.stream`)."""
        self._check_running()
        items: asyncio.Queue = asyncio.Queue()
        scope_box: list[trio.CancelScope] = []

        async def job(peer: TrioPeer) -> None:
            with trio.CancelScope() as scope:
                scope_box.append(scope)
                try:
                    async for tok in peer.stream(prompt, max_new_tokens, **kwargs):
                        self._call_soon(items.put_nowait, tok)
                except trio.Cancelled:
                    self._call_soon(items.put_nowait, SangamaError("cancelled: the peer is closing"))
                    raise
                except BaseException as exc:  # noqa: BLE001 - the consumer re-raises it
                    self._call_soon(items.put_nowait, exc)
                    return
                self._call_soon(items.put_nowait, _END)

        self._submit(job)
        try:
            while True:
                item = await items.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            self._cancel_job(scope_box)  # a consumer that stops early cancels the generation
