"""What the dashboard shows, as plain JSON, from one survey (:class:`~sangama_p2p.net.status.SwarmStatus`): pure.

:func:`build_view` turns a survey, the stages' own figures (``/sangama/info/2``: queue, free sessions) and what
earlier surveys saw into the page's state: per model its layer coverage (segments with how many peers serve them and
who; a segment nobody serves is a gap), one row per peer, the links between stages with the round trips the stages
measured (``ServingRecord.links``), rebalancing moves and this machine's bans.

A peer whose probe fails (killed, gone, unreachable) is **shown as down**, with the range it served, until the
record it last published would have expired; it no longer counts in the coverage. Then it is dropped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..net.records import ServingRecord
from ..net.status import PeerStatus, SwarmStatus

__all__ = ["Seen", "build_view", "coverage", "label", "reach_kind", "recent_generations"]


@dataclass(frozen=True)
class Seen:
    """A peer's records when its probe last worked, and when that was."""

    records: tuple[ServingRecord, ...]
    at: float

    @property
    def expires_at(self) -> float:
        return max((r.expires_at for r in self.records), default=self.at)


def label(peer_id: str) -> str:
    """A short name for a peer: its id's last 8 characters."""
    return "…" + peer_id[-8:]


def reach_kind(record_reach: str, link: str) -> str:
    """``public`` (it announces itself directly reachable), ``punched`` (behind NAT, yet we hold a direct link:
    a hole punch) or ``relayed`` (reached through a relay), from the record's reachability and our link."""
    if record_reach == "direct":
        return "public"
    return "punched" if link == "direct" else "relayed"


def recent_generations(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The page's rows of a client's recent generations (``client.stats.ClientStats.recent``, newest first): the
    route by short labels, and how many of its trips verification checked or could not."""
    return [{**g, "route": [label(p) for p in g.get("route", ())]} for g in items]


def coverage(spans: list[tuple[str, int, int]], depth: int) -> list[dict[str, Any]]:
    """Layers 0..depth cut where any span starts or ends: each piece with how many spans cover it and whose
    (``count`` 0: a gap)."""
    cuts = sorted({0, depth, *(min(max(s, 0), depth) for _, s, _ in spans), *(min(max(e, 0), depth) for _, _, e in spans)})
    out = []
    for a, b in zip(cuts, cuts[1:]):
        if a >= b:
            continue
        who = sorted({p for p, s, e in spans if s <= a and b <= e})
        out.append({"start": a, "end": b, "count": len([1 for _, s, e in spans if s <= a and b <= e]),
                    "peers": [label(p) for p in who]})
    return out


def _peer_row(peer: PeerStatus, rec: ServingRecord, info: dict[str, Any] | None, state: str) -> dict[str, Any]:
    moves = peer.rebalance or {}
    last = moves.get("last") if isinstance(moves.get("last"), dict) else None
    return {
        "id": peer.peer_id, "label": label(peer.peer_id), "state": state, "model": rec.model_id,
        "layers": f"{rec.start}:{rec.end}", "start": rec.start, "end": rec.end,
        "steps_per_s": round((info or {}).get("throughput", rec.throughput), 2),
        "free_sessions": (info or {}).get("free_sessions", rec.free_sessions),
        "queue": (info or {}).get("queue"),
        "reach": reach_kind(rec.reachability, peer.link) if state == "up" else "-",
        "link": peer.link, "rtt_ms": None if peer.rtt_ms is None else round(peer.rtt_ms, 2),
        "version": rec.version, "ttl_s": round(rec.ttl_left, 1),
        "moves": int(moves.get("moves") or 0),
        "last_move": f"{last.get('from')} -> {last.get('to')} ({last.get('reason')})" if last else None,
        "error": peer.error,
    }


def build_view(status: SwarmStatus, seen: dict[str, Seen], *, infos: dict[str, dict[str, Any]] | None = None,
               now: float | None = None, bootstrap_ids: frozenset[str] = frozenset()) -> tuple[dict[str, Any],
                                                                                                 dict[str, Seen]]:
    """The page's state and the updated memory of peers seen (pass it to the next call)."""
    now = time.time() if now is None else now
    infos = infos or {}
    seen = {p: s for p, s in seen.items() if s.expires_at > now}
    rows: list[dict[str, Any]] = []
    others: list[dict[str, Any]] = []
    live: list[ServingRecord] = []
    present = set()
    for peer in status.peers:
        present.add(peer.peer_id)
        if peer.records:
            seen[peer.peer_id] = Seen(peer.records, now)
            live.extend(peer.records)
            for rec in peer.records:
                rows.append(_peer_row(peer, rec, infos.get(peer.peer_id), "up"))
        elif peer.peer_id in seen:  # served before, its probe fails now: down
            for rec in seen[peer.peer_id].records:
                rows.append(_peer_row(peer, rec, None, "down"))
        else:
            role = "bootstrap" if peer.peer_id in bootstrap_ids else ("unreachable" if peer.error else "serves nothing")
            others.append({"id": peer.peer_id, "label": label(peer.peer_id), "role": role, "link": peer.link,
                           "rtt_ms": None if peer.rtt_ms is None else round(peer.rtt_ms, 2), "error": peer.error})
    for pid, s in seen.items():  # gone from the survey altogether (left the routing table): still down
        if pid not in present:
            gone = PeerStatus(pid, "unreachable", None, (), "not found in this survey")
            rows.extend(_peer_row(gone, rec, None, "down") for rec in s.records)
    lineups = status.lineups()
    models = []
    for model_id in sorted({r.model_id for r in live} | {r["model"] for r in rows}):
        recs = [r for r in live if r.model_id == model_id]
        ln = lineups.get(model_id)
        depth = (ln.num_layers if ln is not None and ln.num_layers else 0) or max(
            [r.num_layers for r in recs] + [r.end for r in recs] + [row["end"] for row in rows if row["model"] == model_id])
        segments = coverage([(r.peer_id, r.start, r.end) for r in recs], depth)
        models.append({"id": model_id, "num_layers": depth, "fingerprint": ln.fingerprint if ln else None,
                       "segments": segments, "gaps": [[s["start"], s["end"]] for s in segments if not s["count"]],
                       "covered": sum(s["end"] - s["start"] for s in segments if s["count"]),
                       "chained": [label(r.peer_id) for r in ln.members] if ln else [],
                       "left_out": [{"peer": label(o.peer_id), "layers": f"{o.start}:{o.end}", "reason": o.reason}
                                    for o in ln.left_out] if ln else []})
    by_peer = {(r.model_id, r.peer_id): r for r in live}
    links = []
    for rec in live:
        for to, rtt_s in rec.links:
            nxt = by_peer.get((rec.model_id, to))
            links.append({"model": rec.model_id, "from": label(rec.peer_id), "from_layers": f"{rec.start}:{rec.end}",
                          "to": label(to), "to_layers": f"{nxt.start}:{nxt.end}" if nxt else "?",
                          "rtt_ms": round(rtt_s * 1000, 2)})
    bans = [{"peer": label(b.peer_id), "id": b.peer_id, "model": b.model_id, "reason": b.reason,
             "hours_left": round(max(b.until - now, 0.0) / 3600, 1), "present": b.peer_id in present}
            for b in status.bans]
    rows.sort(key=lambda r: (r["model"], r["start"], r["end"], r["state"] != "up", r["id"]))
    view = {"surveyed_at": status.surveyed_at, "models": models, "peers": rows, "others": others, "links": links,
            "bans": bans, "counts": {"up": len({r["id"] for r in rows if r["state"] == "up"}),
                                     "down": len({r["id"] for r in rows if r["state"] == "down"}),
                                     "others": len(others)}}
    return view, seen
