"""The DHT routing table keeps servers only: clients that queried a bootstrap node and peers that went away drop out."""

from __future__ import annotations

import os

import trio
from libp2p.peer.id import ID

from sangama_p2p.net.dht import offers_dht, providers_from_network
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair, peer_id_of
from sangama_p2p.net.node import Node
from sangama_p2p.net.status import survey

from .net_swarm import config, first_addr, swarm


def _table(node: Node) -> set[ID]:
    assert node.dht is not None
    return set(node.dht.routing_table.get_peer_ids())


async def _until(condition, timeout: float = 10.0) -> None:
    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.05)


def test_clients_that_queried_a_bootstrap_node_stay_out_of_its_routing_table():
    """The walkthrough's repro: a few `generate` runs (DHT clients) against a bootstrap, then `status`."""

    async def main():
        with trio.fail_after(60):
            async with swarm(2) as (boot, server):
                await _until(lambda: server.peer_id in _table(boot))  # a server is added once identify confirms it
                clients = []
                for _ in range(3):
                    cfg = config(bootstrap_addrs=(first_addr(boot),), dht_server=False)
                    async with open_host(cfg, key_pair=generate_key_pair()) as client:
                        await providers_from_network(client, os.urandom(32))  # KAD streams to the bootstrap
                        await _until(lambda: offers_dht(boot.host, client.peer_id) is not None)
                        await trio.sleep(0.2)  # room for a deferred add (there must be none)
                        assert client.peer_id not in _table(boot)
                        clients.append(client.peer_id.to_base58())
                assert _table(boot) == {server.peer_id}
                cfg = config(bootstrap_addrs=(first_addr(boot),), dht_server=False)
                async with open_host(cfg, key_pair=generate_key_pair()) as viewer:
                    shown = {p.peer_id for p in (await survey(viewer, timeout=3.0)).peers}
                assert shown == {boot.peer_id.to_base58(), server.peer_id.to_base58()}  # no dead client rows

    trio.run(main)


def test_a_server_that_cannot_be_dialled_any_more_is_dropped_from_the_routing_table():
    async def main():
        with trio.fail_after(60):
            async with swarm(1) as (boot,):
                cfg = config(bootstrap_addrs=(first_addr(boot),))
                async with open_host(cfg, key_pair=generate_key_pair()) as server:
                    gone = server.peer_id
                    await _until(lambda: gone in _table(boot))
                await _until(lambda: not boot.connections(gone))  # the bootstrap noticed the connection close
                await providers_from_network(boot, os.urandom(32))  # asks its table: the dial to `gone` fails
                assert gone not in _table(boot)

    trio.run(main)


def test_a_dht_query_that_arrives_while_the_node_closes_does_not_crash_it():
    """Found while timing SIGTERM (issue 15, item 6): a DHT request handled during shutdown made ``add_peer`` start
    a task in the node's closed nursery, and ``sangama-peer join`` exited 1 with 'Nursery is closed to new
    arrivals' instead of 0."""
    from libp2p.kad_dht.kad_dht import DHTMode

    from sangama_p2p.net.dht import _ServerDHT
    from sangama_p2p.net.identity import peer_id_of

    async def main():
        with trio.fail_after(20):
            async with open_host(config()) as node:
                async with trio.open_nursery() as closed:
                    pass
                dht = _ServerDHT(node.host, DHTMode.SERVER, closed)
                stranger = peer_id_of(generate_key_pair())  # identify knows nothing of it: the deferred path
                assert await dht.add_peer(stranger) is False
                assert stranger not in dht.routing_table._identifying

    trio.run(main)


def test_a_bootstrap_node_that_is_only_a_dht_client_is_reported_as_such():
    """Issue 13: with a DHT client as the only bootstrap, `join` said `ready` and generation `no live peer serves`."""
    from sangama_p2p.errors import NetworkError

    async def main():
        with trio.fail_after(60):
            async with open_host(config(dht_server=False), key_pair=generate_key_pair()) as client_only:
                cfg = config(bootstrap_addrs=(first_addr(client_only),))
                try:
                    async with open_host(cfg, key_pair=generate_key_pair()):
                        raise AssertionError("joined through a bootstrap that serves no DHT")
                except NetworkError as exc:
                    assert "only a DHT client" in str(exc) and str(client_only.peer_id) in str(exc)
                async with swarm(1) as (boot,):  # beside a real server it is only a warning
                    both = (first_addr(client_only), first_addr(boot))
                    async with open_host(config(bootstrap_addrs=both), key_pair=generate_key_pair()) as node:
                        assert node.dht is not None

    trio.run(main)


def test_a_publish_asks_only_dht_servers_and_stores_only_at_peers_that_answered():
    """The NAT fleet's regression (tests/net/test_nat_fleet.py, bisected to join's pre-flight lookup): a peer whose
    peerstore holds another peer's dead address (a NATed stage's private one, learnt from a provider lookup) must
    not dial it on the way to publishing. py-libp2p's lookup topped a thin routing table up with every peerstore
    peer and returned the dead one among the closest, so put_value and provide each waited on it (5 s apiece)."""
    import multiaddr

    async def main():
        with trio.fail_after(60):
            async with swarm(1) as (boot,):
                cfg = config(bootstrap_addrs=(first_addr(boot),))
                async with open_host(cfg, key_pair=generate_key_pair()) as node:
                    dead = peer_id_of(generate_key_pair())
                    # a black-holed address (TEST-NET-1: nothing answers, the dial would wait out its timeout)
                    node.host.get_peerstore().add_addrs(dead, [multiaddr.Multiaddr("/ip4/192.0.2.1/tcp/4101")], 600)
                    key = os.urandom(32)
                    closest = await node.dht.peer_routing.find_closest_peers_network(key)
                    assert closest == [boot.peer_id]  # the server that answered; never the peer nobody vouched for
                    assert not node.connections(dead)

    trio.run(main)



def test_a_slow_peer_is_stored_at_only_if_identify_shows_it_serving_the_dht(monkeypatch):
    """A peer that took longer than QUERY_TIMEOUT to answer FIND_NODE but is still connected was returned among the
    closest, so put_value and provide stored at it, whatever it was: issue 27's stages stored their records at a DHT
    client (another NATed stage: "protocol not supported") and at departed clients. Here the slow peer's identify
    lists no KAD protocol (it registered a handler that never answers only after identify ran)."""
    from libp2p.kad_dht.common import PROTOCOL_ID

    from sangama_p2p.net import kad_rpc

    monkeypatch.setattr(kad_rpc, "QUERY_TIMEOUT", 1.0)

    async def never_answer(stream):
        await trio.sleep_forever()

    async def main():
        with trio.fail_after(60):
            async with swarm(1) as (boot,):
                cfg = config(bootstrap_addrs=(first_addr(boot),))
                async with open_host(cfg, key_pair=generate_key_pair()) as node, \
                        open_host(config(dht_server=False), key_pair=generate_key_pair()) as client:
                    await node.connect(client.peer_id, client.listen_addrs())
                    await _until(lambda: offers_dht(node.host, client.peer_id) is False)
                    client.host.set_stream_handler(PROTOCOL_ID, never_answer)  # no identify push: still "a client"
                    await node.dht.routing_table.add_peer(client.peer_id, skip_server_mode_check=True)  # stale entry
                    closest = await node.dht.peer_routing.find_closest_peers_network(os.urandom(32))
                    assert closest == [boot.peer_id]

    trio.run(main)
