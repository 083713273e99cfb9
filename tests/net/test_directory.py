"""Range directories (issue 25, item 1): the records of one start layer under one DHT key, merged by the DHT servers,
walked by a survey boundary by boundary, with a bounded set of candidates per range."""

from __future__ import annotations

import random
from contextlib import AsyncExitStack
import time

import msgpack
import pytest
import trio

from sangama_p2p.errors import RecordError
from sangama_p2p.net.directory import (MAX_ENTRIES, choose_candidates, decode_directory, directory_key,
                                       encode_directory, merge_directories)
from sangama_p2p.net.discovery import Announcer, ServingOffer, SurveyFacts, find_serving_peers
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.records import sign_record

from .net_swarm import config, first_addr, swarm

FP = "ab" * 16


def _signed(start: int = 0, end: int = 4, *, key=None, seq: int = 1, ttl: float = 60.0, tps: float = 1.0,
            free: int = 1, model: str = "m", now: float | None = None):
    key = key or generate_key_pair()
    return key, sign_record(key, model_id=model, start=start, end=end, throughput=tps, free_sessions=free,
                            addrs=["/ip4/127.0.0.1/tcp/1"], ttl=ttl, seq=seq, fingerprint=FP, num_layers=8, now=now)


def test_a_directory_merges_the_newest_record_per_peer_and_drops_expired_and_misplaced_ones():
    key = directory_key("m", 0)
    k1, old = _signed(seq=1)
    _, new = _signed(seq=2, key=k1)
    _, other = _signed(seq=5)
    _, expired = _signed(ttl=10.0, now=time.time() - 20)
    _, misplaced = _signed(start=4, end=8)  # starts at 4: not in layer 0's directory
    merged = merge_directories(key, [encode_directory([old.value, other.value]),
                                     encode_directory([new.value, expired.value, misplaced.value])])
    entries = decode_directory(key, merged)
    assert sorted((r.peer_id, r.seq) for r, _ in entries) == sorted([(new.record.peer_id, 2),
                                                                     (other.record.peer_id, 5)])
    with pytest.raises(RecordError, match="wrong directory"):
        decode_directory(key, encode_directory([misplaced.value]))
    with pytest.raises(RecordError, match="expired"):
        decode_directory(key, encode_directory([expired.value]))
    with pytest.raises(RecordError):
        decode_directory(key, msgpack.packb(["sangama/dir/0", [new.value]]))
    tampered = bytearray(new.value)
    tampered[-3] ^= 1
    with pytest.raises(RecordError, match="signature|envelope"):
        decode_directory(key, encode_directory([bytes(tampered)]))


def test_a_full_directory_keeps_the_records_that_live_longest():
    key = directory_key("m", 0)
    now = time.time()
    records = [_signed(ttl=100.0 + i, now=now)[1] for i in range(MAX_ENTRIES + 5)]
    merged = merge_directories(key, [encode_directory([r.value]) for r in records])
    kept = {r.peer_id for r, _ in decode_directory(key, merged)}
    assert kept == {r.record.peer_id for r in records[5:]}


def test_candidates_are_bounded_per_range_best_first_then_drawn():
    records = [_signed(0, 4, tps=float(i))[1].record for i in range(20)]
    records += [_signed(0, 8, tps=1.0)[1].record, _signed(0, 4, tps=99.0, free=0)[1].record]
    chosen = choose_candidates(records, per_range=6, rng=random.Random(1))
    short = [r for r in chosen if r.end == 4]
    assert len(short) == 6 and [r for r in chosen if r.end == 8]
    assert [r.throughput for r in short[:3]] == [19.0, 18.0, 17.0]  # a full peer is never among the best
    draws = {tuple(r.peer_id for r in choose_candidates(records, rng=random.Random(s))[3:6]) for s in range(5)}
    assert len(draws) > 1  # the rest are drawn: clients spread over a range's peers


def test_a_survey_walks_the_boundaries_and_probes_a_bounded_set_per_range():
    """Twelve serving peers in three ranges: the survey makes one lookup per boundary (3), finds every range, keeps
    at most ``per_range`` candidates of each, and asks fewer peers than serve; a peer whose range starts nowhere a
    walk from layer 0 reaches is not found by it."""

    async def main():
        with trio.fail_after(90):
            async with swarm(13) as nodes:
                ranges = [(0, 3), (3, 5), (5, 8)]
                for i, node in enumerate(nodes[1:]):
                    lo, hi = ranges[i % 3]
                    await Announcer(node).update(ServingOffer("m", lo, hi, 1.0 + i, 1, ttl=60, fingerprint=FP,
                                                              num_layers=8))
                cfg = config(bootstrap_addrs=(first_addr(nodes[0]),), dht_server=False)
                async with open_host(cfg, key_pair=generate_key_pair()) as client:
                    facts = SurveyFacts()
                    found = await find_serving_peers(client, "m", facts=facts, per_range=2, num_layers=8)
                    assert facts.directories == 3 and facts.providers == 12, facts
                    assert sorted({(r.start, r.end) for r in found}) == ranges
                    assert len(found) == 6 and facts.candidates == 6 and facts.records == 12
                    for lo, hi in ranges:  # the best two by throughput... of a range of four: one best, one drawn
                        best = max((r for r in found if r.start == lo), key=lambda r: r.throughput)
                        assert best.throughput == max(1.0 + i for i in range(12) if ranges[i % 3] == (lo, hi))
                    silent = {r.peer_id for r in found}
                    again = await find_serving_peers(client, "m", usable=lambda r: r.peer_id not in silent,
                                                     per_range=2, num_layers=8)
                    assert not silent & {r.peer_id for r in again} and len(again) == 6
                    everyone = await find_serving_peers(client, "m", walk=False)
                    assert len(everyone) == 12

    trio.run(main)


def test_a_departed_peers_entry_is_replaced_by_its_restart_and_expires_with_its_record():
    """A peer re-publishing (seq + 1) replaces its entry on every server; a peer that stops publishing leaves the
    directory when its record expires."""

    async def main():
        with trio.fail_after(60):
            async with swarm(3) as (boot, a, b):
                ann_a, ann_b = Announcer(a), Announcer(b)
                await ann_a.update(ServingOffer("m", 0, 8, 1.0, 1, ttl=3, fingerprint=FP, num_layers=8))
                await ann_b.update(ServingOffer("m", 0, 8, 2.0, 1, ttl=60, fingerprint=FP, num_layers=8))
                await ann_b.update(ServingOffer("m", 0, 8, 5.0, 1, ttl=60, fingerprint=FP, num_layers=8))
                async with open_host(config(bootstrap_addrs=(first_addr(boot),), dht_server=False),
                                     key_pair=generate_key_pair()) as client:
                    found = await find_serving_peers(client, "m")
                    assert {r.peer_id: r.throughput for r in found} == {str(a.peer_id): 1.0, str(b.peer_id): 5.0}
                    await trio.sleep(3.5)
                    found = await find_serving_peers(client, "m")
                    assert [r.peer_id for r in found] == [str(b.peer_id)]

    trio.run(main)


def test_one_network_holds_at_most_a_few_entries_of_a_directory():
    """Keys are free, addresses are not: Sybils of one /24 filling a directory with signed records would leave a
    client walking it only their peers to choose from. A server takes at most DIRECTORY_PER_NETWORK entries of a
    directory from senders of one network; those it holds are still renewed, other networks still get in."""
    from libp2p.kad_dht.pb.kademlia_pb2 import Record
    from libp2p.peer.id import ID

    from sangama_p2p.net.addrs import source_keys
    from sangama_p2p.net.dht_store import DIRECTORY_PER_NETWORK, PUT_SOURCE, CappedValueStore
    from sangama_p2p.net.directory import RecordsAndDirectories
    from sangama_p2p.net.records import RecordLedger

    own = generate_key_pair()

    class Host:
        def get_private_key(self):
            return own.private_key

    store = CappedValueStore(Host(), ID.from_pubkey(own.public_key), RecordLedger(max_records=100, max_per_peer=4),
                             RecordsAndDirectories())
    key = directory_key("m", 0)

    def put(ip: str, signed) -> None:
        token = PUT_SOURCE.set(source_keys(ip))
        try:
            store.put_record(key.encode(), Record(key=key.encode(), value=encode_directory([signed.value])))
        finally:
            PUT_SOURCE.reset(token)

    def held() -> set[str]:
        return {r.peer_id for r, _ in decode_directory(key, store.get(key.encode()).value)}

    sybils = [_signed() for _ in range(DIRECTORY_PER_NETWORK + 4)]
    for i, (_, signed) in enumerate(sybils):
        put(f"203.0.113.{i + 1}", signed)
    assert held() == {s.record.peer_id for _, s in sybils[:DIRECTORY_PER_NETWORK]}
    first_key, first = sybils[0]
    _, renewed = _signed(key=first_key, seq=first.record.seq + 1)
    put("203.0.113.99", renewed)  # a peer it holds re-publishes: taken
    assert {r.seq for r, _ in decode_directory(key, store.get(key.encode()).value)
            if r.peer_id == first.record.peer_id} == {renewed.record.seq}
    _, honest = _signed()
    put("198.51.100.7", honest)  # another network
    assert honest.record.peer_id in held() and len(held()) == DIRECTORY_PER_NETWORK + 1


def test_a_walk_nobody_replied_to_is_made_again_and_never_enumerates_every_peer(monkeypatch):
    """At 150 peers on two cores the DHT queries timed out, the walk found nothing, and the survey fell back to
    enumerating every provider: 94 peers asked, on a swarm already too busy to answer. A walk no server replied to
    is made again (after 0.5 and 2 s) and then gives up, saying why."""
    from sangama_p2p.net import directory as directory_mod
    from sangama_p2p.net import discovery as discovery_mod

    enumerated: list[str] = []
    real_enumerate = discovery_mod._enumerate

    async def counting(node, model_id, **kwargs):
        enumerated.append(model_id)
        return await real_enumerate(node, model_id, **kwargs)

    monkeypatch.setattr(discovery_mod, "_enumerate", counting)

    async def main():
        with trio.fail_after(60):
            async with swarm(3) as (boot, a, _):
                await Announcer(a).update(ServingOffer("m", 0, 8, 1.0, 1, ttl=60, fingerprint=FP, num_layers=8))
                async with open_host(config(bootstrap_addrs=(first_addr(boot),), dht_server=False),
                                     key_pair=generate_key_pair()) as client:
                    real = directory_mod.kad_request

                    async def silent(*args, **kwargs):
                        raise OSError("fail to read from multiselect communicator")

                    monkeypatch.setattr(directory_mod, "kad_request", silent)
                    t0 = trio.current_time()
                    facts = SurveyFacts()
                    assert await find_serving_peers(client, "m", facts=facts) == []
                    assert enumerated == [] and trio.current_time() - t0 >= 2.5
                    assert "no DHT server answered" in facts.explain("m")
                    monkeypatch.setattr(directory_mod, "kad_request", real)
                    found = await find_serving_peers(client, "m")
                    assert enumerated == [] and [r.peer_id for r in found] == [str(a.peer_id)]

    trio.run(main)


def test_the_first_peers_entry_reaches_the_servers_that_join_after_it():
    """The first stage of a fleet publishes into a DHT of one server (the bootstrap node); the servers that join
    later hold the directory clients read. Without handing the entry on (``Closest.top_up``) a walk that asked them
    missed that stage: a liar test lost its referees, 2 runs of 3, with the walk on. Now every server that joins
    gets the entry from its author, and its next version, and a client that bootstraps from a late server finds the
    first peer by the walk."""

    async def main():
        with trio.fail_after(90):
            async with AsyncExitStack() as stack:
                boot = await stack.enter_async_context(open_host(config(), key_pair=generate_key_pair()))
                first = await stack.enter_async_context(
                    open_host(config(bootstrap_addrs=(first_addr(boot),)), key_pair=generate_key_pair()))
                announcer = Announcer(first)
                async with trio.open_nursery() as nursery, AsyncExitStack() as joined:
                    nursery.start_soon(announcer.run)
                    await announcer.update(ServingOffer("m", 0, 8, 1.0, 1, ttl=60, fingerprint=FP, num_layers=8))
                    late = [await joined.enter_async_context(
                        open_host(config(bootstrap_addrs=(first_addr(boot),)), key_pair=generate_key_pair()))
                        for _ in range(8)]
                    key = directory_key("m", 0).encode()

                    def holders() -> int:
                        return sum(n.dht.value_store.get(key) is not None for n in late)

                    with trio.move_on_after(20):
                        while holders() < len(late):
                            await trio.sleep(0.1)
                    assert holders() == len(late)
                    # a re-publication reaches them too, not only the servers of its (minutes-old) lookup
                    await announcer.update(ServingOffer("m", 0, 8, 2.0, 1, ttl=60, fingerprint=FP, num_layers=8))
                    assert all([r.throughput for r, _ in decode_directory(directory_key("m", 0),
                                                                          n.dht.value_store.get(key).value)] == [2.0]
                               for n in late)
                    cfg = config(bootstrap_addrs=(first_addr(late[-1]),), dht_server=False)
                    async with open_host(cfg, key_pair=generate_key_pair()) as client:
                        facts = SurveyFacts()
                        found = await find_serving_peers(client, "m", facts=facts, num_layers=8)
                        assert [r.peer_id for r in found] == [str(first.peer_id)] and facts.directories == 1, facts
                    nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_rebalancers_look_dials_a_few_peers_per_range_and_sybil_records_hide_no_gap(monkeypatch):
    """Every auto-placed peer looks at the swarm every 20 s; probing every serving peer made each look O(swarm)
    dials. Now the records come from the directories and a look asks every peer of a thin range but only
    PROBE_UP_TO drawn from a crowded one, whose others count as recorded when those answered. A crowded range of
    records whose peers never answer (Sybils, or peers that left) is asked whole, and shows as the gap it is."""
    from sangama_p2p.stage import rebalance
    from sangama_p2p.stage.rebalance import PROBE_UP_TO, Rebalancer

    asked: list[list[str]] = []
    silent: set[str] = set()

    async def ask_ranges(node, records, model_id, timeout=5.0, lanes=None):
        asked.append([r.peer_id for r in records])
        return {r.peer_id: (r.start, r.end) for r in records if r.peer_id not in silent}  # (no stage runs here)

    monkeypatch.setattr(rebalance, "ask_ranges", ask_ranges)

    async def main():
        with trio.fail_after(90):
            async with swarm(12) as nodes:
                ranges = [(0, 3)] * 2 + [(3, 5)] * 8 + [(5, 8)]
                for node, (lo, hi) in zip(nodes[1:], ranges):
                    await Announcer(node).update(ServingOffer("m", lo, hi, 1.0, 1, ttl=60, fingerprint=FP,
                                                              num_layers=8))
                reb = Rebalancer(nodes[0], "m", FP, num_layers=8, span=3, current=lambda: (0, 3), move=None)
                want = {str(n.peer_id): r for n, r in zip(nodes[1:], ranges)}
                live = await reb.live_ranges()
                assert live == want  # every peer, each with its range
                assert len(asked) == 1 and sorted(want[p] for p in asked[0]) == [
                    (0, 3), (0, 3), *[(3, 5)] * PROBE_UP_TO, (5, 8)] and PROBE_UP_TO < 8
                asked.clear()
                silent.update(p for p, r in want.items() if r == (3, 5))  # 8 records, nobody behind them
                live = await reb.live_ranges()
                assert live == {p: r for p, r in want.items() if r != (3, 5)}
                assert sum(map(len, asked)) == len(want)  # the rest of 3:5 asked too, once

    trio.run(main)


def test_a_walk_crosses_a_gap_and_a_peer_joining_auto_dials_a_few_peers_per_range(monkeypatch):
    """Nobody serves layers 3:5 (its only peer left, or nobody came yet). The walk from layer 0 stopped at 3 and the
    survey enumerated every provider - a dial to each, for every client's survey and every retry while the gap
    lasted, and for every ``--layers auto`` peer joining. Now the walk looks past the gap, a lookup per layer, and
    finds 5:8 without enumerating; a peer joining with ``auto`` asks a few peers of the crowded range (as the
    rebalancer does) and takes the gap."""
    from types import SimpleNamespace

    from sangama_p2p.net import discovery as discovery_mod
    from sangama_p2p.net.walk import GAP_BATCH, walk_directories
    from sangama_p2p.peer import Peer
    from sangama_p2p.stage import rebalance
    from sangama_p2p.stage.rebalance import PROBE_UP_TO

    async def no_enumerating(*args, **kwargs):
        raise AssertionError("every provider was enumerated")

    monkeypatch.setattr(discovery_mod, "_enumerate", no_enumerating)
    asked: list[str] = []

    async def ask_ranges(node, records, model_id, timeout=5.0, lanes=None):
        asked.extend(r.peer_id for r in records)
        return {r.peer_id: (r.start, r.end) for r in records}  # (no stage runs here)

    monkeypatch.setattr(rebalance, "ask_ranges", ask_ranges)

    async def main():
        with trio.fail_after(90):
            async with swarm(11) as nodes:
                ranges = [(0, 3)] * 8 + [(5, 8)] * 2
                for node, (lo, hi) in zip(nodes[1:], ranges):
                    await Announcer(node).update(ServingOffer("m", lo, hi, 1.0, 1, ttl=60, fingerprint=FP,
                                                              num_layers=8))
                cfg = config(bootstrap_addrs=(first_addr(nodes[0]),), dht_server=False)
                async with open_host(cfg, key_pair=generate_key_pair()) as client:
                    for depth in (8, 0):  # the model's depth known to the caller, or read from the records
                        facts = SurveyFacts()
                        found = await find_serving_peers(client, "m", facts=facts, num_layers=depth)
                        assert sorted({(r.start, r.end) for r in found}) == [(0, 3), (5, 8)], depth
                        assert facts.records == 10 and facts.directories == 6, facts  # 0, 3, then 4 to 7
                    # a model nobody serves: layer 0 and one batch past it, then the walk stops
                    facts = SurveyFacts()
                    assert await walk_directories(client, "nobody", fingerprint=None, facts=facts, usable=None,
                                                  per_range=6, num_layers=60) == []
                    assert facts.directories == 1 + GAP_BATCH, facts
                joining = SimpleNamespace(node=nodes[0], config=SimpleNamespace(stage=None))
                layers = await Peer._resolve_layers(joining, "auto:2", "m", 8)
                assert layers == (3, 5)
                assert len(asked) == PROBE_UP_TO + 2 < len(ranges), asked

    trio.run(main)


def test_updates_racing_each_other_and_the_loop_all_publish():
    """Updates of one model started together (and the loop's own publication of a new offer) each store a record:
    publications of a model run one at a time, their seq taken in turn, so none stores an older record after a newer
    one (its local store refused it: "Refusing to replace newer value with the older one")."""

    async def main():
        with trio.fail_after(60):
            async with open_host(config(), key_pair=generate_key_pair()) as boot, \
                    open_host(config(bootstrap_addrs=(first_addr(boot),)), key_pair=generate_key_pair()) as peer:
                announcer = Announcer(peer)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(announcer.run)
                    for _ in range(5):
                        async with trio.open_nursery() as racing:
                            for tps in (1.0, 2.0, 3.0, 4.0):
                                racing.start_soon(announcer.update,
                                                  ServingOffer("m", 0, 8, tps, 1, ttl=60, fingerprint=FP, num_layers=8))
                    assert announcer.published["m"].record.seq == announcer.signed["m"].record.seq
                    nursery.cancel_scope.cancel()

    trio.run(main)
