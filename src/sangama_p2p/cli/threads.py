"""How many cores a command's torch work uses: ``--threads N``, by default every core this process may run on.

Set here, at the CLI edge, never at import (library users choose their own)."""

from __future__ import annotations

import os

# torch (1.4-2.6 s to import) is imported where the threads are set: cli/main.py imports the command modules, and
# they this one, to build its parser

__all__ = ["available_cores", "set_threads"]


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, so ``taskset -c 0`` counts 1), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def set_threads(n: int | None) -> int:
    """torch's intra-op threads: ``n``, or :func:`available_cores` when None. Returns the number set."""
    import torch

    count = n if n is not None else available_cores()
    torch.set_num_threads(count)
    return count
