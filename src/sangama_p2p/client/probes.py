"""What a client remembers of the peers it probed: which did not answer (until they publish a newer record) and
which answered late (skipped for a while, ever longer). Surveys skip both before choosing candidates."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import SangamaError
from .routing import RouteCandidate

__all__ = ["SETTLE_FACTOR", "SETTLE_MIN_S", "SLOW_PROBE_FACTOR", "SLOW_RETRY_MAX_S", "SLOW_RETRY_S", "ProbeMemory",
           "ProbeRound", "covers", "probe_peer"]

log = logging.getLogger(__name__)

SLOW_RETRY_S = 30.0  # a peer whose probe timed out is left out of surveys this long (unless a caller retries it)
SLOW_RETRY_MAX_S = 480.0  # twice as long after each further time-out in a row, up to this
SLOW_PROBE_FACTOR = 3.0  # a late peer asked again (``retry_slow``) gets this many times the probe's time
SETTLE_MIN_S = 0.25  # once the peers that answered cover the model, a survey waits this long for the others at least
SETTLE_FACTOR = 4.0  # ... or this many times the slowest answer so far (the rest answer into the survey later)


def covers(offers: Sequence[Any], depth: int) -> bool:
    """Whether the ranges of ``offers`` of one checkpoint fingerprint chain from layer 0 to ``depth``."""
    if depth <= 0:
        return False
    groups: dict[str, list[Any]] = {}
    for o in offers:
        groups.setdefault(o.fingerprint, []).append(o)
    for group in groups.values():
        reach = {0}
        for o in sorted(group, key=lambda o: o.start):
            if o.start in reach and o.end > o.start:
                reach.add(o.end)
        if depth in reach:
            return True
    return False


class ProbeMemory:
    def __init__(self) -> None:
        self.versions: dict[str, tuple[int, float]] = {}  # peer -> (seq, expiry) of its record in the last survey
        self.silent: dict[str, tuple[int, float]] = {}  # peers that did not answer -> the record they had then
        self.slow: dict[str, tuple[float, float]] = {}  # peers whose probes timed out -> (skipped until, backoff)

    def seen(self, records: Any) -> None:
        """The records of a survey: the versions a later :meth:`mark_silent` remembers."""
        self.versions = {rec.peer_id: (rec.seq, rec.expires_at) for rec in records}

    def usable(self, rec: Any, retry_slow: bool) -> bool:
        """Whether a survey may probe ``rec``'s peer: not silent since this record, not late (unless ``retry_slow``)."""
        return not self.still_silent(rec) and (retry_slow or not self.still_slow(rec.peer_id))

    def answered(self, peer: str) -> None:
        self.silent.pop(peer, None)
        self.slow.pop(peer, None)

    def mark_silent(self, peer: str) -> None:
        """Remember that ``peer`` did not answer, with the version of the record it had: surveys skip it (no probe,
        no ``probe_timeout`` wait) until it publishes a newer record, e.g. after a restart."""
        version = self.versions.get(peer)
        if version is not None:
            self.silent[peer] = version

    def still_silent(self, rec: Any) -> bool:
        seen = self.silent.get(rec.peer_id)
        return seen is not None and (rec.seq, rec.expires_at) <= seen

    def mark_slow(self, peer: str, probe_s: float) -> None:
        """``peer``'s probe timed out: surveys skip it for :data:`SLOW_RETRY_S`, twice as long after each further
        time-out in a row (a machine that died without a word costs a probe's wait ever more rarely until its
        record expires)."""
        before = self.slow.get(peer)
        backoff = SLOW_RETRY_S if before is None else min(2 * before[1], SLOW_RETRY_MAX_S)
        self.slow[peer] = (trio.current_time() + backoff, backoff)
        log.info("peer %s did not answer its probe within %.1f s: skipped for %.0f s", peer, probe_s, backoff)

    def still_slow(self, peer: str) -> bool:
        late = self.slow.get(peer)
        return late is not None and trio.current_time() < late[0]

    @property
    def late_peers(self) -> int:  # how many peers are skipped for now because their last probe was late
        return sum(map(self.still_slow, self.slow))


@dataclass
class ProbeRound:
    """The probes of one survey: the answers so far (``offers``) and how many probes are still out (``left``)."""

    left: int
    offers: list[RouteCandidate] = field(default_factory=list)
    settled: bool = False  # the survey returned: later answers join it
    _changed: trio.Event = field(default_factory=trio.Event)

    def ended(self) -> None:
        """One probe ended (answered or not)."""
        self.left -= 1
        self._changed.set()

    def sorted(self) -> list[RouteCandidate]:
        return sorted(self.offers, key=lambda o: (o.start, o.end, o.peer_id))

    async def settle(self, depth: int, *, wait_all: bool) -> float | None:
        """Return once every probe ended or, unless ``wait_all``, once the answers chain layers 0 to ``depth``
        (:func:`covers`) and :data:`SETTLE_MIN_S` or :data:`SETTLE_FACTOR` x the slowest answer more went by
        (a dead peer's probe would hold the survey up for its whole time-out); that grace when it ran out."""
        grace: float | None = None
        with trio.CancelScope() as scope:
            while self.left:
                if grace is None and not wait_all and covers(self.offers, depth):
                    grace = max(SETTLE_MIN_S, SETTLE_FACTOR * max(o.rtt or 0.0 for o in self.offers))
                    scope.deadline = trio.current_time() + grace
                self._changed = trio.Event()
                await self._changed.wait()
        self.settled = True
        return grace if scope.cancelled_caught else None


async def probe_peer(pool: Any, rec: Any, offers: list[RouteCandidate], facts: Any, probes: ProbeMemory,
                     model_id: str, probe_s: float) -> None:
    """Ask ``rec``'s peer over its stage stream for its figures and the round trip, within ``probe_s`` (a late
    peer's :data:`SLOW_PROBE_FACTOR` x that); an answer goes into ``offers``, a refusal or failure marks it silent,
    a time-out slow."""
    facts.contacted.add(rec.peer_id)
    with trio.move_on_after(probe_s * (SLOW_PROBE_FACTOR if rec.peer_id in probes.slow else 1.0)):
        try:
            link = await pool.get(rec.peer_id, tuple(rec.addrs))
            info, rtt = await link.probe()
        except SangamaError as exc:
            log.info("peer %s does not answer: %s", rec.peer_id, exc)
            probes.mark_silent(rec.peer_id)
            return
        if info.model_id != model_id or info.peer != rec.peer_id:
            return
        offers.append(RouteCandidate(rec.peer_id, info.start, info.end, info.throughput, info.queue,
                                     info.free_sessions, rtt, tuple(rec.addrs), rec.fingerprint, rec.num_layers,
                                     rec.layer_hashes, rec.links, link.fs.source))
        probes.answered(rec.peer_id)
        return
    probes.mark_slow(rec.peer_id, probe_s)  # alive maybe (a busy machine), only late: asked again later
