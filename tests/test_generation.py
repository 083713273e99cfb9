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


def test_long_prefill_goes_in_chunks_and_a_failover_replays_every_trip_in_its_shape():
    g = _gen(range(10), 5, max_step_tokens=4)
    trips = []
    for _ in range(2):
        trips.append(g.next_trip())
        assert g.finish(trips[-1], Answer((0,))) == []  # a chunk's answer is not used
    assert [(t.start, len(t.tokens), t.chunk) for t in trips] == [(0, 4, True), (4, 4, True)]
    t = g.next_trip()
    assert (t.start, t.tokens, t.chunk) == (8, (8, 9), False)
    assert g.finish(t, Answer((42,), (43,))) == [42]
    trips.append(t)
    lost = g.next_trip()
    assert (lost.start, lost.tokens, lost.n_guesses) == (10, (42, 43), 1)
    assert g.finish(lost, None) == []  # the chain was replaced
    replayed = []
    for original in trips:  # the same positions, tokens, guesses and chunks as sent the first time
        t = g.next_trip()
        assert t.replay and (t.start, t.tokens, t.n_guesses, t.chunk) == (original.start, original.tokens,
                                                                          original.n_guesses, original.chunk)
        replayed.append(t)
        assert g.finish(t, Answer((0,)) if t.chunk else Answer((42,), (43,))) == []  # nothing emitted twice
    again = g.next_trip()  # then the trip that failed, as it was
    assert not again.replay and (again.start, again.tokens, again.n_guesses) == (10, (42, 43), 1)
    assert again.number == lost.number + 1 + len(trips)  # wire step numbers only grow
    assert g.result.steps == 2 and g.result.replayed_trips == 3 and g.result.replay_diverged is None
    assert g.finish(again, Answer((43, 7))) == [43, 7] and g.result.tokens == [42, 43, 7]
    assert "uninterrupted run" in GenerationResult([1], [2], failovers=1, replayed_trips=3).failover_note()


def test_a_failover_during_a_replay_replays_again_and_a_different_answer_is_reported():
    g = _gen([1, 2], 8)
    sent = []
    for answer in (Answer((5,)), Answer((6,)), Answer((7,))):
        sent.append(g.next_trip())
        g.finish(sent[-1], answer)
    g.finish(g.next_trip(), None)
    first = g.next_trip()
    g.finish(first, Answer((5,)))
    g.finish(g.next_trip(), None)  # the replacement failed in the middle of the replay: start it again
    starts = []
    for answer in (Answer((5,)), Answer((9,)), Answer((7,))):  # the second trip answered differently
        t = g.next_trip()
        assert t.replay
        starts.append(t.start)
        g.finish(t, answer)
    assert starts == [t.start for t in sent]
    assert g.result.replay_diverged == sent[1].number and g.result.tokens == [5, 6, 7]
    nxt = g.next_trip()
    assert not nxt.replay and nxt.start == 4 and nxt.tokens == (7,)
    note = GenerationResult([1], [2], failovers=2, replay_diverged=1).failover_note()
    assert "differently" in note and "may differ" in note


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
        "prompt_ids", "tokens", "route", "links", "hops", "failovers", "replayed_trips", "replay_exact", "retracted", "verified_trips", "unverified_trips", "prefill_ms", "decode_ms", "decode_tokens_per_s", "steps",
        "guesses_proposed", "guesses_accepted", "where_the_time_goes"]
    assert net.as_dict()["where_the_time_goes"] == {"trips": 0}


def test_a_rewind_drops_the_trips_after_its_tokens_replays_the_rest_and_goes_on_from_there():
    """A verifier caught the chain lying after the first ``keep`` tokens (issue 26): the later trips and their tokens
    go, the kept trips are replayed in their shapes, and the request continues from the kept position, so the result
    never holds a gap or a lie (before, the tokens were cut back while the loop went on from the lied position)."""
    from sangama_p2p.generation import Rewind

    g = _gen([1, 2, 3], 10)
    kept = g.next_trip()
    g.finish(kept, Answer((7,), (8,)))  # position 3: 7, guess 8 (verified up to here)
    t = g.next_trip()
    assert g.finish(t, Answer((8, 66), ())) == [8, 66]  # a lie: 66
    lost = g.next_trip()
    assert (lost.start, lost.tokens) == (5, (66,))
    assert g.finish(lost, Rewind(1)) == [] and g.result.tokens == [7] and g.result.retracted == 2
    again = g.next_trip()  # the kept trip, replayed as it was sent
    assert again.replay and (again.start, again.tokens, again.n_guesses) == (0, (1, 2, 3), 0)
    assert g.finish(again, Answer((7,), (8,))) == [] and g.result.replay_diverged is None
    t = g.next_trip()  # on from the kept position with the kept guesses: what the lied trip carried, asked again
    assert not t.replay and (t.start, t.tokens, t.n_guesses) == (3, (7, 8), 1)
    assert g.finish(t, Answer((8, 5), ())) == [8, 5]
    assert g.result.tokens == [7, 8, 5] and not g.done
    assert "taken back" in g.result.failover_note() or not g.result.failovers


def test_a_rewind_to_nothing_sends_the_prompt_again():
    from sangama_p2p.generation import Rewind

    g = _gen(range(10), 5, max_step_tokens=4)
    for _ in range(2):
        g.finish(g.next_trip(), Answer((0,)))  # two prefill chunks
    t = g.next_trip()
    g.finish(t, Answer((42,), ()))  # the first token: a lie
    g.finish(g.next_trip(), Rewind(0))
    assert g.result.tokens == [] and g.result.retracted == 1
    replays = [g.next_trip() for _ in range(2)]
    assert all(r.replay and r.chunk for r in replays)
    for r in replays:
        g.finish(r, Answer((0,)))
    t = g.next_trip()
    assert not t.replay and (t.start, t.tokens) == (8, (8, 9))
    assert g.finish(t, Answer((5,), ())) == [5] and g.result.tokens == [5]
