"""The dashboard's view of the swarm, refreshed in a background task: survey, ask the stages for their load, build.

:class:`SwarmWatch` owns no host: it is given a node (the CLI opens one with a throwaway identity, as ``status``
does). :meth:`SwarmWatch.run` surveys every ``refresh_s`` seconds (:func:`sangama_p2p.net.status.survey`), asks each
serving peer ``/sangama/info/2`` for its queue and free sessions, and builds the page's JSON
(:func:`.view.build_view`); :meth:`SwarmWatch.updates` yields each new state to a server-sent event stream.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import Any

import trio

from ..errors import SangamaError
from ..net.status import fetch_info, survey
from .view import Seen, build_view, recent_generations

__all__ = ["SwarmWatch"]

log = logging.getLogger(__name__)


class SwarmWatch:
    """The latest state of the swarm as the page shows it, and the counters of the surveys that built it."""

    def __init__(self, node: Any, *, models: Sequence[str] = (), refresh_s: float = 5.0, timeout: float = 5.0,
                 bans_path: Path | None = None, bootstrap_ids: frozenset[str] = frozenset(),
                 generations: Callable[[], list[dict[str, Any]]] | None = None) -> None:
        self.node = node
        self.models = tuple(models)
        self.refresh_s = refresh_s
        self.timeout = timeout
        self.bans_path = bans_path
        self.bootstrap_ids = bootstrap_ids
        self.generations = generations  # the recent generations of this process's client (the API's), if any
        self.view: dict[str, Any] = {"surveyed_at": None, "models": [], "peers": [], "others": [], "links": [],
                                     "bans": [], "counts": {"up": 0, "down": 0, "others": 0}}
        self.version = 0  # surveys finished (the view's version)
        self.failures = 0
        self.survey_s = 0.0  # how long the last survey took
        self.error: str | None = None
        self._seen: dict[str, Seen] = {}
        self._changed = trio.Event()

    def state(self) -> dict[str, Any]:
        return {**self.view, "version": self.version, "refresh_s": self.refresh_s,
                "survey_s": round(self.survey_s, 3), "error": self.error,
                "generations": None if self.generations is None else recent_generations(self.generations())}

    async def refresh(self) -> None:
        """One survey; the view changes only when it finished (a failed one keeps the last and says why)."""
        t0 = time.perf_counter()
        try:
            status = await survey(self.node, models=self.models, timeout=self.timeout)
            if self.bans_path is not None:
                status = status.with_bans(self.bans_path)
            infos: dict[str, dict[str, Any]] = {}

            async def one(pid: str) -> None:
                got = await fetch_info(self.node, pid, timeout=self.timeout)
                if got is not None:
                    infos[pid] = got

            async with trio.open_nursery() as nursery:
                for p in status.peers:
                    if p.records:
                        nursery.start_soon(one, p.peer_id)
            self.view, self._seen = build_view(status, self._seen, infos=infos, bootstrap_ids=self.bootstrap_ids)
            self.error = None
        except SangamaError as exc:
            self.failures += 1
            self.error = str(exc)
            log.warning("survey failed: %s", exc)
        self.survey_s = time.perf_counter() - t0
        self.version += 1
        self._changed.set()
        self._changed = trio.Event()

    async def run(self) -> None:
        """Refresh forever, one survey every ``refresh_s`` seconds (from start to start)."""
        while True:
            started = trio.current_time()
            await self.refresh()
            await trio.sleep_until(started + self.refresh_s)

    async def updates(self, *, keepalive_s: float = 15.0) -> AsyncIterator[str]:
        """Server-sent events: the current state at once, then each new one (a comment line keeps idle proxies
        from closing the stream)."""
        yield f"data: {json.dumps(self.state())}\n\n"
        while True:
            changed = self._changed
            with trio.move_on_after(keepalive_s) as scope:
                await changed.wait()
            yield ": keepalive\n\n" if scope.cancelled_caught else f"data: {json.dumps(self.state())}\n\n"
