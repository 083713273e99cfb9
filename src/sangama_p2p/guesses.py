"""How many guesses a step may carry: one rule for the local chain, the client and the CLI (no torch here)."""

from __future__ import annotations

from .errors import ModelError
from .wire.limits import MAX_GUESSES

__all__ = ["AUTO_MAX_GUESSES", "MAX_GUESSES", "parse_guesses"]

AUTO_MAX_GUESSES = 6  # the adaptive policy's ceiling


def parse_guesses(value: int | str) -> tuple[int, bool]:
    """``4`` -> (4, fixed); ``"auto"`` -> (AUTO_MAX_GUESSES, adaptive)."""
    if value == "auto":
        return AUTO_MAX_GUESSES, True
    try:
        k = int(value)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"guesses must be an integer >= 0 or 'auto', got {value!r}") from exc
    if k < 0 or k > MAX_GUESSES:
        raise ModelError(f"guesses must be in 0..{MAX_GUESSES} or 'auto', got {k}")
    return k, False
