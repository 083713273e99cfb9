"""``ByteBudget``: the bytes (and time) that a stage's readers may spend together on partial frames (no I/O).

Split from :mod:`sangama_p2p.wire.framing`, which re-exports it and describes how decoders use it.
"""

from __future__ import annotations

__all__ = ["ByteBudget"]


class ByteBudget:
    """Bytes that many readers may hold together for partial frames (no I/O, not thread-safe: one event loop).

    ``reserve(n, peer)`` takes ``n`` bytes or nothing: nothing when they would take the total past ``limit`` or
    ``peer``'s share past ``per_peer`` (None: no share per peer); ``release(n, peer)`` gives them back. ``peak`` is
    the high-water mark. ``partial_timeout`` (s) and ``partial_rate`` (bytes/s) set how long a partial frame may
    take (:meth:`deadline`; None: no time limit)."""

    __slots__ = ("_by_peer", "limit", "partial_rate", "partial_timeout", "peak", "per_peer", "used")

    def __init__(self, limit: int, *, per_peer: int | None = None, partial_timeout: float | None = None,
                 partial_rate: int | None = None) -> None:
        if type(limit) is not int or limit < 0:
            raise ValueError(f"a byte budget must be a non-negative int, got {limit!r}")
        if per_peer is not None and (type(per_peer) is not int or per_peer < 0):
            raise ValueError(f"a per-peer share must be a non-negative int, got {per_peer!r}")
        if partial_timeout is not None and not partial_timeout > 0:
            raise ValueError(f"partial_timeout must be positive, got {partial_timeout!r}")
        if partial_rate is not None and (type(partial_rate) is not int or partial_rate <= 0):
            raise ValueError(f"partial_rate must be a positive int, got {partial_rate!r}")
        self.limit = limit
        self.per_peer = per_peer
        self.partial_timeout = partial_timeout
        self.partial_rate = partial_rate
        self.used = 0
        self.peak = 0
        self._by_peer: dict[str, int] = {}  # only peers holding something: it never outgrows the partial frames

    @property
    def left(self) -> int:
        return self.limit - self.used

    def held_by(self, peer: str) -> int:
        """Bytes the decoders of ``peer`` hold now."""
        return self._by_peer.get(peer, 0)

    def refusal(self, n: int, peer: str = "") -> str | None:
        """Why ``n`` more bytes for ``peer`` cannot be taken (None: they can)."""
        if n > self.limit - self.used:
            return f"the input budget has {self.limit - self.used} of {self.limit} bytes left"
        if self.per_peer is not None and self._by_peer.get(peer, 0) + n > self.per_peer:
            return f"its peer holds {self._by_peer.get(peer, 0)} bytes of its per-peer share of {self.per_peer}"
        return None

    def reserve(self, n: int, peer: str = "") -> bool:
        if self.refusal(n, peer) is not None:
            return False
        self.used += n
        self.peak = max(self.peak, self.used)
        if n:
            self._by_peer[peer] = self._by_peer.get(peer, 0) + n
        return True

    def release(self, n: int, peer: str = "") -> None:
        self.used = max(0, self.used - n)
        left = self._by_peer.pop(peer, 0) - n
        if left > 0:
            self._by_peer[peer] = left

    def deadline(self, started: float, length: int) -> float | None:
        """When a partial frame of ``length`` announced bytes (0 while its prefix is incomplete), begun at
        ``started``, must be complete; None without a time limit."""
        if self.partial_timeout is None:
            return None
        extra = length / self.partial_rate if self.partial_rate else 0.0
        return started + self.partial_timeout + extra
