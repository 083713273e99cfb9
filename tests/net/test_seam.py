"""The seam of issue 25: the network code reads time through ``sangama_p2p.clock``, so under trio's MockClock
(what a simulation of a swarm runs) records expire, bans lift, backoffs end and idle sessions are freed in simulated
time - an hour of it here in well under a second of the machine's."""

from __future__ import annotations

import time

import pytest
import trio
import trio.testing

from sangama_p2p import clock
from sangama_p2p.errors import RecordError
from sangama_p2p.net.backoff import DialBackoff
from sangama_p2p.net.bans import BanList
from sangama_p2p.net.directory import merge_entries
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.records import decode_record, record_key, sign_record

FP = "ab" * 16


def _run_mocked(fn) -> float:
    """Run ``fn`` under a MockClock that jumps whenever every task waits; the machine's seconds it took."""
    t0 = time.perf_counter()
    trio.run(fn, clock=trio.testing.MockClock(autojump_threshold=0))
    return time.perf_counter() - t0


def test_records_bans_and_backoffs_follow_the_simulated_clock_for_an_hour():
    key = generate_key_pair()
    seen: dict[str, object] = {}

    async def main():
        with clock.virtual_wall(1_000_000.0):
            assert clock.wall() == 1_000_000.0 and clock.now() == trio.current_time()
            signed = sign_record(key, model_id="m", start=0, end=4, throughput=1.0, free_sessions=1,
                                 addrs=["/ip4/127.0.0.1/tcp/1"], ttl=600.0, seq=1, fingerprint=FP, num_layers=8)
            assert signed.record.expires_at == 1_000_600.0
            rk = record_key("m", signed.record.peer_id)
            decode_record(rk, signed.value)  # valid now
            bans, backoff = BanList(), DialBackoff()
            bans.ban("liar", "lied", duration=1800.0)
            backoff.failed("gone")
            assert "liar" in bans.banned() and backoff.wait_s("gone") > 0
            await clock.sleep(601.0)
            with pytest.raises(RecordError, match="expired"):
                decode_record(rk, signed.value)
            assert merge_entries({}, [(signed.record, signed.value)]) == {}  # a directory drops it
            assert backoff.wait_s("gone") == 0.0 and "liar" in bans.banned()
            await clock.sleep(1200.0)
            assert not bans.banned()
            await clock.sleep(3600.0 - 1801.0)
            seen["wall"] = clock.wall()
        assert abs(clock.wall() - time.time()) < 5  # outside it, the machine's wall again

    took = _run_mocked(main)
    assert seen["wall"] == 1_000_000.0 + 3600.0 and took < 5.0, (seen, took)


def test_the_libp2p_node_is_the_network_that_client_and_stage_hold():
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.seam import Network

    from .net_swarm import config

    async def main():
        async with open_host(config(), key_pair=generate_key_pair()) as node:
            assert isinstance(node, Network) and node.dht is not None

    trio.run(main)
    assert not isinstance(object(), Network)
