"""Counters of one client's generations since it started: what ``/metrics`` of ``sangama-peer api`` exports
(failovers, verification, bans happen in clients, not at the stages)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .. import clock

__all__ = ["RECENT", "ClientStats"]

RECENT = 20  # generations kept for the dashboard's "recent generations"


@dataclass
class ClientStats:
    """``generations`` ended (``failed`` of them raised; a cancelled one, say a client that hung up, is not a
    failure), the ``tokens`` they produced, their ``failovers`` (re-routes), the trips a second chain checked
    (``verified_trips``) or could not (``unverified_trips``), the peers the verifier banned, and a summary of each
    of the last :data:`RECENT` generations (``recent``)."""

    generations: int = 0
    failed: int = 0
    tokens: int = 0
    failovers: int = 0
    verified_trips: int = 0
    unverified_trips: int = 0
    liars_banned: int = 0
    recent: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=RECENT))  # newest first

    def add(self, result: Any, *, failed: bool) -> None:
        """Count one ended generation (a :class:`~sangama_p2p.client.timing.GenerationResult`)."""
        self.generations += 1
        self.failed += int(failed)
        self.tokens += len(result.tokens)
        self.failovers += result.failovers
        self.verified_trips += result.verified_trips or 0
        self.unverified_trips += result.unverified_trips or 0
        self.recent.appendleft({"ended_at": round(clock.wall(), 3), "prompt_tokens": len(result.prompt_ids),
                                "tokens": len(result.tokens), "tokens_per_s": round(result.decode_tokens_per_s, 2),
                                "first_token_ms": round(result.prefill_s * 1e3, 1), "route": list(result.route or ()),
                                "failovers": result.failovers, "verified_trips": result.verified_trips,
                                "unverified_trips": result.unverified_trips, "failed": failed})
