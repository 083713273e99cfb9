"""Reachability, relays and hole punching through real Linux NATs in network namespaces (see ``netns.py``).

One lab per module: a relay/bootstrap node and a public peer on the WAN bridge, peer A behind NAT A, peer B behind
NAT B. B also announces its NAT's WAN address (as an operator who set ``announce_addrs`` without a port forward
would): that is the configuration in which stock py-libp2p 0.8.1 hole punching silently fails (trap 3).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from libp2p.peer.id import ID

from sangama_p2p.net.holepunch import PUNCH_RETRY_S
from sangama_p2p.net.identity import generate_key_pair, save_key_pair

from .netns import LAN_IPS, NAT_WAN_IPS, PUBLIC_IP, RELAY_IP, Agent, NatLab, netns_unavailable_reason

_REASON = netns_unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.skipif(_REASON is not None, reason=f"NAT lab unavailable: {_REASON}"),
]

RELAY_PORT, PUBLIC_PORT, A_PORT, B_PORT = 4001, 4002, 4101, 4102


@dataclass
class Fleet:
    lab: NatLab
    relay: Agent
    pub: Agent
    a: Agent
    b: Agent

    @property
    def bootstrap(self) -> str:
        return f"/ip4/{RELAY_IP}/tcp/{RELAY_PORT}/p2p/{self.relay.endpoint.peer_id}"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    key_file = tmp_path_factory.mktemp("relay") / "relay.key"
    key = generate_key_pair()
    save_key_pair(key, key_file)  # the relay's id is known before it starts, so all four peers start at once
    boot = f"/ip4/{RELAY_IP}/tcp/{RELAY_PORT}/p2p/{ID.from_pubkey(key.public_key)}"
    with NatLab() as lab:
        relay = lab.spawn("relay", "relay", "--port", str(RELAY_PORT), "--relay", "--key", str(key_file))
        pub = lab.spawn("pub", "pub", "--port", str(PUBLIC_PORT), "--bootstrap", boot)
        a = lab.spawn("a", "priva", "--port", str(A_PORT), "--bootstrap", boot)
        b = lab.spawn(
            "b", "privb", "--port", str(B_PORT), "--bootstrap", boot,
            "--announce", f"/ip4/{NAT_WAN_IPS['b']}/tcp/{B_PORT}",
        )
        for agent in (relay, pub, a, b):
            _ = agent.endpoint  # wait for each to be ready
        yield Fleet(lab, relay, pub, a, b)


def test_public_peer_learns_it_is_reachable_private_ones_that_they_are_not(fleet: Fleet) -> None:
    pub = fleet.pub.call("info")
    assert pub["reachability"] == "public", pub
    assert pub["public_addrs"] == [f"/ip4/{PUBLIC_IP}/tcp/{PUBLIC_PORT}"]
    assert pub["reservations"] == []  # a reachable peer needs no relay
    relay_id = fleet.relay.endpoint.peer_id
    for agent in (fleet.a, fleet.b):
        info = agent.call("info")
        assert info["reachability"] == "private", info
        assert info["public_addrs"] == []
        assert [r["relay_id"] for r in info["reservations"]] == [relay_id]
        me = agent.endpoint.peer_id
        circuit = f"/ip4/{RELAY_IP}/tcp/{RELAY_PORT}/p2p/{relay_id}/p2p-circuit/p2p/{me}"
        assert circuit in info["circuit_addrs"]
        assert circuit in info["addrs"], info["addrs"]  # advertised intact (records, status), not mangled


def test_private_peers_cannot_dial_each_other_directly(fleet: Fleet) -> None:
    b = fleet.b.endpoint.peer_id
    wan = fleet.a.call("dial_direct", peer_id=b, addrs=[f"/ip4/{NAT_WAN_IPS['b']}/tcp/{B_PORT}"], limit=2.0)
    assert not wan["connected"]
    assert wan["elapsed"] >= 1.9  # NAT B drops the SYN: the dial times out rather than being refused
    lan = fleet.a.call("dial_direct", peer_id=b, addrs=[f"/ip4/{LAN_IPS['b']}/tcp/{B_PORT}"], limit=2.0)
    assert not lan["connected"]
    assert fleet.a.call("link", peer_id=b)["link"] is None


def test_relayed_link_is_upgraded_to_direct_by_hole_punching(fleet: Fleet) -> None:
    a, b = fleet.a.endpoint.peer_id, fleet.b.endpoint.peer_id
    relay_id = fleet.relay.endpoint.peer_id
    circuits = fleet.b.call("info")["circuit_addrs"]
    link = fleet.a.call("connect", peer_id=b, addrs=[f"/ip4/{NAT_WAN_IPS['b']}/tcp/{B_PORT}", *circuits])["link"]
    assert link["kind"] == "relayed" and link["text"] == f"relayed via {relay_id}"

    direct = fleet.a.call("wait_direct", peer_id=b, limit=20.0)["link"]
    assert direct is not None, fleet.b.stderr_tail()
    # The new connection goes to NAT B's public address and B's listen port, not to the relay.
    assert direct["remote_addr"] == f"/ip4/{NAT_WAN_IPS['b']}/tcp/{B_PORT}"
    echo = fleet.a.call("echo", peer_id=b, count=20, size=4096)
    assert echo["link"]["text"] == "direct"
    assert echo["link"]["remote_addr"] == direct["remote_addr"]
    back = fleet.b.call("link", peer_id=a)["link"]
    assert back["kind"] == "direct" and back["remote_addr"] == f"/ip4/{NAT_WAN_IPS['a']}/tcp/{A_PORT}"
    assert fleet.b.call("info")["punches"] == 1  # only B, which accepted the relayed link, drove DCUtR
    assert fleet.a.call("info")["punches"] == 0

    # The direct link dies (NAT timeout, network change): the next connect falls back to the relay, and B punches again.
    assert fleet.a.call("drop", peer_id=b)["closed"] >= 1
    again = fleet.a.call("connect", peer_id=b, addrs=[f"/ip4/{NAT_WAN_IPS['b']}/tcp/{B_PORT}", *circuits])["link"]
    assert again["text"] == f"relayed via {relay_id}"
    fleet.a.call("echo", peer_id=b, count=5, size=4096)  # frames flow (the agent checks every echo)
    assert fleet.a.call("wait_direct", peer_id=b, limit=20.0)["link"] is not None


def test_relayed_link_carries_frames_and_keeps_them_flowing_when_hole_punching_is_blocked(fleet: Fleet) -> None:
    fleet.lab.block_between_nats()
    relay_id = fleet.relay.endpoint.peer_id
    c = fleet.lab.spawn("c", "priva", "--port", "4201", "--bootstrap", fleet.bootstrap)
    d = fleet.lab.spawn("d", "privb", "--port", "4202", "--bootstrap", fleet.bootstrap)
    dest = d.endpoint.peer_id
    link = c.call("connect", peer_id=dest, addrs=d.call("info")["circuit_addrs"])["link"]
    assert link["text"] == f"relayed via {relay_id}"
    first = c.call("echo", peer_id=dest, count=10, size=4096)
    assert first["link"]["text"] == f"relayed via {relay_id}"
    assert c.call("wait_direct", peer_id=dest, limit=6.0)["link"] is None  # the punch cannot get through
    assert 1 <= d.call("info")["punches"] <= 1 + len(PUNCH_RETRY_S)  # tried again while relayed, a bounded number
    again = c.call("echo", peer_id=dest, count=10, size=4096)
    assert again["link"]["text"] == f"relayed via {relay_id}"
    assert d.call("link", peer_id=c.endpoint.peer_id)["link"]["text"] == f"relayed via {relay_id}"
