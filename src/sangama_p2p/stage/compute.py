"""The stage's compute thread: one long-lived thread that runs compute calls in order, off the trio thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import trio

__all__ = ["ComputeThread"]

T = TypeVar("T")


class ComputeThread:
    """One long-lived thread that runs a stage's compute calls in order, off the trio thread.

    Why not ``trio.to_thread.run_sync``: measured on the 2-core dev machine with a 1 ms torch call, its hand-off
    took ~95 us there and 0.4-3 ms back (trio 0.3x's thread cache), against ~20 us and ~150 us for a dedicated thread
    fed by a queue that reports back with ``TrioToken.run_sync_soon``; a pipeline trip pays both at every stage.
    Like ``to_thread.run_sync``, a call is not abandoned when the caller is cancelled: it finishes first (session
    state must never be left half-updated), then the cancellation proceeds.
    """

    def __init__(self, name: str = "sangama-compute") -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, done = job
            try:
                result: tuple[bool, Any] = (True, fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who re-raises it
                result = (False, exc)
            try:
                self._token.run_sync_soon(done, result)
            except trio.RunFinishedError:  # the trio run ended while we computed: nobody is waiting
                return

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the compute thread; returns its result or raises its exception."""
        finished = trio.Event()
        box: list[tuple[bool, Any]] = []

        def done(result: tuple[bool, Any]) -> None:
            box.append(result)
            finished.set()

        self._jobs.put((fn, args, done))
        with trio.CancelScope(shield=True):
            await finished.wait()
        await trio.lowlevel.checkpoint_if_cancelled()
        ok, value = box[0]
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        """Let the thread end after the call it is running (if any)."""
        self._jobs.put(None)
