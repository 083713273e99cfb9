"""Counters of one client's generations since it started: what ``/metrics`` of ``sangama-peer api`` exports
(failovers, verification, bans happen in clients, not at the stages)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ClientStats"]


@dataclass
class ClientStats:
    """``generations`` ended (``failed`` of them raised; a cancelled one, say a client that hung up, is not a
    failure), the ``tokens`` they produced, their ``failovers`` (re-routes), the trips a second chain checked
    (``verified_trips``) or could not (``unverified_trips``), and the peers the verifier banned."""

    generations: int = 0
    failed: int = 0
    tokens: int = 0
    failovers: int = 0
    verified_trips: int = 0
    unverified_trips: int = 0
    liars_banned: int = 0

    def add(self, result: Any, *, failed: bool) -> None:
        """Count one ended generation (a :class:`~sangama_p2p.client.timing.GenerationResult`)."""
        self.generations += 1
        self.failed += int(failed)
        self.tokens += len(result.tokens)
        self.failovers += result.failovers
        self.verified_trips += result.verified_trips or 0
        self.unverified_trips += result.unverified_trips or 0
