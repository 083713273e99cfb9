"""Relays, dial-back and DCUtR plumbing on loopback (fast; the real NATs are in ``test_nat.py``)."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack

import msgpack
import pytest
import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from sangama_p2p.errors import NetworkError, RelayError, WireError
from sangama_p2p.net.holepunch import HolePuncher, LinkInfo, stream_link
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.node import Node
from sangama_p2p.net.reach import (
    MAX_ADDRS,
    DialBackReply,
    DialBackRequest,
    Reachability,
    check_reachability,
    dialback_targets,
    serve_dialback,
)
from sangama_p2p.net.relay import RelayServiceConfig, circuit_addr, parse_circuit_addr
from sangama_p2p.net.traversal import Traversal, TraversalConfig

from .net_swarm import config, first_addr

ECHO = TProtocol("/sangama-test/echo/1")


async def _echo(stream: INetStream) -> None:
    try:
        while data := await stream.read(65536):
            await stream.write(data)
    except Exception:
        pass
    finally:
        await stream.close()


async def _roundtrip(node: Node, peer: ID, payload: bytes) -> INetStream:
    stream = await node.host.new_stream(peer, [ECHO])
    await stream.write(payload)
    got = b""
    with trio.fail_after(5):
        while len(got) < len(payload):
            got += await stream.read(len(payload) - len(got))
    assert got == payload
    return stream


async def _node(stack: AsyncExitStack, traversal: Traversal, **changes: object) -> Node:
    """A node with ``traversal`` running and an echo handler, open until ``stack`` closes."""
    node = await stack.enter_async_context(open_host(config(**changes), services=[traversal.run]))
    node.host.set_stream_handler(ECHO, _echo)
    with trio.fail_after(15):
        await traversal.wait_ready()
    return node


async def _relay_and(
    stack: AsyncExitStack, ttl: int = 3600, punch: bool = False
) -> tuple[Node, Node, Traversal]:
    """A relay node and a private node B holding a reservation on it."""
    relay = await _node(stack, Traversal(TraversalConfig(relay_limits=RelayServiceConfig(reservation_ttl_s=ttl))),
                        relay_hop=True)
    b_t = Traversal(TraversalConfig(reachability="private", hole_punch=punch))
    b = await _node(stack, b_t, bootstrap_addrs=(first_addr(relay),))
    return relay, b, b_t


# -- pure pieces -----------------------------------------------------------------------------------------------------
def test_circuit_addresses_round_trip_and_bad_ones_are_typed_errors() -> None:
    relay, peer = generate_key_pair(), generate_key_pair()
    relay_id, peer_id = ID.from_pubkey(relay.public_key), ID.from_pubkey(peer.public_key)
    addr = circuit_addr(f"/ip4/192.0.2.1/tcp/4001/p2p/{relay_id}", relay_id, peer_id)
    assert str(addr) == f"/ip4/192.0.2.1/tcp/4001/p2p/{relay_id}/p2p-circuit/p2p/{peer_id}"
    assert parse_circuit_addr(addr) == (Multiaddr("/ip4/192.0.2.1/tcp/4001"), relay_id, peer_id)
    for bad in ("/ip4/192.0.2.1/tcp/4001", f"/p2p/{relay_id}/p2p-circuit", f"/p2p/{relay_id}/p2p-circuit/p2p/xyz"):
        with pytest.raises(RelayError):
            parse_circuit_addr(bad)


def test_dialback_dials_only_the_observed_ip_at_the_requested_tcp_ports() -> None:
    asked = ["/ip4/198.18.1.2/tcp/4101", "/ip4/10.0.0.7/tcp/4101", "/ip4/1.2.3.4/udp/9/quic-v1", "/ip4/1.2.3.4/tcp/7",
             "/ip4/192.0.2.1/tcp/1/p2p/QmRelay/p2p-circuit", "garbage"]
    assert dialback_targets(asked, "192.0.2.11") == ["/ip4/192.0.2.11/tcp/4101", "/ip4/192.0.2.11/tcp/7"]
    assert dialback_targets(["/ip4/1.1.1.1/tcp/5"], "2001:db8::1") == ["/ip6/2001:db8::1/tcp/5"]
    many = [f"/ip4/1.1.1.1/tcp/{p}" for p in range(1000, 1000 + 3 * MAX_ADDRS)]
    assert len(dialback_targets(many, "192.0.2.9")) == MAX_ADDRS
    with pytest.raises(NetworkError):
        dialback_targets(asked, "not-an-ip")


def test_dialback_messages_round_trip_and_reject_hostile_input() -> None:
    request = DialBackRequest(("/ip4/1.2.3.4/tcp/5",))
    assert DialBackRequest.decode(request.encode()) == request
    reply = DialBackReply(("/ip4/1.2.3.4/tcp/5",), ("/ip4/1.2.3.4/tcp/5",))
    assert DialBackReply.decode(reply.encode()) == reply
    hostile = [
        b"\xc1",  # not msgpack
        msgpack.packb([1, 2]),
        msgpack.packb({"v": 2, "addrs": []}),
        msgpack.packb({"v": 1, "addrs": ["/ip4/1.2.3.4/tcp/5"] * (MAX_ADDRS + 1)}),
        msgpack.packb({"v": 1, "addrs": [5]}),
    ]
    for data in hostile:
        with pytest.raises(WireError):
            DialBackRequest.decode(data)
    with pytest.raises(WireError):
        DialBackReply.decode(msgpack.packb({"v": 1, "reached": "x", "tried": []}))


def test_link_info_and_config_validation() -> None:
    assert str(LinkInfo("P", "direct", "/ip4/192.0.2.12/tcp/4102")) == "direct"
    assert str(LinkInfo("P", "relayed", "/p2p/R/p2p-circuit/p2p/P", "R")) == "relayed via R"
    with pytest.raises(NetworkError):
        TraversalConfig(reachability="maybe")
    with pytest.raises(NetworkError):
        TraversalConfig(max_reservations=0)
    with pytest.raises(NetworkError):
        TraversalConfig(relays=("/ip4/198.18.0.1/tcp/4001",))  # no /p2p/<id>: we could not check whom we reach


# -- on loopback -----------------------------------------------------------------------------------------------------
def test_private_peer_is_reached_through_its_relay_and_both_sides_name_the_relay() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, b, b_t = await _relay_and(stack)
            a_t = Traversal(TraversalConfig(reachability="public"))
            a = await _node(stack, a_t)
            assert b_t.reachability is Reachability.PRIVATE
            relay_addr = first_addr(relay).split("/p2p/")[0]
            circuit = f"{relay_addr}/p2p/{relay.peer_id}/p2p-circuit/p2p/{b.peer_id}"
            assert [str(x) for x in b_t.circuit_addrs()] == [circuit]
            # py-libp2p would advertise the relay's address as B's own; it must not appear.
            assert f"{relay_addr}/p2p/{b.peer_id}" not in {str(x) for x in b.advertised_addrs()}

            link = await a_t.connect(b.peer_id, [circuit])
            assert link == LinkInfo(str(b.peer_id), "relayed", f"/p2p/{relay.peer_id}/p2p-circuit/p2p/{b.peer_id}",
                                    str(relay.peer_id))
            stream = await _roundtrip(a, b.peer_id, b"frame through the relay" * 100)
            assert str(stream_link(stream)) == f"relayed via {relay.peer_id}"
            back = b_t.link(a.peer_id)
            assert back is not None and str(back) == f"relayed via {relay.peer_id}"  # stock labels it "via B"

            # A dial-back request that arrives through a relay is refused: the server would see the relay's address.
            await stack.enter_async_context(serve_dialback(a.host))
            report = await check_reachability(b.host, [PeerInfo(a.peer_id, [])], timeout_s=5.0)
            assert report.status is Reachability.UNKNOWN
            assert any("relayed" in e for e in report.errors), report.errors

    trio.run(main)


def test_reservation_is_refreshed_before_it_expires_and_after_the_relay_connection_drops() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, b, b_t = await _relay_and(stack, ttl=2)
            assert b_t.relay_client is not None
            first = b_t.relay_client.reservations[0]
            await trio.sleep(3.5)  # beyond the 2 s lifetime of the first grant
            assert b_t.relay_client.refreshes >= 2
            (now,) = b_t.relay_client.reservations
            assert now.expires_at > first.expires_at and now.valid()
            a_t = Traversal(TraversalConfig(reachability="public"))
            await _node(stack, a_t)
            link = await a_t.connect(b.peer_id, list(now.circuit_addrs))  # the relay still knows B
            assert link.relay_id == str(relay.peer_id)

            # The relay connection drops: the keeper reconnects at its next refresh and B stays reachable.
            for conn in b.connections(relay.peer_id):
                await conn.close()
            before = b_t.relay_client.refreshes
            with trio.fail_after(5):
                while b_t.relay_client.refreshes == before or not b.connections(relay.peer_id):
                    await trio.sleep(0.05)
            assert b_t.relay_client.reservations and b_t.relay_client.reservations[0].valid()

    trio.run(main)


def test_circuit_to_a_peer_without_reservation_is_refused_with_the_relay_status() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, _, _ = await _relay_and(stack)
            a_t = Traversal(TraversalConfig(reachability="public"))
            await _node(stack, a_t)
            c = await stack.enter_async_context(open_host(config()))
            circuit = circuit_addr(first_addr(relay), relay.peer_id, c.peer_id)
            with pytest.raises(RelayError) as err:
                await a_t.connect(c.peer_id, [circuit])
            assert "204" in str(err.value)  # NO_RESERVATION

    trio.run(main)


def test_a_peer_that_is_no_relay_is_asked_once_not_every_5_s(caplog: pytest.LogCaptureFixture) -> None:
    """examples/trio_app.py: the second peer tried to reserve on the first (its bootstrap, no relay) and warned
    "reservation ... failed ... retrying in 5.0 s" forever."""

    async def main() -> None:
        async with AsyncExitStack() as stack:
            a = await _node(stack, Traversal(TraversalConfig(reachability="public")))  # relay_hop off
            b_t = Traversal(TraversalConfig(reachability="private", hole_punch=False))
            started = trio.current_time()
            b = await _node(stack, b_t, bootstrap_addrs=(first_addr(a),))
            # it used to wait the whole 10 s for a grant that could never come: at least 10 s however fast the
            # machine, and a loaded one does not take 10 s to start a node
            assert trio.current_time() - started < 10.0
            assert b_t.relay_client is not None
            assert b_t.relay_client.not_relays == {str(a.peer_id)}
            assert not b_t.relay_client.reservations and b_t.circuit_addrs() == []
            attempts = []
            real_reserve = b_t.relay_client.reserve

            async def counting_reserve(relay: PeerInfo) -> object:
                attempts.append(relay.peer_id)
                return await real_reserve(relay)

            b_t.relay_client.reserve = counting_reserve  # type: ignore[method-assign]
            await trio.sleep(6.0)  # beyond the 5 s retry
            assert attempts == []
            assert b.connections(a.peer_id)  # the peers still talk; only the reservation is given up

    keepers = ("sangama_p2p.net.relay", "sangama_p2p.net.reservations")
    with caplog.at_level("INFO", logger="sangama_p2p.net"):
        trio.run(main)
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and r.name in keepers]
    assert warnings == []
    assert any("is not a relay" in r.getMessage() for r in caplog.records)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_dialback_tells_reachable_from_unreachable_and_unanswered() -> None:
    async def main() -> None:
        async with AsyncExitStack() as stack:
            server = await stack.enter_async_context(open_host(config()))
            await stack.enter_async_context(serve_dialback(server.host, timeout_s=2.0))
            info = info_from_p2p_addr(Multiaddr(first_addr(server)))
            client = await stack.enter_async_context(open_host(config()))
            mine = first_addr(client).split("/p2p/")[0]
            report = await check_reachability(client.host, [info])
            assert report.status is Reachability.PUBLIC and report.public_addrs == (mine,)
            assert report.answered_by == (str(server.peer_id),)
            closed = await check_reachability(client.host, [info], addrs=[f"/ip4/127.0.0.1/tcp/{_free_port()}"])
            assert closed.status is Reachability.PRIVATE and closed.public_addrs == ()
            # A port that answers with another peer id does not count as ours.
            other = await stack.enter_async_context(open_host(config()))
            impostor = await check_reachability(client.host, [info], addrs=[first_addr(other).split("/p2p/")[0]])
            assert impostor.status is Reachability.PRIVATE
            silent = await stack.enter_async_context(open_host(config()))
            nobody = await check_reachability(
                client.host, [info_from_p2p_addr(Multiaddr(first_addr(silent)))], timeout_s=3.0
            )
            assert nobody.status is Reachability.UNKNOWN and nobody.errors

    trio.run(main)


def test_punch_dials_bind_the_listen_port_even_with_an_announced_address() -> None:
    """Trap 3: stock DCUtR binds the announced (non-local) IP, fails, and dials from an ephemeral port."""

    async def main() -> None:
        port = _free_port()
        async with AsyncExitStack() as stack:
            x = await stack.enter_async_context(
                open_host(config(listen_addrs=(f"/ip4/127.0.0.1/tcp/{port}",),
                                 announce_addrs=(f"/ip4/192.0.2.99/tcp/{port}",)))
            )
            y = await stack.enter_async_context(open_host(config()))
            puncher = HolePuncher(x.host)
            target = Multiaddr(first_addr(y).split("/p2p/")[0])
            await puncher._dial_peer(y.peer_id, target, source=("192.0.2.99", port))  # what stock DCUtR passes
            seen = [c.muxed_conn.get_remote_address() for c in y.connections(x.peer_id)]
            assert ("127.0.0.1", port) in seen, seen

    trio.run(main)


def test_relayed_link_is_upgraded_by_the_side_that_accepted_it() -> None:
    """On loopback the peers can see each other, so DCUtR's step 0 (a plain dial) already gives a direct link."""

    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, b, b_t = await _relay_and(stack, punch=True)
            a_t = Traversal(TraversalConfig(reachability="public"))
            a = await _node(stack, a_t)
            link = await a_t.connect(b.peer_id, [str(x) for x in b_t.circuit_addrs()])
            assert link.relay_id == str(relay.peer_id)
            direct = await a_t.wait_direct(b.peer_id, 10.0)
            assert direct is not None and direct.direct
            assert direct.remote_addr == first_addr(b).split("/p2p/")[0]
            stream = await _roundtrip(a, b.peer_id, b"now direct")
            assert str(stream_link(stream)) == "direct"
            await trio.sleep(2.5)  # py-libp2p's own driver would have started a session from A by now (every 2 s)
            assert b_t.puncher is not None and b_t.puncher.attempts == 1
            assert a_t.puncher is not None and a_t.puncher.attempts == 0

    trio.run(main)


def test_dcutr_step0_is_capped_when_a_known_address_is_a_black_hole() -> None:
    """Trap 2: step 0 dials the peer's known addresses bounded only by ``dial_timeout``; ours gives up after 0.5 s."""

    async def main() -> None:
        hole = trio.socket.socket()
        await hole.bind(("127.0.0.1", 0))
        hole.listen(1)  # the kernel completes the TCP handshake, then nobody ever speaks: a dial hangs
        port = hole.getsockname()[1]
        try:
            async with open_host(config(handshake_timeout=30.0)) as x:
                puncher = HolePuncher(x.host, step0_timeout_s=0.5, dial_timeout_s=30)
                peer = ID.from_pubkey(generate_key_pair().public_key)
                x.host.get_peerstore().add_addrs(peer, [Multiaddr(f"/ip4/127.0.0.1/tcp/{port}")], 60)
                with trio.fail_after(5):
                    assert await puncher._try_unilateral_upgrade(peer) is False
        finally:
            hole.close()

    trio.run(main)
