"""Private fleets: members with the secret connect; a wrong or missing secret fails fast with a clear error."""

from __future__ import annotations

import time

import pytest
import trio

from sangama_p2p.errors import ListenError, NetworkError
from sangama_p2p.net.fleet import psk_from_secret, read_fleet_secret
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair, peer_id_of

from .net_swarm import config, first_addr

SECRET = b"correct horse battery staple 42"


def test_members_connect_and_strangers_are_refused_within_seconds():
    async def main():
        with trio.fail_after(40):
            async with open_host(config(fleet_secret=SECRET, handshake_timeout=2.0)) as boot:
                boot_addr = first_addr(boot)
                async with open_host(config(fleet_secret=SECRET, bootstrap_addrs=(boot_addr,))) as member:
                    assert boot.peer_id in member.host.get_connected_peers()
                strangers = []
                for wrong in (b"a different secret, same length", None):
                    key_pair = generate_key_pair()
                    strangers.append(peer_id_of(key_pair))
                    start = time.monotonic()
                    with pytest.raises(NetworkError, match="fleet secret mismatch"):
                        async with open_host(
                            config(fleet_secret=wrong, bootstrap_addrs=(boot_addr,), handshake_timeout=2.0),
                            key_pair=key_pair,
                        ):
                            pass
                    assert time.monotonic() - start < 20.0  # refused, not retried until the 40 s guard
                connected = boot.host.get_connected_peers()
                assert not any(s in connected for s in strangers)  # nobody without the secret got in

    trio.run(main)


def test_secret_file_and_key_derivation(tmp_path):
    path = tmp_path / "fleet.secret"
    path.write_bytes(SECRET + b"\n")
    assert read_fleet_secret(path) == SECRET
    assert len(psk_from_secret(SECRET)) == 64 and psk_from_secret(SECRET) != psk_from_secret(SECRET + b"x")
    path.write_bytes(b"short\n")
    with pytest.raises(NetworkError, match="too short"):
        read_fleet_secret(path)
    with pytest.raises(NetworkError, match="cannot read"):
        read_fleet_secret(tmp_path / "absent")


@pytest.mark.parametrize("addr", ["/ip4/127.0.0.1/udp/0/quic-v1", "/ip4/127.0.0.1/tcp/0/ws"])
def test_a_private_fleet_refuses_transports_the_secret_does_not_cover(addr):
    """Issue 15, item 3: a private-fleet node on QUIC (py-libp2p's own TLS, no private-network layer) let in a node
    without the secret. Such an address is now refused at start, before anything listens."""

    async def main():
        with pytest.raises(ListenError, match="private fleet: only plain TCP"):
            async with open_host(config(fleet_secret=SECRET, listen_addrs=("/ip4/127.0.0.1/tcp/0", addr))):
                pass

    trio.run(main)
