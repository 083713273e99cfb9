"""A stage measures its links to the stages that can follow it, and publishes the round trips in its record.

Why: a client sees only its own round trips to each stage, and estimated a hop between stages p and q as
``(rtt_p + rtt_q) / 4``; two stages in one far city looked as far apart as two in opposite far cities, and the client
chained a next stage 80 ms away while one 2 ms away served the same range (issue 24). Only the stages can see the
link between them, so each one measures it: every ``measure_links_every`` seconds (with jitter) it looks up the
peers of its own checkpoint whose range starts where its own ends (the only peers it ever sends frames to), pings
up to ``max_measured_links`` of them over the very link its frames would take (``NextHops.ping``: a lane or a
libp2p stream, punched or relayed), and keeps the smallest of a few round trips (the link, not the queues). The
figures travel signed in the stage's record (``links``, docs/protocol.md), re-published when they change.

Measured pairwise rather than with network coordinates (Vivaldi): a stage has few possible successors (those of one
layer boundary), so measuring each costs a ping per successor a minute, is exact where it matters (the hops
chains take) and cannot be skewed by a peer lying about its own coordinates; the client still estimates the hops
nobody measured (a successor that joined since, or one beyond ``max_measured_links``).
"""

from __future__ import annotations

import logging
import random
from typing import Any

import trio

from ..errors import SangamaError

__all__ = ["LinkMeter", "links_changed"]

log = logging.getLogger(__name__)

PINGS = 3  # after a first one that may include the dial: the smallest of these is the link's round trip
PING_TIMEOUT = 5.0  # seconds for one ping (a dial included)
FIRST_DELAY = (1.0, 3.0)  # seconds before the first round: successors that start with us are in the DHT by then
SOON = 5.0  # seconds to the next round while no successor answered (one that starts after us is measured soon)


def links_changed(old: dict[str, float], new: dict[str, float], *, rel: float = 0.2, floor: float = 0.002) -> bool:
    """Whether the measured links moved enough to re-publish: another set of peers, or a round trip that moved by
    more than ``rel`` of itself and more than ``floor`` seconds (jitter of a millisecond is not news)."""
    if set(old) != set(new):
        return True
    return any(abs(new[p] - old[p]) > max(rel * old[p], floor) for p in new)


class LinkMeter:
    """Keeps ``rtts`` (peer id -> seconds) of the server's successors fresh; calls ``on_change`` when they moved."""

    def __init__(self, server: Any, on_change: Any = None) -> None:
        self.server = server
        self.on_change = on_change
        self.rtts: dict[str, float] = {}
        self.rounds = 0

    def snapshot(self) -> tuple[tuple[str, float], ...]:
        """The links to publish, sorted by peer id."""
        return tuple(sorted(self.rtts.items()))

    async def successors(self) -> list[str]:
        """The peers of our checkpoint whose range starts where ours ends (nobody follows the last stage)."""
        from ..net.walk import find_starting_at

        s = self.server
        ident = s.identity
        if ident is None or s.model.end >= ident.num_layers:
            return []
        records = await find_starting_at(s.node, s.config.model_id, s.model.end, fingerprint=ident.fingerprint,
                                         limit=s.config.max_measured_links, keep=self.rtts)  # one directory lookup
        return sorted({r.peer_id for r in records})

    async def measure(self, peer: str) -> float | None:
        """The smallest of ``PINGS`` round trips to ``peer`` after a first one (None: it did not answer)."""
        best = None
        try:
            for i in range(PINGS + 1):
                with trio.fail_after(PING_TIMEOUT):
                    rtt = await self.server.next_hops.ping(peer)
                if i > 0:  # the first one may include the dial, a punch or a lane's set-up
                    best = rtt if best is None else min(best, rtt)
        except (SangamaError, trio.TooSlowError) as exc:
            log.debug("measuring the link to %s: %s", peer, exc)
            return None
        return best

    async def round(self) -> dict[str, float]:
        """One round: look the successors up and measure each (concurrently); the new figures."""
        try:
            peers = await self.successors()
        except SangamaError as exc:
            log.debug("looking up the stages after ours: %s", exc)
            return dict(self.rtts)
        found: dict[str, float] = {}

        async def one(peer: str) -> None:
            rtt = await self.measure(peer)
            if rtt is not None:
                found[peer] = rtt

        async with trio.open_nursery() as nursery:
            for peer in peers:
                nursery.start_soon(one, peer)
        return found

    async def run(self) -> None:
        every = self.server.config.measure_links_every
        if every <= 0 or self.server.config.max_measured_links == 0:
            return
        await trio.sleep(random.uniform(*FIRST_DELAY))
        while True:
            new = await self.round()
            self.rounds += 1
            if links_changed(self.rtts, new):
                log.info("measured links: %s", ", ".join(f"{p[-6:]} {1000 * r:.1f} ms" for p, r in sorted(new.items()))
                         or "none")
                self.rtts = new
                if self.on_change is not None:
                    self.on_change()
            else:
                self.rtts = new
            last = self.server.identity is None or self.server.model.end >= self.server.identity.num_layers
            wait = every if new or last else min(every, SOON)
            await trio.sleep(wait * random.uniform(0.8, 1.2))
