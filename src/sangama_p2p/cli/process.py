"""What a networked command does around its work: quiet py-libp2p's routine noise, wait for a signal, tell typed
errors out of trio's exception groups, and report progress on stderr."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import SangamaError, group_leaves

__all__ = ["add_progress_arg", "progress", "quiet_libp2p", "sangama_errors", "say", "show_progress", "until_signal"]


def quiet_libp2p() -> None:
    """No ``-v``: hide py-libp2p's routine warnings (stream resets); ``-v``: its warnings; ``-vv``: everything."""
    from ..net.logs import quiet_libp2p as quiet  # py-libp2p (0.8-1.4 s to import): only for networked commands

    quiet()


async def until_signal(signals: AsyncIterator[Any], seconds: float | None) -> int | None:
    """Return the first signal from ``signals`` (or None after ``seconds``), so that every ``async with``
    unwinds."""
    import trio  # 0.07-0.2 s: only for the commands that run a node

    with trio.move_on_after(seconds if seconds is not None else float("inf")):
        async for signum in signals:
            return int(signum)
    return None


def say(line: str) -> None:
    """A line on stdout; once nobody reads it (``join ... | head -1``) the node runs on without output."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)  # the rest of our output, and the interpreter's last flush
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        print("sangama-peer: stdout closed; serving on without output", file=sys.stderr, flush=True)


def sangama_errors(exc: BaseException) -> list[BaseException] | None:
    """The typed errors that ``exc`` is (trio may wrap them in groups), or None when it holds anything else."""
    if isinstance(exc, SangamaError):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        errors, rest = exc.split(SangamaError)
        if errors is not None and rest is None:
            return group_leaves(errors)
    return None


def add_progress_arg(p: argparse.ArgumentParser, what: str) -> None:
    """``--progress`` / ``--no-progress``: report ``what`` on stderr (default: when stderr is a terminal)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help=f"report {what} on stderr (default: when stderr is a terminal)")


def show_progress(flag: bool | None = None) -> bool:
    """Whether to report progress: ``--progress``/``--no-progress`` when given, else when stderr is a terminal."""
    return flag if flag is not None else sys.stderr.isatty()


@contextmanager
def progress(what: str, *, show: bool, count: int | None = None, unit: str = "") -> Iterator[None]:
    """``what ...`` on stderr (a spinner with the time so far on a terminal), then ``what: done in 1.2 s`` (with
    ``count``: and its rate, ``(250 tokens/s)``) or ``what: failed after 1.2 s``; nothing unless ``show``. stdout (the
    text, the JSON) never carries it."""
    if not show:
        yield
        return
    from rich.console import Console  # 0.03 s, only when progress is shown

    console = Console(stderr=True)
    t = time.perf_counter()
    try:
        if console.is_terminal:
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                          transient=True) as bar:
                bar.add_task(f"{what} ...", total=None)
                yield
        else:
            print(f"{what} ...", file=sys.stderr, flush=True)
            yield
    except BaseException:
        print(f"{what}: failed after {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        raise
    dt = time.perf_counter() - t
    rate = f" ({count / max(dt, 1e-9):,.0f} {unit}/s)" if count is not None else ""
    print(f"{what}: done in {dt:.1f} s{rate}", file=sys.stderr, flush=True)
