"""Reachability from servers that are not ours, and reaching a NATed peer of whom only private addresses are known.

Issue 27, item 2: a go-libp2p bootstrap speaks no ``/sangama/dialback/1``; such a node answers the standard AutoNAT v1
(asked instead, net/autonat.py), and a peer that nobody answered acts as a private one (DHT client, reservations) and
keeps asking instead of staying undecided for good. The namespace case with go-libp2p's own daemon is in
``test_go_bootstrap.py``; here AutoNAT servers are loopback nodes answering the real protobuf messages.
"""

from __future__ import annotations

from contextlib import AsyncExitStack

import pytest
import trio
from libp2p.abc import INetStream
from libp2p.host.autonat.pb.autonat_pb2 import Message
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.utils.varint import encode_varint_prefixed, read_varint_prefixed_bytes_limited
from multiaddr import Multiaddr

from sangama_p2p.errors import NetworkError
from sangama_p2p.net.autonat import AUTONAT_PROTOCOL, dial_request, parse_response
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.reach import DIALBACK_PROTOCOL, Reachability, check_reachability
from sangama_p2p.net.relay import RelayServiceConfig
from sangama_p2p.net.traversal import Traversal, TraversalConfig

from .net_swarm import config, first_addr


def _response(status: int, addr: str = "", text: str = "") -> bytes:
    message = Message(type=Message.DIAL_RESPONSE)
    message.dialResponse.status = status
    message.dialResponse.statusText = text
    if addr:
        message.dialResponse.addr = Multiaddr(addr).to_bytes()
    return message.SerializeToString()


def _autonat_server(status: int, seen: list[Message]):  # type: ignore[no-untyped-def]
    """A stream handler answering every DIAL with ``status`` (what a go-libp2p AutoNAT server sends)."""

    async def handle(stream: INetStream) -> None:
        try:
            request = Message()
            request.ParseFromString(await read_varint_prefixed_bytes_limited(stream, 4096))
            seen.append(request)
            addr = "/ip4/192.0.2.7/tcp/4101" if status == Message.OK else ""
            await stream.write(encode_varint_prefixed(_response(status, addr, "dial refused" if status == 101 else "")))
        finally:
            await stream.close()

    return handle


def test_dial_request_and_responses_are_the_autonat_v1_messages() -> None:
    me = ID.from_pubkey(generate_key_pair().public_key)
    raw = dial_request(me, ["/ip4/192.0.2.1/tcp/4101", "/ip4/192.0.2.1/tcp/1/p2p/QmX/p2p-circuit"] + [
        f"/ip4/192.0.2.1/tcp/{p}" for p in range(2, 20)])
    message = Message()
    message.ParseFromString(raw[1:] if raw[0] < 0x80 else raw[2:])  # one or two varint bytes of length
    assert message.type == Message.DIAL and message.dial.peer.id == me.to_bytes()
    addrs = [str(Multiaddr(a)) for a in message.dial.peer.addrs]
    assert addrs[0] == "/ip4/192.0.2.1/tcp/4101" and len(addrs) == 8 and not any("circuit" in a for a in addrs)
    ok = parse_response(_response(Message.OK, "/ip4/192.0.2.7/tcp/4101"))
    assert ok.reached and not ok.unreachable and ok.addr == "/ip4/192.0.2.7/tcp/4101"
    assert parse_response(_response(Message.E_DIAL_ERROR)).unreachable
    refused = parse_response(_response(Message.E_DIAL_REFUSED, text="no public address"))
    assert not refused.reached and not refused.unreachable and refused.text == "no public address"
    for bad in (b"\xff\xff\xff", Message(type=Message.DIAL).SerializeToString()):
        with pytest.raises(NetworkError):
            parse_response(bad)


@pytest.mark.parametrize(("status", "verdict"), [(Message.OK, Reachability.PUBLIC),
                                                 (Message.E_DIAL_ERROR, Reachability.PRIVATE),
                                                 (Message.E_DIAL_REFUSED, Reachability.UNKNOWN)])
def test_a_server_without_our_dialback_is_asked_autonat_v1(status: int, verdict: Reachability) -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(open_host(config(), key_pair=generate_key_pair()))
            seen: list[Message] = []
            server.host.set_stream_handler(AUTONAT_PROTOCOL, _autonat_server(status, seen))
            asker = await stack.enter_async_context(open_host(config(), key_pair=generate_key_pair()))
            info = PeerInfo(server.peer_id, [Multiaddr(first_addr(server).rsplit("/p2p/", 1)[0])])
            report = await check_reachability(asker.host, [info], timeout_s=5.0)
            assert report.status is verdict, report
            assert len(seen) == 1 and seen[0].dial.peer.id == asker.peer_id.to_bytes()
            if verdict is Reachability.PUBLIC:
                assert report.public_addrs == ("/ip4/192.0.2.7/tcp/4101",)
            if verdict is Reachability.UNKNOWN:
                assert any("no verdict" in e and "dial refused" in e for e in report.errors), report.errors

    trio.run(main)


def test_nobody_answering_makes_a_peer_act_private_and_ask_again() -> None:
    """A bootstrap that answers neither protocol: the peer is undecided, a DHT client, holds a reservation on it (a
    relay), says so, and asks again after UNDECIDED_RECHECK_S instead of never."""

    async def main() -> None:
        async with AsyncExitStack() as stack:
            # a relay that runs no dial-back server (forced public: it asks nobody) - like a go-libp2p relay
            relay_t = Traversal(TraversalConfig(reachability="public", serve_relay=True,
                                                relay_limits=RelayServiceConfig()))
            relay = await stack.enter_async_context(open_host(config(relay_hop=True), services=[relay_t.run]))
            with trio.fail_after(15):
                await relay_t.wait_ready()
            relay.host.remove_stream_handler(DIALBACK_PROTOCOL)  # nothing answers our dial-back there
            b_t = Traversal(TraversalConfig(hole_punch=False, recheck_s=600.0))
            b = await stack.enter_async_context(open_host(config(bootstrap_addrs=(first_addr(relay),)),
                                                          services=[b_t.run]))
            with trio.fail_after(30):
                await b_t.wait_ready()
            assert b_t.reachability is Reachability.UNKNOWN and b_t.undecided
            assert b.dht is not None and b.dht.mode == DHTMode.CLIENT  # not a server nobody can reach
            assert b_t.relay_client is not None and b_t.relay_client.reservations  # reachable through the relay
            assert b_t.reachable()

    trio.run(main)


def test_a_peer_known_only_by_private_addresses_is_reached_through_our_relay() -> None:
    """What a go-libp2p DHT hands out for a NATed provider: its listen addresses, no circuit address. The dial tries
    a circuit through the relays we know once those fail (a guess, never stored in the peerstore)."""

    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay_t = Traversal(TraversalConfig(relay_limits=RelayServiceConfig()))
            relay = await stack.enter_async_context(open_host(config(relay_hop=True), services=[relay_t.run]))
            with trio.fail_after(15):
                await relay_t.wait_ready()
            boot = (first_addr(relay),)
            b_t = Traversal(TraversalConfig(reachability="private", hole_punch=False))
            b = await stack.enter_async_context(open_host(config(bootstrap_addrs=boot), services=[b_t.run]))
            a_t = Traversal(TraversalConfig(reachability="private", hole_punch=False))
            a = await stack.enter_async_context(open_host(config(bootstrap_addrs=boot), services=[a_t.run]))
            with trio.fail_after(15):
                await b_t.wait_ready()
                await a_t.wait_ready()
            dead = Multiaddr("/ip4/127.0.0.1/tcp/1")  # b's "private address": nothing listens there
            conn = await a.connect(b.peer_id, [dead])
            assert "/p2p-circuit" in str(conn.get_transport_addresses()[0])
            stored = [str(x) for x in a.host.get_peerstore().addrs(b.peer_id)]
            assert not any("/p2p-circuit" in x for x in stored), stored  # the guess was not written down as known
            a.circuit_guesses.clear()  # without the guess: nothing else to try
            for c in a.connections(b.peer_id):
                await c.close()
            a.host.get_peerstore().clear_addrs(b.peer_id)
            with pytest.raises(NetworkError):
                await a.connect(b.peer_id, [dead])

    trio.run(main)
