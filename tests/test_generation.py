"""The generation loop (``generation.py``), stepped by hand: pure, no torch, no transport.

The loop's answers here are what a last stage may answer (accepted guesses + one token, next guesses); the end-to-end
runs of the same loop are tests/model (LocalChain) and tests/client (the network)."""

from __future__ import annotations

from sangama_p2p.generation import Answer, Generation, GenerationLoop, GenerationResult, Trip


def _gen(prompt, max_new, stop=(), **kw):
    ticks = iter(range(100))
    return Generation(GenerationResult(list(prompt), []), max_new, stop, clock=lambda: float(next(ticks)), **kw)


def test_prefill_then_guesses_accepted_and_next_start():
    g = _gen([1, 2, 3], 10)
    t = g.next_trip()
    assert t == Trip(0, 0, 0, (1, 2, 3), 0, False)
    assert g.finish(t, Answer((7,), (8, 9))) == [7]
    t = g.next_trip()
    assert (t.number, t.start, t.tokens, t.n_guesses) == (1, 3, (7, 8, 9), 2)
    assert g.finish(t, Answer((8, 5), (6,))) == [8, 5]  # guess 8 kept, 9 rejected, 5 new
    t = g.next_trip()
    assert (t.start, t.tokens, t.n_guesses) == (5, (5, 6), 1)  # after 7, 8: positions 3, 4
    res = g.result
    assert res.tokens == [7, 8, 5] and res.steps == 1
    assert (res.guesses_proposed, res.guesses_accepted, res.accepted_at) == (2, 1, [1.0, 0.0])
    assert res.prefill_s == 1.0 and res.decode_s == 1.0  # clock: 0 at start, 1 first token, 2 second trip


def test_emission_stops_at_max_new_and_at_a_stop_token():
    g = _gen([1], 2)
    g.finish(g.next_trip(), Answer((4,), (5, 6)))
    assert g.finish(g.next_trip(), Answer((5, 6, 9))) == [5] and g.done and g.result.tokens == [4, 5]
    g = _gen([1], 10, stop=[5])
    g.finish(g.next_trip(), Answer((4,), (5, 6)))
    assert g.finish(g.next_trip(), Answer((5, 6, 9))) == [5] and g.done


def test_long_prefill_goes_in_chunks_and_replay_starts_over():
    g = _gen(range(10), 5, max_step_tokens=4)
    trips = []
    for _ in range(2):
        trips.append(g.next_trip())
        assert g.finish(trips[-1], Answer((0,))) == []  # a chunk's answer is not used
    assert [(t.start, len(t.tokens), t.chunk) for t in trips] == [(0, 4, True), (4, 4, True)]
    t = g.next_trip()
    assert (t.start, t.tokens, t.chunk) == (8, (8, 9), False)
    g.finish(t, Answer((42,), (43,)))
    t = g.next_trip()
    assert g.finish(t, None) == []  # the chain was replaced: everything seen so far again, from 0, in chunks
    t = g.next_trip()
    assert (t.number, t.start, t.tokens, t.n_guesses, t.chunk) == (4, 0, (0, 1, 2, 3), 0, True)
    assert g.result.steps == 2  # answered trips after the first; the lost one does not count


def test_loop_steps_requests_together_until_each_is_done():
    loop = GenerationLoop([_gen([1], 1, index=0), _gen([2, 3], 3, index=1)])
    assert [t.index for t in loop.trips()] == [0, 1]
    assert loop.finish([Answer((10,)), Answer((20,))]) == [(0, [10]), (1, [20])]
    trips = loop.trips()
    assert [(t.index, t.start) for t in trips] == [(1, 2)]  # request 0 is done
    assert loop.finish([Answer((21,))]) == [(1, [21])]
    assert len(loop.trips()) == 1
    loop.finish([Answer((22,))])
    assert loop.trips() == [] and loop.generations[1].result.tokens == [20, 21, 22]


def test_result_as_dict_local_and_network_keys():
    local = GenerationResult([1], [2, 3], text="x", steps=1, stages=[])
    assert list(local.as_dict()) == [
        "prompt_ids", "tokens", "text", "prefill_ms", "decode_ms", "decode_tokens_per_s", "steps", "tokens_per_step",
        "guesses_proposed", "guesses_accepted", "accepted_per_step", "acceptance_by_position", "stages"]
    net = GenerationResult([1], [2], route=["p"], time_summary=lambda trips: {"trips": len(trips)})
    assert list(net.as_dict()) == [
        "prompt_ids", "tokens", "route", "links", "failovers", "prefill_ms", "decode_ms", "decode_tokens_per_s", "steps",
        "guesses_proposed", "guesses_accepted", "where_the_time_goes"]
    assert net.as_dict()["where_the_time_goes"] == {"trips": 0}
