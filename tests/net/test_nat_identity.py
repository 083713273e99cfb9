"""Identity and liveness (issue 15, item 6), over loopback: a second peer on a key file already in use is refused
naming the file; a wrong ``/p2p/<id>`` in a bootstrap address is named as such (not as a fleet-secret mismatch);
records past their own expiry leave every DHT server's store (py-libp2p keeps every value for its own 24 h).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import trio

from sangama_p2p.errors import NetworkError
from sangama_p2p.net import dht as dht_module
from sangama_p2p.net.discovery import ServingOffer, publish
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import KeyInUse, generate_key_pair, peer_id_of
from sangama_p2p.net import dht_store
from sangama_p2p.net.directory import directory_key

from .net_swarm import config, first_addr, swarm


def test_a_second_peer_on_a_key_file_in_use_is_refused_naming_the_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    key = tmp_path / "peer.key"

    async def main() -> None:
        with trio.fail_after(30):
            async with open_host(config(key_path=key)) as first:
                with pytest.raises(KeyInUse, match=str(key)):
                    async with open_host(config(key_path=key)):
                        pass
                assert first.host.get_network().listeners  # the first one runs on
            async with open_host(config(key_path=key)) as again:  # released when the first stopped
                assert again.peer_id == first.peer_id

    trio.run(main)


def test_a_wrong_peer_id_in_a_bootstrap_address_is_named_as_such() -> None:
    async def main() -> None:
        with trio.fail_after(30):
            async with swarm(1) as (boot,):
                wrong = peer_id_of(generate_key_pair())
                addr = first_addr(boot).rsplit("/p2p/", 1)[0] + f"/p2p/{wrong}"
                with pytest.raises(NetworkError) as caught:
                    async with open_host(config(bootstrap_addrs=(addr,))):
                        pass
                text = str(caught.value)
                assert f"answered as peer {boot.peer_id}, not {wrong}" in text, text
                assert "fleet secret" not in text

    trio.run(main)


def test_records_past_their_expiry_leave_every_dht_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The record lives 60 s; once it is stored, the DHT store's clock (only dht_store.py's) is moved 120 s on, so it expires
    then, not while a loaded machine is still publishing it (a 2 s ttl did: issue 22 item 4)."""
    monkeypatch.setattr(dht_module, "SWEEP_S", 0.2)
    offer = ServingOffer("m", 0, 1, ttl=60.0, fingerprint="ab" * 16, num_layers=1)

    async def main() -> None:
        with trio.fail_after(60):
            async with swarm(3) as nodes:
                author = nodes[-1]
                await publish(author, offer, seq=1)
                await publish(author, ServingOffer("n", 0, 1, ttl=3600.0, fingerprint="ab" * 16, num_layers=1), seq=2)
                key, lasting = (directory_key(m, 0).encode() for m in ("m", "n"))  # the records' directories
                holders = [n for n in nodes if n.dht is not None and key in n.dht.value_store.store]
                assert len(holders) >= 2, "the record was stored on the other DHT servers"
                for n in holders:  # what py-libp2p alone would do: keep it for its own 24 h, whatever it says
                    assert n.dht.value_store.store[key][1] - time.time() > 23 * 3600
                monkeypatch.setattr(dht_store, "clock", SimpleNamespace(wall=lambda: time.time() + 120))
                deadline = time.monotonic() + 30  # sweeps every 0.2 s: a bound against a hang, not a timing
                while any(key in n.dht.value_store.store for n in holders) and time.monotonic() < deadline:
                    await trio.sleep(0.1)
                assert not [n.peer_id for n in holders if key in n.dht.value_store.store]
                assert all(lasting in n.dht.value_store.store for n in holders)  # a live record stays

    trio.run(main)
