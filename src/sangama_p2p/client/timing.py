"""Where the time of a trip goes, from the stages' own stamps and the client's clock. Pure functions.

Every stage stamps receive, compute start, compute end and send on its own monotonic clock. Differences within
one stamp are durations on one clock, so no clock sync is needed: queue = compute start - receive, compute =
compute end - compute start, send = send - compute end (encoding the output, waiting for the link). The client
times the whole trip on its clock; the network's share is what remains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..wire.messages import TraceStamp

__all__ = ["StageTime", "TripTiming", "summarize_trips", "trip_timing"]


@dataclass(frozen=True)
class StageTime:
    peer: str
    queue_s: float
    compute_s: float
    send_s: float
    batch_size: int

    @property
    def total_s(self) -> float:
        return self.queue_s + self.compute_s + self.send_s


@dataclass(frozen=True)
class TripTiming:
    """One trip: ``trip_s`` on the client's clock, each stage's share, and the network remainder."""

    step: int
    tokens: int  # token ids sent (prompt on the prefill, 1 + guesses afterwards)
    emitted: int  # tokens the trip produced (accepted guesses + 1)
    trip_s: float
    stages: tuple[StageTime, ...]

    @property
    def stage_s(self) -> float:
        return sum(s.total_s for s in self.stages)

    @property
    def network_s(self) -> float:
        return self.trip_s - self.stage_s


def trip_timing(step: int, tokens: int, emitted: int, trip_s: float, trace: Sequence[TraceStamp]) -> TripTiming:
    """Turn a returned trace into per-stage durations (negative differences, from a broken clock, count as 0)."""
    stages = tuple(
        StageTime(
            t.peer,
            max(t.compute_start_ns - t.recv_ns, 0) / 1e9,
            max(t.compute_end_ns - t.compute_start_ns, 0) / 1e9,
            max(t.send_ns - t.compute_end_ns, 0) / 1e9,
            t.batch_size,
        )
        for t in trace
    )
    return TripTiming(step, tokens, emitted, trip_s, stages)


def summarize_trips(trips: Sequence[TripTiming], *, skip_prefill: bool = True) -> dict:
    """Mean milliseconds per trip: each stage's queue/compute/send, the network, the trip; the seed's table rows.

    Returns ``{"trips": n, "trip_ms": .., "network_ms": .., "stages": [{"peer", "queue_ms", "compute_ms",
    "send_ms", "mean_batch"}, ...]}``, stages in chain order (a trip whose chain changed after a failover is
    grouped by position).
    """
    first = next((i for i, t in enumerate(trips) if t.emitted), len(trips))  # the prefill ends here (chunks too)
    rows = list(trips[first + 1:]) if skip_prefill else list(trips)
    rows = rows or list(trips)
    n = len(rows)
    if not n:
        return {"trips": 0, "trip_ms": 0.0, "network_ms": 0.0, "stages": []}
    width = max(len(t.stages) for t in rows)
    stages = []
    for i in range(width):
        parts = [t.stages[i] for t in rows if i < len(t.stages)]
        k = max(len(parts), 1)
        stages.append({
            "peer": parts[-1].peer if parts else "",
            "queue_ms": round(sum(p.queue_s for p in parts) * 1e3 / k, 3),
            "compute_ms": round(sum(p.compute_s for p in parts) * 1e3 / k, 3),
            "send_ms": round(sum(p.send_s for p in parts) * 1e3 / k, 3),
            "mean_batch": round(sum(p.batch_size for p in parts) / k, 2),
        })
    return {
        "trips": n,
        "trip_ms": round(sum(t.trip_s for t in rows) * 1e3 / n, 3),
        "network_ms": round(sum(t.network_s for t in rows) * 1e3 / n, 3),
        "stages": stages,
    }
