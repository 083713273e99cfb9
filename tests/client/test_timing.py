"""Where the time goes: per trip, stage queue + compute + send and the network remainder make up the trip."""

from __future__ import annotations

import trio

from sangama_p2p.client import ChainClient, ClientConfig, summarize_trips
from sangama_p2p.client.timing import trip_timing
from sangama_p2p.wire.messages import TraceStamp

from .fleet import MODEL, fleet

SPLIT = [(0, 3), (3, 5), (5, 8)]


def test_trip_timing_from_stamps_on_separate_clocks():
    # two stages whose clocks differ by hours: only differences within one stamp are used
    trace = [TraceStamp("a", 10**12, 10**12 + 2_000_000, 10**12 + 7_000_000, 10**12 + 8_000_000, 3),
             TraceStamp("b", 5, 1_000_005, 4_000_005, 4_500_005, 1)]
    t = trip_timing(4, 3, 2, 0.020, trace)
    assert [(s.peer, s.queue_s, s.compute_s, s.send_s, s.batch_size) for s in t.stages] == [
        ("a", 0.002, 0.005, 0.001, 3), ("b", 0.001, 0.003, 0.0005, 1)]
    assert abs(t.network_s - (0.020 - 0.0125)) < 1e-12
    summary = summarize_trips([trip_timing(0, 9, 1, 1.0, trace), t])  # the prefill is left out
    assert summary["trips"] == 1 and summary["trip_ms"] == 20.0 and summary["network_ms"] == 7.5
    assert [s["compute_ms"] for s in summary["stages"]] == [5.0, 3.0]


def test_stage_times_and_network_add_up_to_the_measured_trip(ckpt):
    """Every trip through the client (``ring=False``): the client times each from its send to the answer."""
    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                peers = [n.peer_id.to_base58() for n, _, _ in f.stages]
                async with ChainClient(f.clients[0], ClientConfig(MODEL, ring=False)) as client:
                    return peers, await client.generate([1, 2, 3, 4], 12, guesses=2)

    peers, res = trio.run(main)
    assert res.trips and res.route == peers
    for t in res.trips:
        assert [s.peer for s in t.stages] == peers  # one stamp per stage, in chain order
        parts = sum(s.queue_s + s.compute_s + s.send_s for s in t.stages) + t.network_s
        assert abs(parts - t.trip_s) <= 0.05 * t.trip_s
        assert all(s.compute_s > 0 and s.queue_s >= 0 and s.send_s >= 0 for s in t.stages)
        # four hops cost something, and the stages' own time is never more than the client saw
        assert 0 < t.network_s < t.trip_s
    table = summarize_trips(res.trips)
    assert len(table["stages"]) == 3 and table["trip_ms"] > table["network_ms"] > 0


def test_with_the_ring_a_trip_is_the_time_between_two_answers(ckpt):
    """The ring hands each trip on without the client, so a trip's time is from the answer before to its own: the
    decode trips' times add up to the decode time, and every trip still has one stamp per stage. (No verifying: in a
    public fleet a drawn trip's search for a second chain is client time between two answers that no trip holds - a
    loaded machine once spent 340 ms on it while the ring answered every later trip.)"""
    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                peers = [n.peer_id.to_base58() for n, _, _ in f.stages]
                async with ChainClient(f.clients[0], ClientConfig(MODEL, ring=True, verify=0)) as client:
                    return peers, await client.generate([1, 2, 3, 4], 12, guesses=2)

    peers, res = trio.run(main)
    assert all([s.peer for s in t.stages] == peers for t in res.trips)
    decode = sum(t.trip_s for t in res.trips[1:])
    assert abs(decode - res.decode_s) <= 0.05 * res.decode_s + 0.002, (decode, res.decode_s)
