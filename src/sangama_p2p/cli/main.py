"""``sangama-peer``: one command with subcommands.

Each ``cli/*_cmds.py`` module adds its subcommands with ``register(subparsers)``. Registration imports nothing
heavy: torch, trio and libp2p are imported inside the handlers, so that e.g. ``sangama-peer bootstrap`` never
imports torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading

from ..errors import SangamaError, group_leaves

_COMMAND_MODULES = ("model_cmds", "net_cmds", "make_cmds", "peer_cmds", "chat_cmds", "hub_cmds", "api_cmds")
_WITHOUT_TORCH = frozenset({"id", "bootstrap", "status"})  # these run on machines without torch (net_cmds)
_TORCH = "torch"  # a name, so that tests can stand in a module of their own


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sangama-peer",
        description="Sangama: run language models too large for one machine across a peer-to-peer pipeline.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in _COMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__package__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__package__}.{name}":
                continue  # a command group that this build does not ship
            raise
        module.register(sub)
    return parser


def import_keeping_interrupts(name: str) -> None:
    """Import ``name`` so that a Ctrl-C landing during the import is not lost.

    torch's import swallows a KeyboardInterrupt raised in part of it (~0.2 s of its ~2-3 s on a busy machine), and
    the command then went on as if nothing happened: ``join`` loaded its layers and served. A handler that notes
    the signal (and raises as Python's own does) lets us raise it again once the import is over.
    """
    if (name in sys.modules or threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler):  # e.g. ignored in a background job
        importlib.import_module(name)
        return
    seen: list[int] = []

    def note(signum: int, frame: object) -> None:
        seen.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, note)
    try:
        importlib.import_module(name)
    finally:
        signal.signal(signal.SIGINT, previous)
    if seen:
        raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if getattr(args, "command", None) not in _WITHOUT_TORCH:
            import_keeping_interrupts(_TORCH)
        torch = sys.modules.get("torch")
        grad = torch.is_grad_enabled() if torch is not None else True
        try:
            return int(args.handler(args) or 0)
        finally:  # join and demo switch autograd off for their thread; a caller in the same process gets it back
            torch = sys.modules.get("torch")
            if torch is not None:
                torch.set_grad_enabled(grad)
    except SangamaError as exc:
        print(f"sangama-peer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BaseExceptionGroup as group:
        # trio raises Ctrl-C in whichever task runs when it lands: from a background task it crosses nurseries
        # wrapped in a group (alone, or beside the errors it caused), and it is still an interrupt
        if group.subgroup(KeyboardInterrupt) is not None:
            return 130
        errors, rest = group.split(SangamaError)
        if errors is not None and rest is None:  # only typed errors: report them like a single one
            for exc in group_leaves(errors):
                print(f"sangama-peer: error: {exc}", file=sys.stderr)
            return 2
        raise


def entry() -> None:
    """The console script: :func:`main`, then exit at once. By the time ``main`` returns every nursery has closed and
    every child process is reaped; tearing down the interpreter (torch's and libp2p's modules) took another 1-3 s after
    a stage stopped on SIGTERM, so the output is flushed and the process exits without it."""
    rc = main()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":  # pragma: no cover
    entry()
