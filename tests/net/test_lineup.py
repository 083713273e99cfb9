"""Choosing the peers of one checkpoint among the offers of a model id (net.lineup, pure)."""

from __future__ import annotations

from dataclasses import dataclass

from sangama_p2p.net.lineup import choose_lineup, covers

A, B, C = "aa" * 16, "bb" * 16, "cc" * 16


@dataclass(frozen=True)
class O:
    peer_id: str
    start: int
    end: int
    fingerprint: str = A
    num_layers: int = 8
    throughput: float = 1.0
    layer_hashes: tuple[tuple[str, str], ...] = ()


def ids(items) -> list[str]:
    return [o.peer_id for o in items]


def test_covers_joins_ranges_end_to_start():
    assert covers([(0, 4), (4, 8)], 8)
    assert covers([(0, 2), (0, 4), (2, 8)], 8)
    assert not covers([(0, 4), (5, 8)], 8)
    assert not covers([(0, 4), (4, 9)], 8)
    assert not covers([], 8)


def test_one_checkpoint_is_chained_whole():
    lineup = choose_lineup([O("p1", 0, 4), O("p2", 4, 8)])
    assert (lineup.fingerprint, lineup.num_layers, ids(lineup.members), lineup.left_out) == (A, 8, ["p1", "p2"], ())


def test_a_range_beyond_the_checkpoints_depth_is_ignored_and_does_not_set_the_depth():
    liar = O("liar", 7, 1_000_000)
    lineup = choose_lineup([O("p1", 0, 4), O("p2", 4, 8), liar])
    assert lineup.num_layers == 8 and ids(lineup.members) == ["p1", "p2"]
    (out,) = lineup.left_out
    assert out.peer_id == "liar" and "beyond its checkpoint's 8 layers" in out.reason


def test_a_depth_that_disagrees_with_its_fingerprint_group_is_left_out():
    lineup = choose_lineup([O("p1", 0, 4), O("p2", 4, 8), O("p3", 0, 4), O("odd", 4, 1000, num_layers=1000)])
    assert lineup.num_layers == 8 and ids(lineup.members) == ["p1", "p3", "p2"]
    (out,) = lineup.left_out
    assert out.peer_id == "odd" and "announce 8" in out.reason


def test_the_group_that_covers_the_model_wins_over_a_bigger_one_that_does_not():
    offers = [O("a1", 0, 4), O("a2", 4, 8),
              O("b1", 0, 2, B), O("b2", 2, 4, B), O("b3", 0, 4, B)]  # three peers, but nobody serves 4:8
    lineup = choose_lineup(offers)
    assert lineup.fingerprint == A and ids(lineup.members) == ["a1", "a2"]
    assert {o.peer_id for o in lineup.left_out} == {"b1", "b2", "b3"}
    assert all("another checkpoint" in o.reason and "bbbbbbbbbbbb" in o.reason for o in lineup.left_out)


def test_among_covering_groups_most_peers_then_throughput_then_fingerprint():
    a = [O("a1", 0, 8)]
    b = [O("b1", 0, 4, B), O("b2", 4, 8, B)]
    assert choose_lineup(a + b).fingerprint == B
    fast = [O("c1", 0, 8, C, throughput=50.0)]
    assert choose_lineup(a + fast).fingerprint == C
    assert choose_lineup([O("c1", 0, 8, C), O("a1", 0, 8, A)]).fingerprint == A  # a tie: the smallest


def test_a_local_checkpoint_or_a_configured_depth_decides():
    offers = [O("a1", 0, 4), O("a2", 4, 8), O("b1", 0, 8, B), O("b2", 0, 8, B), O("c1", 0, 6, C, num_layers=6)]
    mine = choose_lineup(offers, local_fingerprint=A)
    assert mine.fingerprint == A and ids(mine.members) == ["a1", "a2"]
    assert all("differs from the local checkpoint" in o.reason for o in mine.left_out)
    none = choose_lineup(offers, local_fingerprint="dd" * 16)
    assert none.fingerprint is None and none.num_layers == 0 and len(none.left_out) == 5
    six = choose_lineup(offers, num_layers=6)
    assert six.fingerprint == C and six.num_layers == 6


def test_the_clients_depth_is_never_outvoted_by_records_claiming_another():
    # issue 26: four records under the honest fingerprint claiming 1,000,000 layers excluded every honest peer
    liars = [O(f"x{i}", 0, 1_000_000, num_layers=1_000_000) for i in range(4)]
    honest = [O("h1", 0, 4), O("h2", 4, 8), O("h3", 0, 8)]
    voted = choose_lineup([*liars, *honest], local_fingerprint=A)
    assert voted.num_layers == 1_000_000  # without a depth of its own, the client can only count
    pinned = choose_lineup([*liars, *honest], local_fingerprint=A, num_layers=8)
    assert pinned.num_layers == 8 and ids(pinned.members) == ["h1", "h3", "h2"]
    assert sorted(ids(pinned.left_out)) == ["x0", "x1", "x2", "x3"]
    assert all("the client's checkpoint has 8" in o.reason for o in pinned.left_out)


def test_peers_of_one_fingerprint_that_hold_a_part_with_other_bytes_are_reported():
    offers = [O("p1", 0, 4, layer_hashes=(("0", "11" * 16), ("1", "12" * 16))),
              O("p2", 0, 4, layer_hashes=(("0", "11" * 16), ("1", "99" * 16))),
              O("p3", 4, 8, layer_hashes=(("4", "14" * 16),))]
    lineup = choose_lineup(offers)
    (conflict,) = lineup.conflicts
    assert conflict.part == "1"
    assert dict(conflict.hashes) == {"12" * 16: ("p1",), "99" * 16: ("p2",)}
    assert ids(lineup.members) == ["p1", "p2", "p3"]  # reported, not judged: nothing here knows which is right
