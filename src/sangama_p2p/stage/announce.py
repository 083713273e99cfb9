"""Keeps a stage's DHT record current: layer range, measured throughput, free sessions, checkpoint identity, addresses.

The record is published when the server starts, re-published by :class:`~sangama_p2p.net.discovery.Announcer`
before it expires, and refreshed every ``StageConfig.announce_every`` seconds when the figures moved (throughput by
more than 25 %, free sessions by a quarter or to or from none), so routing clients see a stage's real load without
flooding the DHT; and at once when :meth:`StageAnnouncer.publish_soon` is called (the peer calls it when its
reachability or relay reservations change, so the record's ``/p2p-circuit`` addresses are never a minute late).
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ..errors import NetworkError, StageError
from ..net.discovery import Announcer, ServingOffer

__all__ = ["StageAnnouncer"]

log = logging.getLogger(__name__)


class StageAnnouncer:
    """Publishes the server's offer and refreshes it as its measured figures change."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.announcer = Announcer(server.node)
        self.offer: ServingOffer | None = None
        self._soon = trio.Event()
        self._withdrawn = False

    def publish_soon(self) -> None:
        """Re-publish at once from :meth:`run` (our reachability or circuit addresses changed)."""
        self._soon.set()

    def published_addrs(self) -> tuple[str, ...]:
        """The addresses in the record last signed and sent to the DHT (empty before the first)."""
        signed = self.announcer.signed.get(self.server.config.model_id)
        return signed.record.addrs if signed is not None else ()

    def current(self) -> ServingOffer:
        s = self.server
        ident = s.identity
        if ident is None:
            raise StageError("a stage announces its checkpoint's fingerprint: build it with StageServer.load, or pass "
                             "identity= (model.fingerprint.stage_identity)")
        return ServingOffer(s.config.model_id, s.model.start, s.model.end, throughput=round(float(s.throughput), 3),
                     free_sessions=int(s.free_sessions), ttl=s.config.record_ttl, fingerprint=ident.fingerprint,
                     num_layers=ident.num_layers, layer_hashes=tuple(ident.layer_hashes),
                     links=s.link_meter.snapshot())

    def changed(self, offer: ServingOffer) -> bool:
        """Whether ``offer``'s figures moved enough to publish: throughput by more than 25 %, free sessions by a
        quarter (or to or from none). Clients read the exact load from a probe; every publication costs the swarm
        ~40 KAD streams, and a stage republished on each session opened or closed (issue 25)."""
        old = self.offer
        if old is None:
            return True
        if (old.free_sessions == 0) != (offer.free_sessions == 0):
            return True
        if abs(old.free_sessions - offer.free_sessions) >= max(1, old.free_sessions // 4):
            return True
        base = max(old.throughput, 1e-9)
        return abs(offer.throughput - old.throughput) / base > 0.25

    async def publish(self) -> None:
        if self._withdrawn:
            return
        offer = self.current()
        try:
            await self.announcer.update(offer)
            self.offer = offer
        except NetworkError as exc:
            log.warning("publishing the stage record failed: %s", exc)

    def withdraw(self) -> None:
        """Stop publishing for good (the stage closes or retires): the record expires after its TTL unless a newer
        one, e.g. the successor stage's of the same peer, replaces it first."""
        self._withdrawn = True
        self.announcer.withdraw(self.server.config.model_id)

    async def run(self) -> None:
        """Re-publish before expiry (in the background) and whenever the figures moved."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.announcer.run)
            while True:
                with trio.move_on_after(self.server.config.announce_every):
                    await self._soon.wait()
                forced, self._soon = self._soon.is_set(), trio.Event()
                offer = self.current()
                if forced or self.changed(offer):
                    await self.publish()
