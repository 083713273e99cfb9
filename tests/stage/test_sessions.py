"""The session table alone: ownership, validation of OpenSession, memory accounting. No network."""

from __future__ import annotations

import pytest

from sangama_p2p.errors import ErrorCode, StageError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel
from sangama_p2p.stage.config import StageConfig
from sangama_p2p.stage.sessions import SessionTable
from sangama_p2p.wire.messages import OpenSession

MODEL = "m"


def _open(sid: bytes, *, client="A", model=MODEL, start=0, end=4, next_hop="B", prev_hop=None, length=32, guesses=0,
          fingerprint=None):
    return OpenSession(sid, model, start, end, next_hop, prev_hop, client, length, 0.0, 1.0, 0, guesses, False,
                       fingerprint=fingerprint)


@pytest.fixture(scope="module")
def stages(ckpt):
    c = open_checkpoint(ckpt)
    return StageModel.load(c.spec, c.source, 0, 4), StageModel.load(c.spec, c.source, 4, 8)


def _code(fn) -> ErrorCode:
    with pytest.raises(StageError) as info:
        fn()
    return info.value.code


def test_open_validates_every_field_with_a_code(stages):
    first, last = stages
    t = SessionTable(first, StageConfig(MODEL, 0, 4, max_guesses=4))
    sid = bytes(16)
    assert _code(lambda: t.open(_open(sid, client="A"), "M", None)) == ErrorCode.NOT_OWNER  # claims another id
    assert _code(lambda: t.open(_open(sid, model="other"), "A", None)) == ErrorCode.WRONG_MODEL
    assert _code(lambda: t.open(_open(sid, start=0, end=3), "A", None)) == ErrorCode.WRONG_MODEL
    assert _code(lambda: t.open(_open(sid, next_hop=None), "A", None)) == ErrorCode.BAD_FRAME
    assert _code(lambda: t.open(_open(sid, prev_hop="S0"), "A", None)) == ErrorCode.BAD_FRAME  # first: client only
    assert _code(lambda: t.open(_open(sid, guesses=5), "A", None)) == ErrorCode.TOO_MANY_GUESSES
    assert _code(lambda: t.open(_open(sid, length=10**6), "A", None)) == ErrorCode.CAPACITY
    assert not t.sessions and t.used_bytes == 0
    s = t.open(_open(sid, guesses=2), "A", "reply")
    assert s.owner == "A" and s.reply == "reply" and s.decoder is None and s.state.ring == 3
    assert t.used_bytes == first.session_bytes(32, 3) == s.nbytes
    assert _code(lambda: t.open(_open(sid), "A", None)) == ErrorCode.BAD_FRAME  # already open
    assert _code(lambda: t.open(_open(sid, client="C"), "C", None)) == ErrorCode.NOT_OWNER  # someone else's id
    lt = SessionTable(last, StageConfig(MODEL, 4, 8))
    assert _code(lambda: lt.open(_open(sid, start=4, end=8), "A", None)) == ErrorCode.BAD_FRAME  # last: no hop
    d = lt.open(_open(sid, start=4, end=8, next_hop=None, guesses=2), "A", None).decoder
    assert d is not None and d.policy.max_guesses == 2


def test_a_session_for_another_checkpoint_is_refused(stages):
    first, _ = stages
    mine, other = "aa" * 16, "bb" * 16
    t = SessionTable(first, StageConfig(MODEL, 0, 4), mine)
    assert _code(lambda: t.open(_open(bytes(16), fingerprint=other), "A", None)) == ErrorCode.WRONG_MODEL
    with pytest.raises(StageError, match=f"serves checkpoint {mine}, not {other}"):
        t.open(_open(bytes(16), fingerprint=other), "A", None)
    assert not t.sessions
    t.open(_open(bytes(16), fingerprint=mine), "A", None)  # its own, or none given (an older client's library)
    t.open(_open(b"\x01" * 16), "A", None)
    assert len(t.sessions) == 2


def test_only_the_owner_or_the_upstream_it_named_may_step_or_close(stages):
    first, last = stages
    t = SessionTable(first, StageConfig(MODEL, 0, 4))
    sid = b"\x01" * 16
    t.open(_open(sid), "A", None)
    assert t.authorize_step(sid, "A").owner == "A"
    assert _code(lambda: t.authorize_step(sid, "B")) == ErrorCode.NOT_OWNER  # first stage: owner only
    assert _code(lambda: t.authorize_step(b"\x02" * 16, "A")) == ErrorCode.UNKNOWN_SESSION
    assert _code(lambda: t.close(sid, "B")) == ErrorCode.NOT_OWNER
    lt = SessionTable(last, StageConfig(MODEL, 4, 8))
    lt.open(_open(sid, start=4, end=8, next_hop=None, prev_hop="S1"), "A", None)
    # a peer that knows the session id (every stage of the chain does) cannot feed it, not even before the upstream
    # has sent anything (wire version 1 bound the first peer that did)
    assert _code(lambda: lt.authorize_step(sid, "M")) == ErrorCode.NOT_OWNER
    assert _code(lambda: lt.close(sid, "M")) == ErrorCode.NOT_OWNER
    assert lt.authorize_step(sid, "S1").upstream == "S1"
    assert lt.authorize_step(sid, "S1") is lt.authorize_step(sid, "A")
    assert _code(lambda: lt.authorize_step(sid, "M")) == ErrorCode.NOT_OWNER
    other = b"\x03" * 16  # a later stage opened without an upstream: the client alone steps it
    lt.open(_open(other, start=4, end=8, next_hop=None), "A", None)
    assert lt.authorize_step(other, "A").owner == "A"
    assert _code(lambda: lt.authorize_step(other, "S1")) == ErrorCode.NOT_OWNER
    lt.close(sid, "S1")
    assert sid not in lt.sessions
    t.close(sid, "A")
    assert not t.sessions and t.used_bytes == 0


def test_memory_budget_refuses_new_sessions_and_frees_on_close(stages):
    first, _ = stages
    one = first.session_bytes(64, 0)
    t = SessionTable(first, StageConfig(MODEL, 0, 4, memory_budget=int(2.5 * one), typical_session_length=64))
    assert t.free_sessions == 2
    a = t.open(_open(b"a" * 16, length=64), "A", "ra")
    t.open(_open(b"b" * 16, length=64), "A", "rb")
    assert t.free_sessions == 0
    assert _code(lambda: t.open(_open(b"c" * 16, length=64), "A", "rc")) == ErrorCode.CAPACITY
    assert set(t.sessions) >= {b"a" * 16, b"b" * 16}
    dropped = t.drop_reply_stream("ra")  # the owner's stream ended
    assert dropped == [a] and a.closed
    assert t.open(_open(b"d" * 16, length=64), "A", "rd")
    cap = SessionTable(first, StageConfig(MODEL, 0, 4, max_sessions=1))
    cap.open(_open(b"a" * 16), "A", None)
    assert _code(lambda: cap.open(_open(b"b" * 16), "A", None)) == ErrorCode.CAPACITY


def test_trip_clock_times_only_steady_decode_trips():
    from sangama_p2p.stage.sessions import TripClock

    c = TripClock()
    assert c.lap(0, 6, 0, 0, now=1.0) is None  # the prefill (positions 0..5): nothing before it
    assert c.lap(6, 1, 0, 0, now=1.5) is None  # the first decode step: its cycle is only the reference
    assert c.lap(7, 1, 0, 0, now=1.9) == pytest.approx(0.4)  # a trip: the end of step 7 minus the end of step 6
    assert c.lap(8, 3, 2, 1, now=2.4) == pytest.approx(0.5)  # 2 guesses, 1 kept: the next step starts at 10
    assert c.lap(9, 1, 0, 0, now=2.8) is None  # does not continue (start 9, not 10): a rollback or replay
    assert c.lap(10, 1, 0, 0, now=3.2) is None  # continues, but has no cycle before it to compare with
    assert c.lap(11, 1, 0, 0, now=3.5) == pytest.approx(0.3)
    assert c.lap(12, 1, 0, 0, now=3.5 + 5.0) is None  # 5 s after a 0.3 s cycle: a pause, not a trip
    assert c.lap(13, 1, 0, 0, now=8.5 + 4.0) == pytest.approx(4.0)  # a lasting slowdown counts from the next cycle
    assert c.lap(14, 4, 0, 0, now=13.0) is None  # a prefill chunk (a chat's next turn) ...
    assert c.lap(18, 1, 0, 0, now=13.3) is None  # ... and the first decode step after it
    assert c.lap(19, 1, 0, 0, now=13.6) == pytest.approx(0.3)


def test_the_keys_of_one_address_share_its_quota_and_its_network_twice_that(stages):
    """Issue 26: four fresh keys from one host held a stage's every session; keys are free, addresses are not."""
    from sangama_p2p.net.addrs import source_keys

    first, _ = stages
    t = SessionTable(first, StageConfig(MODEL, 0, 4, max_sessions=16))
    assert (t.config.sessions_per_address, t.config.sessions_per_network) == (4, 8)
    here = source_keys("198.18.0.7")
    assert here == ("address 198.18.0.7", "network 198.18.0.0/24")
    n = 0

    def open_as(peer, source):
        nonlocal n
        n += 1
        return t.open(_open(n.to_bytes(16, "big"), client=peer), peer, None, source=source)

    held = [open_as(f"sybil{i}", here) for i in range(4)]  # one session per key: under every per-peer quota
    with pytest.raises(StageError, match="per-address quota: 198.18.0.7 already holds 4") as info:
        open_as("sybil4", here)  # a fifth key from the same address
    assert info.value.code == ErrorCode.CAPACITY
    neighbours = [open_as(f"n{i}", source_keys(f"198.18.0.{20 + i}")) for i in range(4)]  # the same /24: 8 in all
    with pytest.raises(StageError, match="per-network quota: 198.18.0.0/24"):
        open_as("n9", source_keys("198.18.0.99"))
    open_as("far", source_keys("198.19.5.5"))  # another network is not affected
    open_as("local", source_keys("127.0.0.1"))  # loopback: the stage's own machine, counted by peer id only
    t.close(held[0].session_id, "sybil0")  # a freed session frees its place at the address and the network
    open_as("sybil4", here)
    assert t.per_source["address 198.18.0.7"] == 4 and t.per_source["network 198.18.0.0/24"] == 8
    for s in neighbours:
        t.close(s.session_id, s.owner)
    assert t.per_source["network 198.18.0.0/24"] == 4


def test_source_keys_of_addresses():
    from sangama_p2p.net.addrs import source_keys

    assert source_keys("2001:db8:1:2:3:4:5:6") == ("address 2001:db8:1:2:3:4:5:6", "network 2001:db8:1:2::/64")
    assert source_keys("::ffff:198.18.0.7") == source_keys("198.18.0.7")  # a v4-mapped address is its v4
    assert source_keys("127.0.0.1") == source_keys("::1") == source_keys(None) == source_keys("not an ip") == ()


def test_each_peer_is_held_to_its_quota_and_idle_sessions_expire(stages):
    first, _ = stages
    t = SessionTable(first, StageConfig(MODEL, 0, 4, max_sessions=8, session_idle_s=10.0))
    assert t.config.sessions_per_peer == 2
    a1, a2 = t.open(_open(b"1" * 16), "A", None), t.open(_open(b"2" * 16), "A", None)
    with pytest.raises(StageError, match="per-peer quota") as info:
        t.open(_open(b"3" * 16), "A", None)
    assert info.value.code == ErrorCode.CAPACITY
    b1 = t.open(_open(b"4" * 16, client="B"), "B", None)  # another peer is not affected
    t.close(a1.session_id, "A")
    a3 = t.open(_open(b"3" * 16), "A", None)  # a freed session frees its place in the quota
    assert t.per_peer == {"A": 2, "B": 1}
    now = a3.last_active
    a2.last_active = b1.last_active = now - 10.0
    assert {s.session_id for s in t.expire_idle(now + 0.5)} == {a2.session_id, b1.session_id}
    assert set(t.sessions) == {a3.session_id} and t.per_peer == {"A": 1}
    assert t.used_bytes == a3.nbytes
    assert _code(lambda: t.authorize_step(b1.session_id, "B")) == ErrorCode.EXPIRED
    assert _code(lambda: t.authorize_step(b"9" * 16, "B")) == ErrorCode.UNKNOWN_SESSION
    t.authorize_step(a3.session_id, "A")  # a step keeps a session alive
    assert t.expire_idle(now + 9.5) == [] and t.sessions
    with pytest.raises(StageError):
        StageConfig(MODEL, 0, 4, session_idle_s=0)


def test_an_unset_memory_budget_comes_from_the_device(stages):
    """Issue 30, item 3: the budget was a fixed 1 GiB, on a 96 GB card too. Unset, a CPU stage keeps 1 GiB and a
    CUDA stage takes 90% of the device's free memory once its weights are loaded (tests/model/test_device.py)."""
    from sangama_p2p.stage.config import CPU_MEMORY_BUDGET, default_memory_budget

    first, _ = stages
    assert SessionTable(first, StageConfig(MODEL, 0, 4)).memory_budget == CPU_MEMORY_BUDGET == default_memory_budget("cpu")
    assert SessionTable(first, StageConfig(MODEL, 0, 4, memory_budget=12345)).memory_budget == 12345
    with pytest.raises(StageError, match="memory_budget must be positive"):
        StageConfig(MODEL, 0, 4, memory_budget=0)


def test_idle_sessions_expire_in_simulated_time(stages):
    """The clock seam (issue 25): a session's idle time is read on ``sangama_p2p.clock``, the trio run's clock, so
    under a MockClock a session idle for ``session_idle_s`` simulated seconds is freed, and a stepped one is not."""
    import trio
    import trio.testing

    from sangama_p2p import clock

    first, _ = stages

    async def main():
        t = SessionTable(first, StageConfig(MODEL, 0, 4, max_sessions=8, session_idle_s=600.0))
        idle, busy = t.open(_open(b"1" * 16), "A", None), t.open(_open(b"2" * 16), "A", None)
        for _ in range(4):
            await clock.sleep(200.0)
            t.authorize_step(busy.session_id, "A")
            t.expire_idle()
        assert set(t.sessions) == {busy.session_id} and idle.session_id in t.expired

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
