"""Peers that left are not dialled (issue 27): throwaway clients never enter a routing table, py-libp2p's
auto-connector dials nobody, a peer that failed to answer waits a growing interval, and retries share a budget.

Dial attempts are counted at py-libp2p's TCP transport (``TCP.dial``), under every dialler: ours, the DHT's, the
auto-connector's.
"""

from __future__ import annotations

import os
import socket

import multiaddr
import pytest
import trio
from libp2p.peer.id import ID
from libp2p.transport.tcp.tcp import TCP

from sangama_p2p.errors import NetworkError
from sangama_p2p.net.dht import providers_from_network
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair, peer_id_of
from sangama_p2p.net.node import Node

from .net_swarm import config, first_addr, swarm


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def _count_dials(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch py-libp2p's TCP dial: the list fills with the port of every dial attempt, whoever makes it."""
    ports: list[int] = []
    real = TCP.dial

    async def dial(self, maddr):  # type: ignore[no-untyped-def]
        ports.append(int(maddr.value_for_protocol("tcp")))
        return await real(self, maddr)

    monkeypatch.setattr(TCP, "dial", dial)
    return ports


def _table(node: Node) -> set[ID]:
    assert node.dht is not None
    return set(node.dht.routing_table.get_peer_ids())


def _port(node: Node) -> int:
    return int(node.listen_addrs()[0].value_for_protocol("tcp"))


def _dead_port() -> int:
    """A loopback port nobody listens on (a departed peer's)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.05)


async def _a_minute_of_housekeeping(node: Node) -> None:
    """What a node does on its own over a minute, compressed: py-libp2p's auto-connector tick (its 60 s grace for
    peers that just disconnected over), its routing-table refresh, and a few of our lookups."""
    assert node.dht is not None
    connector = node.host.get_network().auto_connector
    connector._recent_disconnects.clear()
    await connector.maybe_connect()
    with trio.move_on_after(10):
        await node.dht.refresh_routing_table()
    for _ in range(3):
        await providers_from_network(node, os.urandom(32))


def test_departed_clients_stay_out_of_routing_tables_and_are_not_dialled_again(monkeypatch):
    """A bootstrap and a stage (DHT servers) and 6 throwaway DHT clients: each queries the bootstrap (half of them
    also chain the stage), the stage hears of each in a FIND_NODE answer of the bootstrap's (py-libp2p's own query:
    0.8.1 adds every peer an answer names to the routing table, and the stage never identified the clients that
    did not chain it), then the client leaves. Neither table holds a client, then or after a minute of
    housekeeping, and that minute dials none of them (the old code did, from the auto-connector and the table)."""
    from libp2p.kad_dht.pb.kademlia_pb2 import Message

    from sangama_p2p.net.kad_rpc import kad_request

    dials = _count_dials(monkeypatch)

    async def main():
        with trio.fail_after(120):
            async with swarm(2) as (boot, stage):
                await _until(lambda: stage.peer_id in _table(boot) and boot.peer_id in _table(stage))
                departed: dict[ID, int] = {}
                for i in range(6):
                    async with open_host(config(dht_server=False), key_pair=generate_key_pair()) as client:
                        await client.connect(boot.peer_id, boot.listen_addrs())
                        await kad_request(client.host, boot.peer_id, Message.MessageType.GET_PROVIDERS, os.urandom(32))
                        if i % 2:
                            await client.connect(stage.peer_id, stage.listen_addrs())  # as a client chains a stage
                        await stage.dht.peer_routing._query_peer_for_closest(boot.peer_id, client.peer_id.to_bytes())
                        await trio.sleep(0.2)  # room for deferred routing-table adds (there must be none)
                        assert client.peer_id not in _table(boot) | _table(stage)
                        departed[client.peer_id] = _port(client)
                gone = set(departed)
                await _until(lambda: not any(n.connections(p) for n in (boot, stage) for p in gone))
                del dials[:]
                for node in (boot, stage):
                    await _a_minute_of_housekeeping(node)
                assert not (_table(boot) | _table(stage)) & gone
                assert [p for p in dials if p in departed.values()] == []
                assert stage.peer_id in _table(boot) and boot.peer_id in _table(stage)  # the servers stay

    trio.run(main)


def test_the_auto_connector_dials_nobody(monkeypatch):
    """py-libp2p 0.8.1's auto-connector aims at 256 connections (the midpoint of low_watermark 0 and
    high_watermark 512) and dials every peerstore peer; ours dials none, on its tick or after a disconnect."""
    dials = _count_dials(monkeypatch)

    async def main():
        with trio.fail_after(30):
            async with open_host(config()) as node:
                store = node.host.get_peerstore()
                for _ in range(5):
                    store.add_addrs(peer_id_of(generate_key_pair()),
                                    [multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{_dead_port()}")], 3600)
                swarm_ = node.host.get_network()
                await swarm_.auto_connector.maybe_connect()
                swarm_._schedule_auto_connect()
                await trio.sleep(0.5)
        assert dials == []

    trio.run(main)


def test_the_backoff_doubles_to_its_cap_and_resets():
    from sangama_p2p.net.backoff import BackoffPolicy, DialBackoff  # here: the first two tests run on older code too

    clock = Clock()
    b = DialBackoff(BackoffPolicy(first_s=5, max_s=600, retries_per_minute=1000), clock=clock)
    assert b.admit("p") == 0  # never failed
    waits = []
    for _ in range(9):
        waits.append(b.failed("p"))
        assert b.admit("p") == pytest.approx(waits[-1])
        clock.now += waits[-1]
        assert b.admit("p") == 0  # its time came: one retry
    assert waits == [5, 10, 20, 40, 80, 160, 320, 600, 600]
    b.succeeded("p")
    assert b.failed("p") == 5 and b.failures("p") == 1  # a connection reset it
    failed_at = clock.now
    assert not b.fresh_record("p", signed_at=failed_at - 1)  # a record older than the failure: still waits
    assert b.admit("p") > 0
    assert b.fresh_record("p", signed_at=failed_at + 1)  # signed after the failure: the peer is back
    assert b.admit("p") == 0 and "p" not in b


def test_retries_share_a_budget_however_many_peers_failed():
    from sangama_p2p.net.backoff import BackoffPolicy, DialBackoff

    clock = Clock()
    b = DialBackoff(BackoffPolicy(first_s=5, max_s=600, retries_per_minute=10), clock=clock)
    for i in range(1000):
        b.failed(i)
    clock.now += 601  # every backoff is over
    per_minute = []
    for _minute in range(5):
        per_minute.append(sum(b.admit(i) == 0 for i in range(1000)))  # everyone retried every minute
        clock.now += 60
    assert per_minute == [10, 10, 10, 10, 10]
    assert b.admit("new") == 0  # a peer that never failed is not held back by the budget
    small = DialBackoff(BackoffPolicy(max_peers=3), clock=clock)
    for i in range(5):
        small.failed(i)
    assert len(small) == 3 and 0 not in small and 4 in small  # the longest-failed are forgotten first


def test_a_peer_that_did_not_answer_is_not_dialled_again_until_its_backoff_ends(monkeypatch):
    """Our dials (Node.connect) and py-libp2p's (a stream to the peer) both wait; an explicit dial does not; a
    connection from the peer clears its backoff."""
    from sangama_p2p.errors import PeerBackedOff
    from sangama_p2p.net.backoff import DialBackoff

    dials = _count_dials(monkeypatch)

    async def main():
        with trio.fail_after(60):
            async with open_host(config()) as node:
                clock = Clock()
                node.backoff = DialBackoff(clock=clock)
                dead = peer_id_of(generate_key_pair())
                port = _dead_port()
                addr = multiaddr.Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")
                with pytest.raises(NetworkError):
                    await node.connect(dead, [addr])
                assert dials.count(port) == 1 and node.backoff.wait_s(dead) == 5
                with pytest.raises(PeerBackedOff):
                    await node.connect(dead, [addr])
                with pytest.raises(Exception):  # py-libp2p's own dial (a DHT query, identify) goes the same way
                    await node.host.new_stream(dead, ["/ipfs/kad/1.0.0"])
                assert dials.count(port) == 1
                clock.now += 5
                with pytest.raises(NetworkError) as exc:
                    await node.connect(dead, [addr])
                assert not isinstance(exc.value, PeerBackedOff) and dials.count(port) == 2
                assert node.backoff.wait_s(dead) == 10  # doubled
                with pytest.raises(NetworkError) as exc:
                    await node.connect(dead, [addr], explicit=True)  # the user asked: dialled anyway
                assert not isinstance(exc.value, PeerBackedOff) and dials.count(port) == 3
                async with open_host(config()) as back:  # a peer that failed, then connects to us itself
                    node.backoff.failed(back.peer_id)
                    await back.connect(node.peer_id, node.listen_addrs())
                    await _until(lambda: back.peer_id not in node.backoff)
                    await node.connect(back.peer_id)

    trio.run(main)


def test_a_configured_bootstrap_node_is_dialled_whatever_its_backoff():
    """The user named it, and the set is bounded: reconnecting to a bootstrap node that restarted must not wait up
    to 10 min (its reconnect loop paces itself)."""

    async def main():
        with trio.fail_after(30):
            async with swarm(1) as (boot,):
                async with open_host(config(bootstrap_addrs=(first_addr(boot),))) as node:
                    for _ in range(6):
                        node.backoff.failed(boot.peer_id)  # as if it had been away for minutes
                    await node.host.disconnect(boot.peer_id)
                    await _until(lambda: not node.connections(boot.peer_id))
                    await node.connect(boot.peer_id)

    trio.run(main)
