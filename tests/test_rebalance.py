"""placement/rebalance.py: when an auto-placed peer moves, and where to (pure), and the Rebalancer's two looks."""

from __future__ import annotations

import itertools
import random

import pytest
import trio

from sangama_p2p.placement.rebalance import choose_move, first_mover, layer_counts, thinnest_range
from sangama_p2p.stage.rebalance import Rebalancer


def test_the_spare_moves_into_the_gap_the_only_peer_of_a_range_left() -> None:
    # four auto peers on the tiny model: 0:3, 3:6, 6:8 and a spare on 0:3; the 3:6 peer is killed
    assert choose_move([(0, 3), (6, 8)], (0, 3), 8, 3) == (3, 6)
    # the 0:3 peer (not the spare) sees the same: either of them may go, the other keeps 0:3
    assert choose_move([(0, 3), (6, 8)], (0, 3), 8, 3, margin=None) == (3, 6)


def test_never_opens_a_gap_to_close_one() -> None:
    assert choose_move([(3, 6), (6, 8)], (0, 3), 8, 3) is None  # we are 0:3's only peer
    assert choose_move([(0, 2), (6, 8)], (0, 3), 8, 3) is None  # layer 2 is ours alone
    assert choose_move([(0, 8)], (0, 3), 8, 3) is None  # nothing missing, and 0:3 is not over-served


def test_the_gap_is_filled_from_its_start_within_the_span() -> None:
    assert choose_move([(0, 4), (0, 4), (7, 8)], (0, 4), 8, 4) == (4, 7)  # up to the next stage, not past it
    assert choose_move([(0, 2), (0, 2)], (0, 2), 8, 2) == (2, 4)  # a long gap: its first span
    assert choose_move([(0, 3), (0, 3), (6, 8)], (0, 3), 8, 8) == (3, 6)  # a wide span still stops at the gap
    assert choose_move([(0, 3), (0, 3)], (0, 3), 8, 3) == (3, 6)  # two gaps: the first


def test_a_spare_of_a_well_served_range_moves_to_the_thinnest_only_by_a_margin() -> None:
    full = [(0, 3), (3, 6), (6, 8)]
    assert choose_move(full + [(0, 3)], (0, 3), 8, 3) is None  # the usual spare: 2 on 0:3, 1 elsewhere
    assert choose_move(full + [(0, 3), (0, 3)], (0, 3), 8, 3) == (3, 6)  # a fourth on 0:3, one on 3:6
    assert choose_move(full + [(0, 3), (0, 3)], (0, 3), 8, 3, margin=None) is None  # only gaps move it
    assert choose_move(full + [(0, 3), (0, 3), (3, 6)], (0, 3), 8, 3) == (6, 8)  # 6:8 is the thinnest now


def test_deterministic_and_never_swings_back() -> None:
    # every small swarm on 6 layers: the answer is the same twice, and a peer that moved does not want to move back
    ranges = [(a, b) for a in range(6) for b in range(a + 1, 7)]
    rng = random.Random(5)
    for _ in range(3000):
        others = rng.sample(ranges, rng.randint(0, 5))
        mine = rng.choice(ranges)
        span = rng.randint(1, 6)
        target = choose_move(others, mine, 6, span)
        assert target == choose_move(list(others), mine, 6, span)
        if target is None:
            continue
        before, after = layer_counts(others + [mine], 6), layer_counts(others + [target], 6)
        assert all(before[i] == 0 or after[i] > 0 for i in range(6))  # no layer loses its last peer
        assert after.count(0) <= before.count(0)
        if 0 in layer_counts(others, 6):
            assert after.count(0) < before.count(0)  # a gap move closes part of a gap
        assert target[1] - target[0] <= span
        assert choose_move(others, target, 6, span) in (None,) or 0 in after  # stable once moved (no gap left)


def test_many_spares_after_a_death_end_with_every_layer_served() -> None:
    # peers move one at a time (the confirm delay orders them): the swarm ends served and still
    for survivors in itertools.permutations([(0, 3), (0, 3), (0, 3), (6, 8)]):
        swarm = list(survivors)
        for _ in range(8):
            moved = False
            for i, mine in enumerate(swarm):
                target = choose_move(swarm[:i] + swarm[i + 1:], mine, 8, 3)
                if target is not None:
                    swarm[i], moved = target, True
                    break
            if not moved:
                break
        assert 0 not in layer_counts(swarm, 8)
        assert sorted(swarm).count((3, 6)) == 1


def test_thinnest_range_is_what_join_auto_takes_and_bad_inputs_raise() -> None:
    assert thinnest_range([], 8, 3) == (0, 3)
    assert thinnest_range([(0, 3), (3, 6), (6, 8), (0, 3)], 8, 3) == (3, 6)
    with pytest.raises(ValueError):
        thinnest_range([], 0, 1)
    with pytest.raises(ValueError):
        choose_move([], (0, 3), 8, 9)
    with pytest.raises(ValueError):
        choose_move([], (5, 9), 8, 3)


def test_of_two_spares_that_see_one_gap_the_lower_peer_id_goes_first() -> None:
    assert first_mover("a", (0, 3), {"b": (0, 3), "c": (6, 8)}, 8, 3)
    assert not first_mover("b", (0, 3), {"a": (0, 3), "c": (6, 8)}, 8, 3)
    assert first_mover("c", (6, 8), {"a": (0, 3), "b": (0, 3)}, 8, 3)  # c does not move at all
    # a peer with a lower id that cannot make the move (the only one of 6:8) does not hold us back
    assert first_mover("b", (0, 3), {"a": (6, 8), "c": (0, 3)}, 8, 3)
    # ... but one that can, from another range (6:8 has a second peer), does
    assert not first_mover("b", (0, 3), {"a": (6, 8), "c": (0, 3), "d": (6, 8)}, 8, 3)


class _Node:
    class _Id:
        def to_base58(self) -> str:
            return "me"

    peer_id = _Id()


def test_rebalancer_moves_only_when_the_second_look_agrees() -> None:
    looks: list[dict[str, tuple[int, int]]] = []
    moved: list[tuple[int, int]] = []
    mine = [(0, 3)]

    async def move(start: int, end: int) -> None:
        mine[0] = (start, end)
        moved.append((start, end))

    async def main() -> None:
        reb = Rebalancer(_Node(), "m", "fp", num_layers=8, span=3, current=lambda: mine[0], move=move,
                         confirm_s=0.01, rng=random.Random(1))

        async def live() -> dict[str, tuple[int, int]]:
            return looks.pop(0)

        reb.live_ranges = live  # type: ignore[method-assign]
        gap = {"x": (0, 3), "z": (6, 8)}
        looks.extend([gap, {**gap, "y": (3, 6)}])  # another spare filled 3:6 meanwhile
        assert await reb.step() is None and not moved
        looks.extend([gap, gap])
        m = await reb.step()
        assert m is not None and (m.old, m.new, m.reason) == ((0, 3), (3, 6), "gap") and moved == [(3, 6)]
        looks.append(gap)
        assert await reb.step() is None and not looks  # now the only peer of 3:6: stays, one look
        assert reb.report()["moves"] == 1 and reb.report()["last"]["to"] == "3:6"
        # a peer with a lower id ("a" < "me") would make the same move: hold back twice, then go anyway
        mine[0] = (0, 3)
        low = {"a": (0, 3), "z": (6, 8)}
        looks.extend([low, low])
        assert await reb.step() is None and await reb.step() is None and len(looks) == 0 and len(moved) == 1
        looks.extend([low, low])
        assert await reb.step() is not None and moved[-1] == (3, 6)

    trio.run(main)
