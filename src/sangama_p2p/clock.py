"""The clock of the network code (``client/``, ``stage/``, ``net/``): one seam, so that a simulation can run that code
under trio's :class:`trio.testing.MockClock` (an hour of swarm time in minutes; issue 25).

- :func:`now`: monotonic seconds for timeouts, trip and probe times, idle sessions and backoffs. Inside a trio run it
  is the run's clock (``trio.current_time()``, which a ``MockClock`` drives); outside one (a worker thread, a test
  without a run) ``time.perf_counter()``. Only differences of two readings taken on the same side mean anything.
- :func:`wall`: seconds since the epoch, for what other machines read (records' expiry, bans, ``ended_at``):
  ``time.time()``, or, inside :func:`virtual_wall`, a start time plus the run's clock, so that records expire in
  simulated time.
- :func:`sleep`: trio's, which follows the run's clock already.

A stage's compute timing (calibration, loading) stays on ``time.perf_counter()``: a simulation models compute
instead of running it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio

__all__ = ["now", "sleep", "virtual_wall", "wall"]

sleep = trio.sleep

_wall_base: float | None = None  # inside virtual_wall: the wall time at the run clock's zero


def now() -> float:
    """Monotonic seconds: the trio run's clock, or ``time.perf_counter()`` outside a run."""
    try:
        return trio.current_time()
    except RuntimeError:  # no trio run in this thread
        return time.perf_counter()


def wall() -> float:
    """Seconds since the epoch: ``time.time()``, or the simulated wall inside :func:`virtual_wall`."""
    if _wall_base is None:
        return time.time()
    return _wall_base + now()


@contextmanager
def virtual_wall(start: float | None = None) -> Iterator[None]:
    """Make :func:`wall` follow the trio run's clock, reading ``start`` (default: the real wall time) now; call it
    inside the run whose (mock) clock the simulation drives."""
    global _wall_base
    old = _wall_base
    _wall_base = (time.time() if start is None else start) - now()
    try:
        yield
    finally:
        _wall_base = old
