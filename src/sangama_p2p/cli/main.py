"""``sangama-peer``: one command with subcommands.

Each ``cli/*_cmds.py`` module adds its subcommands with ``register(subparsers)``; the parser imports them all.
Registration imports nothing heavy: torch (1.4-2.6 s to import on the 2-core CI machine), libp2p (0.8-1.4 s), trio
(0.07-0.2 s) and the project modules that pull them in (``sangama_p2p.peer``: 3-4 s) are imported inside the
handlers, measured with ``python -X importtime``: ``sangama-peer --help`` takes 0.1 s, and ``sangama-peer
bootstrap`` never imports torch. Everything else is imported at the top of each module (tests/test_cli_main.py
pins both).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading

from .. import __version__
from ..errors import SangamaError, group_leaves

_COMMAND_MODULES = ("generate_cmds", "net_cmds", "make_cmds", "peer_cmds", "chat_cmds", "hub_cmds", "api_cmds",
                    "dashboard_cmds", "perplexity_cmds")
_VERBOSE_HELP = "more logging (-v info, -vv debug)"
_WITHOUT_TORCH = frozenset({"id", "bootstrap", "status", "dashboard"})  # these run on machines without torch
_TORCH = "torch"  # a name, so that tests can stand in a module of their own


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sangama-peer",
        description="Sangama: run language models too large for one machine across a peer-to-peer pipeline.",
    )
    parser.add_argument("--version", action="version", version=f"sangama-peer {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=_VERBOSE_HELP)
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
    for command in sub.choices.values():  # -v after the subcommand too; both places add up
        command.add_argument("-v", "--verbose", dest="sub_verbose", action="count", default=0, help=_VERBOSE_HELP)
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


def main(argv: list[str] | None = None, *, whole_process: bool = False) -> int:
    """Run one command; ``whole_process``: this process is the command's own (the console script), so its
    floating-point mode is set for every thread before any torch work (``model.ops.flush_denormals_in_process``)."""
    try:
        args = build_parser().parse_args(argv)
        verbose = args.verbose + getattr(args, "sub_verbose", 0)
        level = {0: logging.WARNING, 1: logging.INFO}.get(verbose, logging.DEBUG)
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if getattr(args, "command", None) not in _WITHOUT_TORCH:
            import_keeping_interrupts(_TORCH)
            if whole_process:
                from ..model.ops import flush_denormals_in_process

                flush_denormals_in_process()
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
    except BrokenPipeError:  # stdout closed by its reader (`generate ... | head -1`): nothing more to say
        return _stdout_closed()
    except BaseExceptionGroup as group:
        # trio raises Ctrl-C in whichever task runs when it lands: from a background task it crosses nurseries
        # wrapped in a group (alone, or beside the errors it caused), and it is still an interrupt
        if group.subgroup(KeyboardInterrupt) is not None:
            return 130
        if group.subgroup(BrokenPipeError) is not None:
            return _stdout_closed()
        errors, rest = group.split(SangamaError)
        if errors is not None and rest is None:  # only typed errors: report them like a single one
            for exc in group_leaves(errors):
                print(f"sangama-peer: error: {exc}", file=sys.stderr)
            return 2
        raise


def _stdout_closed() -> int:
    """The reader of stdout has gone: point stdout at /dev/null (the interpreter's last flush would fail again) and
    exit as a process killed by SIGPIPE does, 128 + 13."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + signal.SIGPIPE


def entry() -> None:
    """The console script: :func:`main`, then exit at once. By the time ``main`` returns every nursery has closed and
    every child process is reaped; tearing down the interpreter (torch's and libp2p's modules) took another 1-3 s after
    a stage stopped on SIGTERM, so the output is flushed and the process exits without it."""
    rc = main(whole_process=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said there
            pass
    logging.shutdown()
    os._exit(rc)


if __name__ == "__main__":  # pragma: no cover
    entry()
