"""Who may be dialled now: a backoff per peer that failed to answer, and a budget for dialling such peers again.

Pure (no I/O, an injected clock), so tests call it directly; :class:`~sangama_p2p.net.node.Node` consults it before
every dial, py-libp2p's own included (DHT lookups, identify, relays all dial through ``Node.connect``).

* A peer whose dial failed waits ``first_s`` (5 s), then twice as long after each further failure, up to ``max_s``
  (10 min). A connection to it, either way (we dialled it, or it dialled us), clears the entry; so does a serving
  record it signed after the failure (:meth:`DialBackoff.fresh_record`).
* Dials to peers that have failed before (retries) share a token bucket of ``retries_per_minute``: however many
  peers ever failed, at most that many retries a minute (plus a burst of as many) go out. Peers never dialled, or
  dialled with success, do not use it.
* At most ``max_peers`` entries are kept; beyond that the longest-failed peer is forgotten (it is dialled again only
  if something asks for it, as a new peer would be).

Why: py-libp2p keeps every peer that ever connected in its peerstore, and its lookups, auto-connector and
routing-table refresh dialled departed clients again and again; on one stage's NAT the SYNs grew from 66 to 808 a
minute in 10 minutes of client churn (issue 27). Explicit dials that the user drives (a configured bootstrap
address, a client chaining a stage from a live serving record) skip the check: see ``Node.connect``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

from ..clock import wall
from ..errors import NetworkError

__all__ = ["BackoffPolicy", "DialBackoff"]


@dataclass(frozen=True)
class BackoffPolicy:
    """Seconds a failed peer waits (``first_s`` doubling to ``max_s``), retries a minute, peers remembered."""

    first_s: float = 5.0
    max_s: float = 600.0
    retries_per_minute: float = 30.0
    max_peers: int = 4096

    def __post_init__(self) -> None:
        if not 0 < self.first_s <= self.max_s or self.retries_per_minute <= 0 or self.max_peers < 1:
            raise NetworkError("backoff policy: need 0 < first_s <= max_s, retries_per_minute > 0, max_peers >= 1")


@dataclass
class _Failed:
    failures: int
    failed_at: float  # clock time of the last failure
    until: float  # clock time before which the peer is not dialled


class DialBackoff:
    """The backoff table of one node. ``clock``: seconds (``clock.wall`` by default: records' times are wall-clock)."""

    def __init__(self, policy: BackoffPolicy = BackoffPolicy(), clock: Callable[[], float] = wall) -> None:
        self.policy = policy
        self._clock = clock
        self._failed: dict[Hashable, _Failed] = {}
        self._tokens = float(policy.retries_per_minute)
        self._refilled = clock()
        self.refused = 0  # dials refused so far (backoff or budget), for logs and tests

    def __len__(self) -> int:
        return len(self._failed)

    def __contains__(self, peer: Hashable) -> bool:
        return peer in self._failed

    def wait_s(self, peer: Hashable) -> float:
        """Seconds before ``peer`` may be dialled by its own backoff (0: now, or never failed); no side effect."""
        entry = self._failed.get(peer)
        return 0.0 if entry is None else max(0.0, entry.until - self._clock())

    def failures(self, peer: Hashable) -> int:
        entry = self._failed.get(peer)
        return 0 if entry is None else entry.failures

    def admit(self, peer: Hashable) -> float:
        """0 if ``peer`` may be dialled now (a retry takes a token from the budget), else the seconds to wait."""
        entry = self._failed.get(peer)
        if entry is None:
            return 0.0
        now = self._clock()
        if now < entry.until:
            self.refused += 1
            return entry.until - now
        rate = self.policy.retries_per_minute / 60.0
        self._tokens = min(self.policy.retries_per_minute, self._tokens + (now - self._refilled) * rate)
        self._refilled = now
        if self._tokens < 1.0:
            self.refused += 1
            return (1.0 - self._tokens) / rate
        self._tokens -= 1.0
        return 0.0

    def failed(self, peer: Hashable) -> float:
        """Record a failed dial of ``peer``; the seconds it now waits."""
        now = self._clock()
        entry = self._failed.pop(peer, None)  # re-inserted last: the dict stays ordered by failure time
        failures = 1 if entry is None else entry.failures + 1
        wait = min(self.policy.first_s * 2.0 ** (failures - 1), self.policy.max_s)
        self._failed[peer] = _Failed(failures, now, now + wait)
        while len(self._failed) > self.policy.max_peers:
            del self._failed[next(iter(self._failed))]
        return wait

    def succeeded(self, peer: Hashable) -> None:
        """A connection to ``peer`` exists (dialled or accepted): forget its failures."""
        self._failed.pop(peer, None)

    def fresh_record(self, peer: Hashable, signed_at: float) -> bool:
        """``peer`` signed a record at ``signed_at`` (clock time): if that is after its last failure, it is back, and
        its failures are forgotten. True if an entry was cleared."""
        entry = self._failed.get(peer)
        if entry is None or signed_at <= entry.failed_at:
            return False
        del self._failed[peer]
        return True
