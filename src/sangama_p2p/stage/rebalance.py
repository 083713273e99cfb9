"""``Rebalancer``: a peer that joined with ``--layers auto`` re-checks the swarm now and then and moves its stage.

Every ``every`` seconds (times a random factor in 0.75..1.25, so the peers of a swarm do not all look at once) it
lists the model's serving peers of its own checkpoint fingerprint from the range directories
(:func:`~sangama_p2p.net.discovery.find_serving_peers`), and asks peers over their stage streams for their live
ranges (``InfoRequest``; a few of a crowded range: :func:`live_ranges`, which ``--layers auto`` uses at join too):
a record outlives its peer by up to its TTL (180 s by default), so a peer that does not answer within
``probe_timeout`` counts as gone.
:func:`~sangama_p2p.placement.rebalance.choose_move` decides on the live ranges. When peers with lower ids would
make the same move (:func:`~sangama_p2p.placement.rebalance.first_mover`), it holds back for up to ``max_defer``
re-checks (one of them moves; a fixed-range peer never does, hence the bound). Then it waits a short random delay
(``confirm_s`` times 0.5..1.5: another spare may have moved), looks again, and moves only if the same answer comes
back; ``move(start, end)`` (the peer's) does the move. Each move is logged at INFO and kept in
:attr:`Rebalancer.moves` for status answers.

Usage (trio)::

    reb = Rebalancer(node, model_id, fingerprint, num_layers=8, span=3, current=lambda: (0, 3), move=peer_move)
    nursery.start_soon(reb.run)          # or: await reb.check() -> (3, 6) or None
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import trio

from ..errors import SangamaError
from ..net.directory import MAX_ENTRIES
from ..net.discovery import find_serving_peers
from ..net.lane import LaneDialer
from ..net.seam import Network
from ..net.stage_stream import open_stage_stream
from ..placement.rebalance import choose_move, first_mover
from ..wire.messages import InfoRequest, InfoResponse

__all__ = ["Move", "Rebalancer", "ask_ranges", "live_ranges"]

log = logging.getLogger(__name__)

PROBE_UP_TO = 3  # peers of a range asked what they serve now at each look (all of a range with no more)

Range = tuple[int, int]


@dataclass(frozen=True)
class Move:
    """One move of this peer's stage: from ``old`` to ``new`` (``(start, end)``), why (``gap``: a layer nobody
    served; ``spare``: the old range was well served, the new one thin), and when (trio clock seconds)."""

    old: Range
    new: Range
    reason: str
    at: float


async def ask_ranges(node: Network, records: Sequence[Any], model_id: str, timeout: float = 5.0,
                     lanes: LaneDialer | None = None) -> dict[str, Range]:
    """Peer id -> the range each of ``records``' peers says it serves now (``InfoRequest`` over its stage stream, all
    at once); a peer that does not answer within ``timeout`` is left out: a record outlives its peer by up to its
    TTL. Used by the rebalancer's looks and by ``--layers auto`` at join (a range whose only peer just left must look
    empty to a peer joining then)."""
    found: dict[str, Range] = {}
    lanes = lanes or LaneDialer(node, enabled=False)  # a probe is one frame each way: a libp2p stream will do

    async def probe(rec: Any) -> None:
        with trio.move_on_after(timeout):
            try:
                fs = await open_stage_stream(node, lanes, rec.peer_id, timeout=timeout, addrs=tuple(rec.addrs))
            except SangamaError as exc:
                log.debug("%s does not answer: %s", rec.peer_id, exc)
                return
            try:
                await fs.send(InfoRequest())
                info = await fs.recv()
            except (SangamaError, trio.BrokenResourceError) as exc:
                log.debug("%s did not say what it serves: %s", rec.peer_id, exc)
                return
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(1):
                    await fs.aclose()
            if (isinstance(info, InfoResponse) and info.peer == rec.peer_id and info.model_id == model_id
                    and 0 <= info.start < info.end):
                found[rec.peer_id] = (info.start, info.end)

    async with trio.open_nursery() as nursery:
        for rec in records:
            nursery.start_soon(probe, rec)
    return dict(sorted(found.items()))


async def live_ranges(node: Network, model_id: str, fingerprint: str | None, num_layers: int, *,
                      timeout: float = 5.0, lanes: LaneDialer | None = None,
                      rng: random.Random | None = None) -> tuple[dict[str, Range], list[Any]]:
    """Peer id -> the range each other peer of ``fingerprint`` serves, as it answers now, and the records they were
    found by: every peer of a range with at most :data:`PROBE_UP_TO` records (a leave there can open a gap),
    :data:`PROBE_UP_TO` drawn at random of a crowded range - whose other peers count as recorded if all of those
    answered, and are asked too if one did not (records of peers that left, or that never served: Sybils' records
    must not hide a gap).

    The records come from the range directories (one lookup per boundary, and per layer past a gap). A look costs
    dials per range, not per peer: every auto-placed peer looks every ~20 s and every ``--layers auto`` peer once as
    it joins, and probing every peer of a swarm of N made each look N dials (N x N a period, swarm-wide)."""
    rng = rng or random.Random()
    records = await find_serving_peers(node, model_id, include_self=False, fingerprint=fingerprint,
                                       per_range=MAX_ENTRIES, num_layers=num_layers)
    by_range: dict[Range, list[Any]] = {}
    for rec in records:
        by_range.setdefault((rec.start, rec.end), []).append(rec)
    drawn = {key: recs if len(recs) <= PROBE_UP_TO else rng.sample(recs, PROBE_UP_TO)
             for key, recs in by_range.items()}
    live = await ask_ranges(node, [rec for recs in drawn.values() for rec in recs], model_id, timeout, lanes)
    rest: list[Any] = []
    for key, recs in by_range.items():
        others = [rec for rec in recs if rec not in drawn[key]]
        if all(rec.peer_id in live for rec in drawn[key]):
            live.update((rec.peer_id, key) for rec in others)
        else:
            rest += others
    live.update(await ask_ranges(node, rest, model_id, timeout, lanes) if rest else {})
    return dict(sorted(live.items())), records


class Rebalancer:
    """Periodic re-checks of the swarm and moves of one auto-placed stage (see the module docstring)."""

    def __init__(self, node: Network, model_id: str, fingerprint: str, *, num_layers: int, span: int,
                 current: Callable[[], Range], move: Callable[[int, int], Awaitable[Any]], every: float = 20.0,
                 confirm_s: float = 2.0, probe_timeout: float = 5.0, margin: int | None = 2, max_defer: int = 2,
                 rng: random.Random | None = None) -> None:
        if every <= 0 or confirm_s < 0 or probe_timeout <= 0:
            raise ValueError("every and probe_timeout must be positive, confirm_s >= 0")
        self.node = node
        self.model_id = model_id
        self.fingerprint = fingerprint
        self.num_layers = num_layers
        self.span = span
        self.current = current
        self._move = move
        self.every = every
        self.confirm_s = confirm_s
        self.probe_timeout = probe_timeout
        self.margin = margin
        self.max_defer = max_defer
        self._deferred = 0  # re-checks in a row held back for a peer with a lower id
        self.rng = rng or random.Random()
        self.moves: list[Move] = []
        self.on_move: Callable[[Move], None] | None = None  # told of each move once it is done (join prints it)
        self._lanes = LaneDialer(node, enabled=False)  # a probe is one frame each way: a libp2p stream will do

    # ---- looking -------------------------------------------------------------------------------------------
    async def live_ranges(self) -> dict[str, Range]:
        """Peer id -> the range each other peer of our fingerprint serves, as it answers now (:func:`live_ranges`)."""
        live, _ = await live_ranges(self.node, self.model_id, self.fingerprint, self.num_layers,
                                    timeout=self.probe_timeout, lanes=self._lanes, rng=self.rng)
        return live

    async def check(self) -> Range | None:
        """The range to move to now, or None (one look at the swarm)."""
        return self._decide(await self.live_ranges())

    def _decide(self, others: dict[str, Range]) -> Range | None:
        return choose_move(list(others.values()), self.current(), self.num_layers, self.span, margin=self.margin)

    # ---- moving --------------------------------------------------------------------------------------------
    async def step(self) -> Move | None:
        """One re-check: look, and on a decision wait ``confirm_s`` (jittered), look again, move if it holds."""
        first = await self.live_ranges()
        target = self._decide(first)
        if target is None:
            self._deferred = 0
            return None
        me = self.node.peer_id.to_base58()
        if (self._deferred < self.max_defer and not first_mover(me, self.current(), first, self.num_layers,
                                                                 self.span, margin=self.margin)):
            self._deferred += 1
            log.debug("rebalance: a peer with a lower id would move to %s too: holding back (%d)", target,
                      self._deferred)
            return None
        await trio.sleep(self.confirm_s * self.rng.uniform(0.5, 1.5))
        others = list((await self.live_ranges()).values())
        old = self.current()
        again = choose_move(others, old, self.num_layers, self.span, margin=self.margin)
        if again != target:
            log.debug("rebalance: %s no longer holds after a second look (%s)", target, again)
            return None
        self._deferred = 0
        counts = [sum(a <= i < b for a, b in others) for i in range(self.num_layers)]
        reason = "gap" if 0 in counts else "spare"
        t0 = trio.current_time()
        await self._move(*target)
        move = Move(old, target, reason, trio.current_time())
        self.moves.append(move)
        what = (f"layers {counts.index(0)}.. were served by nobody" if reason == "gap"
                else "the old range is well served, the new one thin")
        log.info("rebalanced %s: moved from layers %d:%d to %d:%d in %.1f s (%s)", self.model_id, *old, *target,
                 move.at - t0, what)
        if self.on_move is not None:
            self.on_move(move)
        return move

    async def run(self) -> None:
        """Re-check forever (cancel to stop); a failed look or move is logged and tried again next time."""
        while True:
            await trio.sleep(self.every * self.rng.uniform(0.75, 1.25))
            try:
                await self.step()
            except SangamaError as exc:
                log.warning("rebalance check of %s failed: %s", self.model_id, exc)

    def report(self) -> dict[str, Any]:
        """Moves so far, for status answers: ``{"moves": n, "last": {"from", "to", "reason", "ago_s"}}``."""
        out: dict[str, Any] = {"moves": len(self.moves), "every_s": self.every}
        if self.moves:
            m = self.moves[-1]
            out["last"] = {"from": f"{m.old[0]}:{m.old[1]}", "to": f"{m.new[0]}:{m.new[1]}", "reason": m.reason,
                           "ago_s": round(trio.current_time() - m.at, 1)}
        return out
