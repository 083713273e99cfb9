"""How many cores a command's torch work uses: ``--threads N``, by default half the cores this process may run on
(at least one).

Why half, not all: torch's threads wait for each other at every operation, so one thread that another process
pre-empts stalls them all. Measured on the 2-core development machine with SmolLM2-135M Q4_1 (``generate --local
--max-new-tokens 32``) while two busy loops held both cores: 2 threads loaded in 15-20 s and decoded 3.0-4.8
tokens/s, 1 thread loaded in 1.6-1.8 s and decoded 10-13 tokens/s; on the idle machine 2 threads decoded 32.7 tokens/s
and 1 thread 24.7 (both loaded in 0.8 s). Half the cores costs a quarter of the speed on an idle machine and is never
the pathological case on a busy one (other stages on the same machine, say); ``--threads N`` takes every core where
the machine is the stage's alone.

Set here, at the CLI edge, never at import (library users choose their own)."""

from __future__ import annotations

import os

# torch (1.4-2.6 s to import) is imported where the threads are set: cli/main.py imports the command modules, and
# they this one, to build its parser

__all__ = ["available_cores", "default_threads", "set_threads"]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, so ``taskset -c 0`` counts 1), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def default_threads(cores: int | None = None) -> int:
    """Threads when ``--threads`` is not given: half of ``cores`` (default :func:`available_cores`), at least 1."""
    return max(1, (cores if cores is not None else available_cores()) // 2)


def set_threads(n: int | None) -> int:
    """torch's intra-op threads: ``n``, or :func:`default_threads` when None. Returns the number set."""
    import torch

    count = n if n is not None else default_threads()
    torch.set_num_threads(count)
    return count
