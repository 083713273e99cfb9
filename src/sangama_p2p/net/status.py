"""A survey of the swarm for ``sangama-peer status``: peers, what they serve, and how we reach them.

Peers are found from the DHT (our routing table after random-key lookups, plus the providers of any model asked
for); each one is asked over ``/sangama/records/1`` for its signed records, which are validated like DHT records.
The survey is a pure data structure (:class:`SwarmStatus`) so the CLI can print it as a table or as JSON;
:meth:`SwarmStatus.lineups` sorts each model's records as a client would (:mod:`.lineup`): the peers a client
chains, and every other one with the reason it is left out. ``bans`` are this node's own (:mod:`.bans`: peers a
verifying client caught lying, with the reason); :meth:`SwarmStatus.with_bans` adds them, :func:`ban_lines` prints.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

import msgpack
import trio
from libp2p.peer.id import ID

from .. import clock
from ..errors import NetworkError, SangamaError
from .bans import Ban, load_bans
from .discovery import MAX_RESPONSE, fetch_records, find_serving_peers
from .holepunch import link_info
from .lineup import Lineup, choose_lineup
from .node import Node
from .records import ServingRecord

__all__ = ["PeerStatus", "SwarmStatus", "ban_lines", "fetch_info", "fetch_links", "fetch_records", "survey"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerStatus:
    """One peer as seen from here; ``link`` is ``direct``, ``relayed via <id>`` or ``unreachable``."""

    peer_id: str
    link: str
    rtt_ms: float | None
    records: tuple[ServingRecord, ...]
    error: str | None = None
    stage_links: tuple[dict[str, object], ...] = ()
    """The peer's own stage streams (``/sangama/links/1``): peer, dialled, ``direct`` / ``relayed via <id>``, moves."""
    traffic: dict[str, int] | None = None
    """Bytes of stage frames the peer sent and received, relayed and direct (None: it did not say)."""
    circuit_bytes: int | None = None
    """What the peer relayed for others (a relay node)."""
    rebalance: dict[str, Any] | None = None
    """The peer's stage moves, when it serves ``auto`` layers: ``moves``, ``every_s``, ``last`` (from, to, reason,
    ``ago_s``); None: it did not say."""


@dataclass(frozen=True)
class SwarmStatus:
    """Every peer found, sorted: serving peers by (model, first layer), then the others by id."""

    peers: tuple[PeerStatus, ...]
    surveyed_at: float
    bans: tuple[Ban, ...] = ()  # this node's local bans in force (never from the swarm)

    def with_bans(self, path: object) -> SwarmStatus:
        """The same status with the bans in force that the ban file ``path`` holds (none if it does not exist)."""
        from pathlib import Path

        p = Path(str(path)).expanduser()
        return replace(self, bans=tuple(load_bans(p, now=clock.wall())) if p.exists() else ())

    def models(self) -> dict[str, list[tuple[str, int, int]]]:
        """model id -> [(peer id, start, end)] sorted by start."""
        out: dict[str, list[tuple[str, int, int]]] = {}
        for peer in self.peers:
            for rec in peer.records:
                out.setdefault(rec.model_id, []).append((peer.peer_id, rec.start, rec.end))
        return {m: sorted(v, key=lambda x: (x[1], x[2])) for m, v in sorted(out.items())}

    def lineups(self) -> dict[str, Lineup[ServingRecord]]:
        """model id -> which peers a client (without a local checkpoint) would chain, and who is left out why."""
        by_model: dict[str, list[ServingRecord]] = {}
        for peer in self.peers:
            for rec in peer.records:
                by_model.setdefault(rec.model_id, []).append(rec)
        return {m: choose_lineup(recs) for m, recs in sorted(by_model.items())}

    def to_json(self) -> dict[str, object]:
        lineups = {m: {"fingerprint": ln.fingerprint, "num_layers": ln.num_layers,
                       "members": [r.peer_id for r in ln.members], "left_out": [asdict(o) for o in ln.left_out],
                       "conflicts": [asdict(c) for c in ln.conflicts]}
                   for m, ln in self.lineups().items()}
        return {"surveyed_at": self.surveyed_at, "peers": [asdict(p) for p in self.peers], "models": self.models(),
                "lineups": lineups, "bans": [asdict(b) for b in self.bans]}


def ban_lines(status: SwarmStatus, *, now: float | None = None) -> list[str]:
    """One plain-text line per local ban: the peer, whether it is in the swarm now, until when, and why."""
    now = clock.wall() if now is None else now
    present = {p.peer_id for p in status.peers}
    lines = []
    for b in status.bans:
        left = max(b.until - now, 0.0)
        where = "in the swarm now" if b.peer_id in present else "not seen now"
        model = f" for {b.model_id}" if b.model_id else ""
        lines.append(f"  banned {b.peer_id}{model} ({where}; {left / 3600:.1f} h left): {b.reason}")
    return lines


async def fetch_links(node: Node, peer_id: ID, *, timeout: float = 5.0) -> dict[str, Any]:
    """Ask ``peer_id`` how its stage streams run (``/sangama/links/1``); ``{}`` when it does not answer."""
    from .movable import LINKS_PROTOCOL

    with trio.move_on_after(timeout):
        try:
            stream = await node.host.new_stream(peer_id, [LINKS_PROTOCOL])
            chunks = []
            try:
                while chunk := await stream.read(65536):
                    chunks.append(chunk)
                    if sum(map(len, chunks)) > MAX_RESPONSE:
                        return {}
            except Exception:  # the end of the stream reads as an error on some muxers
                pass
            finally:
                await stream.close()
            body = msgpack.unpackb(b"".join(chunks), raw=False)
        except Exception as exc:  # an older peer, a client gone: no link report
            log.debug("%s gave no link report: %s", peer_id, exc)
            return {}
        return body if isinstance(body, dict) else {}
    return {}


async def fetch_info(node: Node, peer_id: str, *, timeout: float = 3.0) -> dict[str, Any] | None:
    """A stage's own figures over the info protocol (``throughput``, ``free_sessions``, ``queue``: fresher than its
    record), or None when it does not answer (the dashboard asks this of every serving peer)."""
    from ..wire.messages import InfoRequest, InfoResponse
    from ..wire.protocols import INFO_PROTOCOL
    from .streams import FramedStream

    with trio.move_on_after(timeout):
        try:
            stream = await node.host.new_stream(ID.from_base58(peer_id), [INFO_PROTOCOL])
        except Exception as exc:  # no handler, gone: the record's figures stand
            log.debug("%s gave no info: %s", peer_id, exc)
            return None
        fs = FramedStream(stream, max_frame=4096)
        try:
            await fs.send(InfoRequest())
            msg = await fs.recv()
        except (SangamaError, trio.BrokenResourceError) as exc:
            log.debug("info from %s failed: %s", peer_id, exc)
            return None
        finally:
            await fs.aclose()
        if isinstance(msg, InfoResponse) and msg.peer == peer_id:
            return {"throughput": msg.throughput, "free_sessions": msg.free_sessions, "queue": msg.queue}
    return None


def _small_dict(value: Any) -> dict[str, Any] | None:
    """A peer's ``rebalance`` report if it is a small dict of plain values (it came from the network)."""
    if not isinstance(value, dict) or len(value) > 8:
        return None
    ok = (str, int, float, bool, type(None))
    clean = {str(k): v for k, v in value.items() if isinstance(v, ok)}
    last = value.get("last")
    if isinstance(last, dict) and len(last) <= 8:
        clean["last"] = {str(k): v for k, v in last.items() if isinstance(v, ok)}
    return clean


async def survey(node: Node, *, models: Iterable[str] = (), timeout: float = 5.0) -> SwarmStatus:
    """Find the swarm's peers and ask each what it serves (concurrently, each bounded by ``timeout``)."""
    dht = node.dht
    if dht is None:
        raise NetworkError("a survey needs a DHT")
    peers: set[ID] = set(node.host.get_connected_peers())
    with trio.move_on_after(timeout):
        for _ in range(2):  # random walks fill the routing table beyond the bootstrap nodes' neighbours
            peers.update(await dht.peer_routing.find_closest_peers_network(os.urandom(32)))
    peers.update(dht.routing_table.get_peer_ids())
    for model in models:
        with trio.move_on_after(timeout):
            peers.update(ID.from_base58(r.peer_id) for r in await find_serving_peers(node, model, walk=False))
    peers.discard(node.peer_id)
    results: list[PeerStatus] = []

    async def one(peer: ID) -> None:
        records: list[ServingRecord] = []
        rtt: float | None = None
        error = None
        try:
            records, rtt = await fetch_records(node, peer, timeout=timeout)
        except NetworkError as exc:
            error = str(exc)
        links = await fetch_links(node, peer, timeout=timeout) if error is None else {}
        info = link_info(node.host, peer)
        link = str(info) if info is not None else "unreachable"
        results.append(PeerStatus(peer.to_base58(), link, rtt, tuple(records), error,
                                  tuple(links.get("streams", ())), links.get("traffic"), links.get("circuit_bytes"),
                                  _small_dict(links.get("rebalance"))))

    async with trio.open_nursery() as nursery:
        for peer in peers:
            nursery.start_soon(one, peer)

    def order(p: PeerStatus) -> tuple[int, str, int, str]:
        if p.records:
            first = min(p.records, key=lambda r: (r.model_id, r.start))
            return (0, first.model_id, first.start, p.peer_id)
        return (1, "", 0, p.peer_id)

    return SwarmStatus(tuple(sorted(results, key=order)), clock.wall())
