"""Keeping relay reservations: refreshed before they expire, re-made the moment the relay connection closes.

A relay that restarts forgets every reservation; its old connections close. py-libp2p's refresher gives up on a closed
connection, and ours used to sleep for 3/4 of the reservation's hour after each grant without looking: a bootstrap/relay
restarted mid-generation left every NATed stage unreachable until the stages themselves were restarted (issue 27).
Now each kept relay has a task that

* reserves, then waits for the refresh time *or* for every connection the grant came over to close (network notifees,
  :mod:`.watch`), and then reserves again at once;
* after a failure drops the reservation (so that the peer stops advertising a circuit nobody can open: the
  traversal re-publishes its record), retries with a growing backoff (``retry_s`` doubling up to ``MAX_RETRY_S``),
  and tries again early when a connection to the relay opens (the bootstrap keeper, :mod:`.rejoin`, reconnects it);
* logs at INFO a reservation lost and regained, with how long it took.

:meth:`ReservationKeeper.keep_reservations` holds reservations on at least ``want`` relays of a list: while fewer are
held or being tried, the next relay of the list is kept as well (a stage keeps more than one where it can).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from .. import clock
from ..errors import NotARelayError, RelayError
from .watch import PeerWatch, open_connections

__all__ = ["MAX_RETRY_S", "ReservationKeeper", "Reserver"]

logger = logging.getLogger(__name__)

MAX_RETRY_S = 15.0  # the longest wait between two tries on a relay that refused or could not be reached

TRYING, HELD, FAILING = "trying", "held", "failing"


class Reserver(Protocol):
    """What the keeper needs of :class:`~.relay.RelayClient` (which owns the reservations)."""

    host: IHost

    async def reserve(self, relay: PeerInfo) -> Any:  # a Reservation (its ``expires_at``); RelayError if refused
        ...

    def forget(self, relay_id: str) -> bool:
        ...


class ReservationKeeper:
    """The keeping tasks of one :class:`~.relay.RelayClient` (which owns ``nursery`` and the reservations)."""

    def __init__(self, client: Reserver, nursery: trio.Nursery, watch: PeerWatch, *, refresh_fraction: float,
                 retry_s: float, on_change: Callable[[], None]) -> None:
        self._client = client
        self._nursery = nursery
        self._watch = watch
        self._refresh_fraction = refresh_fraction
        self._retry_s = retry_s
        self._on_change = on_change
        self._state: dict[str, str] = {}  # kept relay (id as a string) -> TRYING, HELD or FAILING
        self._candidates: list[PeerInfo] = []
        self._want = 0
        self.not_relays: set[str] = set()
        self.refreshes = 0
        self.regained = 0  # reservations re-made after they were lost (a relay restart, a dropped connection)

    # -- which relays --------------------------------------------------------------------------------------------
    def keep(self, relay: PeerInfo) -> None:
        """Hold a reservation on ``relay`` for as long as the client is open (see the module docstring).

        A peer that turns out not to be a relay (:class:`NotARelayError`) is given up on at once and listed in
        :attr:`not_relays`, until it is asked for again.
        """
        key = str(relay.peer_id)
        if key not in self._state:
            self._state[key] = TRYING
            self.not_relays.discard(key)
            self._nursery.start_soon(self._keep, relay)

    def keep_some(self, relays: Sequence[PeerInfo], want: int) -> None:
        """Hold reservations on at least ``want`` of ``relays``, preferring them in order: a relay that fails is kept
        trying, and the next one of the list is kept beside it until enough are held again."""
        self._candidates = list(relays)
        self._want = want
        for relay in self._candidates:
            self.not_relays.discard(str(relay.peer_id))  # asked again (every reachability re-check)
        self._top_up()

    def _top_up(self) -> None:
        live = sum(1 for state in self._state.values() if state != FAILING)
        for relay in self._candidates:
            if live >= self._want:
                return
            key = str(relay.peer_id)
            if key not in self._state and key not in self.not_relays:
                self.keep(relay)
                live += 1

    def _set(self, key: str, state: str | None) -> None:
        if state is None:
            self._state.pop(key, None)
        else:
            self._state[key] = state
        self._top_up()
        self._on_change()

    # -- one relay -----------------------------------------------------------------------------------------------
    async def _keep(self, relay: PeerInfo) -> None:
        key = str(relay.peer_id)
        retry = self._retry_s
        lost_at: float | None = None  # when a held reservation was found gone (monotonic)
        while True:
            try:
                reservation = await self._client.reserve(relay)
            except NotARelayError as exc:
                logger.info("%s; not reserving a slot on it", exc)
                self._client.forget(key)
                self.not_relays.add(key)
                self._set(key, None)
                return
            except RelayError as exc:
                dropped = self._client.forget(key)
                if dropped and lost_at is None:
                    lost_at = trio.current_time()
                if dropped or self._state.get(key) != FAILING:
                    logger.warning("%s; retrying in %.1f s, then with backoff", exc, retry)
                else:
                    logger.debug("%s; retrying in %.1f s", exc, retry)
                self._set(key, FAILING)
                await self._backoff(relay.peer_id, retry)
                retry = min(2 * retry, MAX_RETRY_S)  # a full or dead relay is not hammered
                continue
            if lost_at is not None:
                self.regained += 1
                logger.info("reservation on relay %s regained %.1f s after it was lost", relay.peer_id,
                            trio.current_time() - lost_at)
                lost_at = None
            elif self._state.get(key) == HELD:
                self.refreshes += 1
            retry = self._retry_s
            self._set(key, HELD)
            if await self._until_refresh_or_lost(relay.peer_id, reservation.expires_at - clock.wall()):
                lost_at = trio.current_time()
                logger.info("connection to relay %s closed: reserving again", relay.peer_id)

    async def _until_refresh_or_lost(self, relay_id: ID, lifetime: float) -> bool:
        """Wait until it is time to refresh (False), or until every connection to the relay that was open at the
        grant has closed (True: the relay may have restarted and forgotten us)."""
        host = self._client.host
        conns = open_connections(host, relay_id)
        deadline = trio.current_time() + max(0.5, lifetime * self._refresh_fraction)
        while True:
            changed = self._watch.changed(relay_id)
            if not any(not c.is_closed for c in conns):
                return True
            if trio.current_time() >= deadline:
                return False
            with trio.move_on_at(deadline):
                await changed.wait()

    async def _backoff(self, relay_id: ID, delay: float) -> None:
        """Sleep ``delay`` s, or less once a connection to the relay opens where there was none (someone reached it:
        it is back)."""
        host = self._client.host
        deadline = trio.current_time() + delay
        was_connected = bool(open_connections(host, relay_id))
        while trio.current_time() < deadline:
            changed = self._watch.changed(relay_id)
            if not was_connected and open_connections(host, relay_id):
                return
            with trio.move_on_at(deadline):
                await changed.wait()
            was_connected = was_connected and bool(open_connections(host, relay_id))
