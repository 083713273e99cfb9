"""Argument types shared by the subcommands: a bad value is refused by argparse (usage, one error line, exit 2)
before anything starts, instead of failing deep inside a run (or, worse, silently doing nothing)."""

from __future__ import annotations

import argparse

from ..errors import ModelError
from ..guesses import parse_guesses

__all__ = ["guesses", "non_negative_int", "positive_float", "positive_int"]


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1 (``--batch``, ``--threads``)."""
    n = _int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def non_negative_int(text: str) -> int:
    """An integer >= 0 (``--max-new-tokens``)."""
    n = _int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive_float(text: str) -> float:
    """A number > 0 (``--timeout``)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not x > 0 or x == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text}")
    return x


def fraction(text: str) -> float:
    """A number in [0, 1] (``--verify``)."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 1], got {text!r}") from None
    if not 0.0 <= x <= 1.0:
        raise argparse.ArgumentTypeError(f"must lie in [0, 1], got {text}")
    return x


def guesses(text: str) -> int | str:
    """``auto`` or a number of guesses per trip in 0..MAX_GUESSES."""
    try:
        parse_guesses(text)
    except ModelError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text if text == "auto" else int(text)
