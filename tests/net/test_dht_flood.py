"""Issue 23, item 3: a flood of signed DHT records must neither fill a DHT server's store nor stall its event loop.

The audit: 5 identities x 2,000 valid signed records, all stored (no cap per peer or in total), and the 30 s sweep
re-validated every one of them on the event loop: 5-10 s stalls, and new joins failed their handshake for as long as
the records lived. A DHT server now keeps at most ``dht_records_per_peer`` records of one author and
``dht_max_records`` in all (the flooder's records make room, never a peer's only record), and its sweep drops
records by their expiry alone, in batches, yielding to the loop between them.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
import trio
from libp2p.kad_dht.pb.kademlia_pb2 import Record

from sangama_p2p.errors import RecordError
from sangama_p2p.net import dht as dht_module
from sangama_p2p.net import records as records_module
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.node import Node
from sangama_p2p.net.records import RecordLedger, decode_record, record_key, sign_record

from .net_swarm import swarm

DEFAULT_PER_PEER = 16  # the documented defaults (docs/operations.md)
DEFAULT_TOTAL = 4096


def _signed(key_pair, model: str, *, ttl: float = 600.0) -> tuple[bytes, bytes]:
    signed = sign_record(key_pair, model_id=model, start=0, end=1, throughput=1.0, free_sessions=1,
                         addrs=["/ip4/127.0.0.1/tcp/1"], ttl=ttl, fingerprint="ab" * 16, num_layers=1)
    return record_key(model, signed.record.peer_id).encode(), signed.value


def _authors(node: Node) -> Counter[str]:
    assert node.dht is not None
    return Counter(decode_record(k.decode(), r.value).peer_id for k, (r, _) in node.dht.value_store.store.items())


async def _flood(attacker: Node, target: Node, records: list[tuple[bytes, bytes]]) -> int:
    """PUT_VALUE each record on ``target`` over the network, as any peer may; the number it acknowledged."""
    assert attacker.dht is not None
    acked = 0
    for key, value in records:
        acked += await attacker.dht.value_store._store_at_peer(target.peer_id, key, value)
    return acked


def test_defaults_are_sensible():
    config = HostConfig()
    assert (config.dht_records_per_peer, config.dht_max_records) == (DEFAULT_PER_PEER, DEFAULT_TOTAL)
    for bad in ({"dht_records_per_peer": 0}, {"dht_max_records": 0}):
        with pytest.raises(Exception, match="dht_"):
            HostConfig(**bad)


def test_a_flooding_author_keeps_only_its_cap_and_an_honest_record_is_still_stored():
    """3 identities x 24 valid records PUT on a bootstrap node: the old code stored all 72."""
    flooders = [generate_key_pair() for _ in range(3)]
    flood = [_signed(kp, f"flood-{i}-{n}") for i, kp in enumerate(flooders) for n in range(DEFAULT_PER_PEER + 8)]

    async def main():
        with trio.fail_after(120):
            async with swarm(2) as (boot, attacker):
                await _flood(attacker, boot, flood)
                per_author = _authors(boot)
                assert sum(per_author.values()) == 3 * DEFAULT_PER_PEER, per_author
                assert max(per_author.values()) == DEFAULT_PER_PEER
                newest = {k for i in range(3) for k, _ in flood[i * 24 + 8:(i + 1) * 24]}  # each its last 16
                assert set(boot.dht.value_store.store) == newest
                honest_key, honest_value = _signed(generate_key_pair(), "honest")
                assert await _flood(attacker, boot, [(honest_key, honest_value)]) == 1
                assert boot.dht.value_store.get(honest_key).value == honest_value

    trio.run(main)


def test_a_full_store_evicts_the_biggest_holder_and_never_a_peer_s_only_record():
    async def main():
        with trio.fail_after(120):
            async with swarm(2, dht_max_records=12, dht_records_per_peer=6) as (boot, attacker):
                flooders = [generate_key_pair() for _ in range(2)]
                await _flood(attacker, boot, [_signed(kp, f"f{i}-{n}") for i, kp in enumerate(flooders)
                                              for n in range(9)])
                assert sorted(_authors(boot).values()) == [6, 6]  # each flooder at its cap: the store is full
                honest = [_signed(generate_key_pair(), f"honest-{n}") for n in range(10)]
                assert await _flood(attacker, boot, honest) == 10  # each took the place of a flooder's record
                assert sorted(_authors(boot).values()) == [1] * 12
                assert all(boot.dht.value_store.get(k) is not None for k, _ in honest)
                refused = _signed(generate_key_pair(), "one-too-many")
                assert await _flood(attacker, boot, [refused]) == 0  # nobody's only record is evicted for it
                assert boot.dht.value_store.get(refused[0]) is None
                assert all(boot.dht.value_store.get(k) is not None for k, _ in honest)
                own_key, own_value = _signed(boot.key_pair, "its-own")  # a node's own record is never refused
                await boot.dht.put_value(own_key.decode(), own_value)
                assert boot.dht.value_store.get(own_key).value == own_value
                assert len(boot.dht.value_store.store) == 12

    trio.run(main)


def test_the_sweep_drops_by_expiry_alone_in_batches_that_yield_to_the_loop(monkeypatch: pytest.MonkeyPatch):
    """The old sweep re-validated every stored record (signature included) in one go on the event loop."""
    monkeypatch.setattr(dht_module, "SWEEP_BATCH", 40)
    keys = [generate_key_pair() for _ in range(20)]
    short = [_signed(kp, f"short-{n}", ttl=1.0) for kp in keys for n in range(10)]  # 200 records, 10 per author
    lasting = [_signed(kp, "lasting") for kp in keys[:5]]
    all_expired_at = time.time() + 1.05

    async def main():
        with trio.fail_after(60):
            async with swarm(1) as (boot,):
                store = boot.dht.value_store
                for key, value in short + lasting:
                    record = Record(key=key, value=value)
                    store.put_record(key, record)
                assert len(store.store) == 205
                validations = 0

                def counting(*args, **kwargs):
                    nonlocal validations
                    validations += 1
                    return decode_record(*args, **kwargs)

                monkeypatch.setattr(records_module, "decode_record", counting)
                await trio.sleep(max(0.0, all_expired_at - time.time()))
                ticks = 0

                async def ticker():
                    nonlocal ticks
                    while True:
                        ticks += 1
                        await trio.sleep(0)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(ticker)
                    await trio.sleep(0)
                    before = ticks
                    assert await boot.dht.sweep_expired() == 200
                    during = ticks - before
                    nursery.cancel_scope.cancel()
                assert validations == 0  # expiry times only: no signature checked again
                assert during >= 200 // 40 - 1  # the loop ran between the batches
                assert set(store.store) == {k for k, _ in lasting}

    trio.run(main)


def test_the_ledger_caps_an_author_and_the_total():
    ledger = RecordLedger(max_records=5, max_per_peer=3)
    assert ledger.admit(b"a1", "A", 10.0) == []
    assert ledger.admit(b"a2", "A", 5.0) == []
    assert ledger.admit(b"a3", "A", 20.0) == []
    assert ledger.admit(b"a4", "A", 30.0) == [b"a2"]  # over its cap: its own soonest-expiring record goes
    assert ledger.admit(b"a1", "A", 40.0) == []  # a re-publication is no new record
    assert ledger.admit(b"b1", "B", 1.0) == []
    assert ledger.admit(b"c1", "C", 1.0) == []
    assert len(ledger) == 5
    assert ledger.admit(b"d1", "D", 50.0) == [b"a3"]  # full: the biggest holder gives way
    assert ledger.admit(b"e1", "E", 50.0) == [b"a4"]
    assert ledger.count("A") == 1
    with pytest.raises(RecordError, match="full"):
        ledger.admit(b"f1", "F", 50.0)  # every author holds one record: the newcomer is refused
    assert len(ledger) == 5 and ledger.count("F") == 0
    assert ledger.admit(b"me", "ME", 60.0, own=True) == [b"b1"]  # the node's own record: the soonest gives way
    assert ledger.expired(now=1.0, limit=10) == [b"c1"]
    assert ledger.expired(now=45.0, limit=10) == [b"a1"]  # its first expiry (10.0) was replaced by 40.0
    ledger.discard(b"d1")
    assert ledger.expired(now=100.0, limit=1) == [b"e1"]
    assert ledger.expired(now=100.0, limit=1) == [b"me"] and len(ledger) == 0
