"""The dashboard's view (pure) and its swarm metrics: coverage, gaps, reachability, links, down peers, bans."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sangama_p2p.dashboard.metrics import swarm_registry
from sangama_p2p.dashboard.view import build_view, coverage, reach_kind
from sangama_p2p.net.bans import Ban
from sangama_p2p.net.records import ServingRecord
from sangama_p2p.net.status import PeerStatus, SwarmStatus

NOW = 1_000_000.0
FP = "ab" * 16


def rec(peer: str, start: int, end: int, *, reach: str = "direct", links=(), ttl: float = 180.0) -> ServingRecord:
    return ServingRecord("m", peer, start, end, 12.5, 3, ("/ip4/1.2.3.4/tcp/1",), reach, "0.1.0", NOW + ttl, 1,
                         FP, 8, (), tuple(links))


def peer(pid: str, *records: ServingRecord, link: str = "direct", error: str | None = None) -> PeerStatus:
    return PeerStatus(pid, link, 1.5 if error is None else None, records, error)


def test_coverage_counts_each_piece_and_leaves_gaps() -> None:
    segs = coverage([("A", 0, 3), ("B", 0, 5), ("C", 6, 8)], 8)
    assert [(s["start"], s["end"], s["count"]) for s in segs] == [(0, 3, 2), (3, 5, 1), (5, 6, 0), (6, 8, 1)]
    assert segs[0]["peers"] == ["…A", "…B"]


def test_reach_kinds() -> None:
    assert reach_kind("direct", "direct") == "public"
    assert reach_kind("QmRelay", "relayed via QmRelay") == "relayed"
    assert reach_kind("QmRelay", "direct") == "punched"


def test_a_peer_whose_probe_fails_is_down_and_no_longer_covers_until_its_record_expires() -> None:
    a = rec("PeerAAAAAAAA", 0, 4, links=[("PeerBBBBBBBB", 0.0021)])
    b = rec("PeerBBBBBBBB", 4, 8, reach="QmRelay")
    first, seen = build_view(SwarmStatus((peer(a.peer_id, a), peer(b.peer_id, b, link="relayed via QmRelay")), NOW),
                             {}, infos={a.peer_id: {"throughput": 20.0, "free_sessions": 2, "queue": 1}}, now=NOW)
    assert [(p["layers"], p["state"], p["reach"]) for p in first["peers"]] == [("0:4", "up", "public"),
                                                                               ("4:8", "up", "relayed")]
    assert (first["peers"][0]["steps_per_s"], first["peers"][0]["queue"]) == (20.0, 1)
    assert first["peers"][1]["queue"] is None  # no info answer: the record's figures, no queue
    assert first["models"][0]["gaps"] == [] and first["models"][0]["covered"] == 8
    assert first["links"] == [{"model": "m", "from": "…AAAAAAAA", "from_layers": "0:4", "to": "…BBBBBBBB",
                               "to_layers": "4:8", "rtt_ms": 2.1}]
    gone = SwarmStatus((peer(a.peer_id, a), peer(b.peer_id, error="did not answer within 2 s")), NOW + 5)
    second, seen = build_view(gone, seen, now=NOW + 5)
    assert [(p["layers"], p["state"]) for p in second["peers"]] == [("0:4", "up"), ("4:8", "down")]
    assert second["models"][0]["gaps"] == [[4, 8]] and second["counts"] == {"up": 1, "down": 1, "others": 0}
    third, seen = build_view(SwarmStatus((peer(a.peer_id, a),), NOW + 10), seen, now=NOW + 10)
    assert [p["state"] for p in third["peers"]] == ["up", "down"]  # left the survey: still down
    fourth, _ = build_view(SwarmStatus((peer(a.peer_id, a),), NOW + 200), seen, now=NOW + 200)
    assert [p["state"] for p in fourth["peers"]] == ["up"]  # its record expired: dropped


def test_bootstrap_nodes_and_bans() -> None:
    status = SwarmStatus((peer("Boot1111"),), NOW, bans=(Ban("Liar2222", "wrong tokens", NOW - 10, NOW + 7200, "m"),))
    view, _ = build_view(status, {}, now=NOW, bootstrap_ids=frozenset({"Boot1111"}))
    assert view["others"][0]["role"] == "bootstrap"
    assert view["bans"] == [{"peer": "…Liar2222", "id": "Liar2222", "model": "m", "reason": "wrong tokens",
                             "hours_left": 2.0, "present": False}]


def test_swarm_metrics_parse_and_follow_the_view() -> None:
    a = rec("PeerAAAAAAAA", 0, 4, links=[("PeerBBBBBBBB", 0.002)])
    view, _ = build_view(SwarmStatus((peer(a.peer_id, a),), NOW), {}, now=NOW)
    watch = SimpleNamespace(view=view, version=3, failures=1, survey_s=0.25)
    got = {s.name: s for f in text_string_to_metric_families(generate_latest(swarm_registry(watch)).decode())
           for s in f.samples}
    assert got["sangama_swarm_layers"].value == 8 and got["sangama_swarm_layers_covered"].value == 4
    assert got["sangama_swarm_layer_gaps"].value == 1
    assert got["sangama_swarm_stage_up"].labels["layers"] == "0:4"
    assert got["sangama_swarm_stage_steps_per_second"].value == 12.5
    assert got["sangama_swarm_link_rtt_seconds"].value == 0.002
    assert got["sangama_swarm_survey_seconds"].value == 0.25
