"""net/dial.py: the dial order and the happy-eyeballs race (a dead address costs one stagger step, not the budget).
The races run on trio's MockClock, so their timings are exact, not measured."""

from __future__ import annotations

import pytest
import trio
from trio.testing import MockClock

from sangama_p2p.errors import NetworkError
from sangama_p2p.net.dial import Attempt, DialPolicy, plan, race

PEER = "12D3KooWNWm2vGRbUKoGtBT95xCAvMd9fNU8YP8wLQNzV5deNhFP"
OTHER = "12D3KooWBoFgERn9heHsZzeFa1Pts8vBdmxjEp9YLe8TZEstsBBx"
CIRCUIT = f"/ip4/198.18.0.1/tcp/4001/p2p/{OTHER}/p2p-circuit/p2p/{PEER}"


def test_plan_orders_announced_observed_private_circuit_and_drops_duplicates() -> None:
    attempts = plan([CIRCUIT, "/ip4/198.19.1.2/tcp/4001", f"/ip4/203.0.113.5/tcp/4001/p2p/{PEER}"],
                    ["/ip4/198.18.0.11/tcp/4001", "/ip4/203.0.113.5/tcp/4001", "/ip4/127.0.0.1/tcp/4001",
                     f"/ip4/198.18.0.1/tcp/4001/p2p/{OTHER}/p2p-circuit/p2p/{OTHER}"], PEER)
    assert [(a.kind, a.addr) for a in attempts] == [
        ("announced", "/ip4/198.19.1.2/tcp/4001"),  # 198.18/15 is the benchmark range: public on purpose
        ("announced", "/ip4/203.0.113.5/tcp/4001"),  # the given order holds within a class
        ("observed", "/ip4/198.18.0.11/tcp/4001"),
        ("private", "/ip4/127.0.0.1/tcp/4001"),
        ("circuit", CIRCUIT),  # the circuit to another destination is gone
    ]
    assert attempts[-1].timeout_s == DialPolicy().circuit_timeout_s


def test_policy_refuses_nonsense() -> None:
    with pytest.raises(NetworkError):
        DialPolicy(direct_timeout_s=0)


def test_a_silent_address_costs_one_stagger_step_and_the_next_one_wins() -> None:
    started: dict[str, float] = {}

    async def dial_one(attempt: Attempt) -> object:
        started[attempt.addr] = trio.current_time()
        if attempt.addr == "dead":
            await trio.sleep_forever()  # a NAT dropping SYNs
        await trio.sleep(0.05)
        return attempt.addr

    async def main() -> None:
        t0 = trio.current_time()
        conn = await race([Attempt("dead", "announced", 3.0), Attempt("live", "circuit", 10.0)], dial_one,
                          stagger_s=0.25, peer=PEER)
        assert conn == "live"
        assert started["live"] - t0 == pytest.approx(0.25)  # one stagger step after the dead one
        assert trio.current_time() - t0 == pytest.approx(0.30)  # the dead attempt was cancelled, not waited for

    trio.run(main, clock=MockClock(autojump_threshold=0))  # virtual time: exact however busy the machine is


def test_a_refused_address_starts_the_next_at_once_and_all_failures_are_named() -> None:
    async def dial_one(attempt: Attempt) -> object:
        if attempt.addr == "slow":
            await trio.sleep_forever()
        raise NetworkError(f"{attempt.addr}: connection refused")

    async def main() -> None:
        t0 = trio.current_time()
        with pytest.raises(NetworkError) as err:
            await race([Attempt("a", "announced", 3.0), Attempt("b", "observed", 3.0),
                        Attempt("slow", "private", 0.5)], dial_one, stagger_s=1.0, peer=PEER)
        assert "a: connection refused" in str(err.value) and "slow: no answer in 0.5 s" in str(err.value)
        assert trio.current_time() - t0 == pytest.approx(0.5)  # refusals did not wait out the 1 s stagger

    trio.run(main, clock=MockClock(autojump_threshold=0))


def test_one_failure_keeps_its_type() -> None:
    class Typed(NetworkError):
        pass

    async def dial_one(attempt: Attempt) -> object:
        raise Typed("status 204")

    with pytest.raises(Typed):
        trio.run(lambda: race([Attempt("x", "circuit", 1.0)], dial_one, stagger_s=0.1))
    with pytest.raises(NetworkError, match="no address known"):
        trio.run(lambda: race([], dial_one, stagger_s=0.1))
