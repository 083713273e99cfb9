"""Bounds on every field a peer can send, and the checks that enforce them.

Why here, in one place: message constructors call these checks, so a message that exists has passed them, whether
it was built locally or decoded from a peer. Every failure is an :class:`InvalidMessageError` naming the field.
"""

from __future__ import annotations

import math
from typing import Final

from sangama_p2p.errors import InvalidMessageError

__all__ = [
    "MAX_GUESSES",
    "MAX_ID_BYTES",
    "MAX_INDEX",
    "MAX_RING_STOP",
    "MAX_TEXT_BYTES",
    "MAX_TOKENS",
    "MAX_TOKEN_ID",
    "MAX_TRACE",
    "MAX_U64",
    "MAX_WINDOWS",
    "SESSION_ID_BYTES",
]

SESSION_ID_BYTES: Final = 16
MAX_ID_BYTES: Final = 256
"""Peer ids, model ids, client ids, software versions (UTF-8 bytes)."""
MAX_TEXT_BYTES: Final = 4096
"""Human-readable error text (UTF-8 bytes)."""
MAX_TOKENS: Final = 1 << 20
"""Token ids in one step: a whole long prompt's prefill fits."""
MAX_TOKEN_ID: Final = 1 << 31
"""Token ids lie in [0, 2**31)."""
MAX_GUESSES: Final = 8
"""Speculative guesses checked or drafted in one trip: the one bound, which the client's ``--guesses`` and a stage's
``max_guesses`` obey too (``sangama_p2p.guesses`` takes it from here)."""
MAX_TOP_LOGPROBS: Final = 20
"""Alternatives a session may ask the last stage to score per token (OpenAI's ``top_logprobs`` limit)."""
MAX_RING_STOP: Final = 64
"""Stop tokens in ``OpenSession.ring_stop`` (where the last stage stops handing trips on)."""
MAX_WINDOWS: Final = 4
"""Guess windows a ring may have in flight at once (``OpenSession.windows``)."""
MAX_GRAMMAR_BYTES: Final = 64 * 1024
"""A session's grammar (``OpenSession.grammar``: llguidance's JSON grammar, compiled from a JSON schema)."""
MAX_TRACE: Final = 64
"""Trace stamps in one frame: one per stage, so at most this many stages per chain."""
MAX_INDEX: Final = 1 << 31
"""Positions, lengths, layer indices, counters lie in [0, 2**31)."""
MAX_U64: Final = 1 << 64
"""Sequence numbers, seeds and nanosecond stamps lie in [0, 2**64)."""


def check_uint(name: str, value: object, bound: int = MAX_INDEX) -> int:
    """An int (not a bool) in ``[0, bound)``."""
    if type(value) is not int:
        raise InvalidMessageError(f"{name} must be an int, got {type(value).__name__}")
    if not 0 <= value < bound:
        raise InvalidMessageError(f"{name} must lie in [0, {bound}), got {value}")
    return value


def check_opt_uint(name: str, value: object, bound: int = MAX_INDEX) -> int | None:
    return None if value is None else check_uint(name, value, bound)


def check_float(name: str, value: object) -> float:
    """A finite float; an int is accepted and widened (other encoders may pack 1.0 as 1)."""
    if type(value) is int:
        value = float(value)
    if type(value) is not float:
        raise InvalidMessageError(f"{name} must be a float, got {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidMessageError(f"{name} must be finite, got {value}")
    return value


def check_bool(name: str, value: object) -> bool:
    if type(value) is not bool:
        raise InvalidMessageError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_text(name: str, value: object, max_bytes: int = MAX_ID_BYTES, *, empty: bool = False) -> str:
    """A str that encodes as UTF-8 in at most ``max_bytes`` bytes (non-empty unless ``empty``)."""
    if type(value) is not str:
        raise InvalidMessageError(f"{name} must be a str, got {type(value).__name__}")
    if len(value) > max_bytes:
        raise InvalidMessageError(f"{name} longer than {max_bytes} bytes")
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(f"{name} is not valid UTF-8 text") from exc
    if size > max_bytes:
        raise InvalidMessageError(f"{name} longer than {max_bytes} bytes")
    if not size and not empty:
        raise InvalidMessageError(f"{name} must not be empty")
    return value


def check_opt_text(name: str, value: object, max_bytes: int = MAX_ID_BYTES) -> str | None:
    return None if value is None else check_text(name, value, max_bytes)


def check_session_id(name: str, value: object) -> bytes:
    if type(value) is not bytes:
        raise InvalidMessageError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) != SESSION_ID_BYTES:
        raise InvalidMessageError(f"{name} must be {SESSION_ID_BYTES} bytes, got {len(value)}")
    return value


def check_bytes(name: str, value: object, size: int) -> bytes:
    """Exactly ``size`` raw bytes (a key, a token)."""
    if type(value) is not bytes:
        raise InvalidMessageError(f"{name} must be bytes, got {type(value).__name__}")
    if len(value) != size:
        raise InvalidMessageError(f"{name} must be {size} bytes, got {len(value)}")
    return value


def check_opt_session_id(name: str, value: object) -> bytes | None:
    return None if value is None else check_session_id(name, value)


def _as_tuple(name: str, value: object, min_len: int, max_len: int) -> tuple[object, ...]:
    """A tuple (a list is accepted and frozen) of ``min_len`` to ``max_len`` items."""
    if type(value) is list:
        value = tuple(value)
    if type(value) is not tuple:
        raise InvalidMessageError(f"{name} must be a tuple, got {type(value).__name__}")
    if not min_len <= len(value) <= max_len:
        raise InvalidMessageError(f"{name} holds {len(value)} items, expected {min_len} to {max_len}")
    return value


def check_uints(name: str, value: object, max_len: int, bound: int, min_len: int = 0) -> tuple[int, ...]:
    """A tuple of ``min_len`` to ``max_len`` ints in ``[0, bound)``: token ids, tensor shapes."""
    items = _as_tuple(name, value, min_len, max_len)
    for v in items:
        if type(v) is not int or not 0 <= v < bound:
            raise InvalidMessageError(f"{name} holds {v!r}, not an int in [0, {bound})")
    return items  # type: ignore[return-value]  # every item checked above


def check_tokens(name: str, value: object, max_len: int) -> tuple[int, ...]:
    """At most ``max_len`` token ids in ``[0, 2**31)``."""
    return check_uints(name, value, max_len, MAX_TOKEN_ID)


def check_tuple_of(name: str, value: object, kind: type, max_len: int) -> tuple[object, ...]:
    """At most ``max_len`` instances of exactly ``kind``."""
    items = _as_tuple(name, value, 0, max_len)
    for v in items:
        if type(v) is not kind:
            raise InvalidMessageError(f"{name} holds a {type(v).__name__}, expected {kind.__name__}")
    return items
