"""The input budget of partial frames (issue 23, item 2): bytes are counted as they arrive, never from a length
prefix alone; one peer's share is capped; a partial frame has a deadline (a fake clock here, no waiting)."""

from __future__ import annotations

import struct

import pytest
import trio

from sangama_p2p.errors import BufferBudgetError, ErrorCode, WireError
from sangama_p2p.net.streams import FramedStream, memory_stream_pair
from sangama_p2p.wire.codec import encode_message_frame
from sangama_p2p.wire.framing import ByteBudget, FrameDecoder, encode_frame
from sangama_p2p.wire.messages import InfoRequest


def _prefix(n: int) -> bytes:
    return struct.pack(">I", n)


def test_length_prefixes_alone_hold_nothing_and_a_frame_split_in_reads_still_fits():
    budget = ByteBudget(1000)
    liars = [FrameDecoder(10_000, budget) for _ in range(4)]
    for d in liars:  # each announces the whole budget and sends nothing more (the old code reserved it all)
        assert d.feed(_prefix(996)) == []
    assert budget.used == 0
    legit = FrameDecoder(10_000, budget)
    frame = encode_frame(b"p" * 900)
    got = []
    for i in range(0, len(frame), 100):  # a WAN: the frame comes in nine reads
        got += legit.feed(frame[i:i + 100])
        assert budget.used == legit.reserved == (0 if got else legit.buffered)
    assert got == [b"p" * 900] and budget.used == 0 and budget.peak == 896


def test_a_partial_frame_holds_exactly_what_it_has_buffered_and_gives_it_back():
    budget = ByteBudget(1000)
    a, b = FrameDecoder(10_000, budget), FrameDecoder(10_000, budget)
    whole = encode_frame(b"x" * 900)
    assert a.feed(whole) == [b"x" * 900] and budget.used == 0  # a frame that arrives whole holds nothing
    assert a.feed(whole[:10]) == [] and budget.used == 6  # 6 payload bytes buffered, the prefix is parsed
    assert a.feed(whole[10:500]) == [] and budget.used == 496
    with pytest.raises(BufferBudgetError, match="input budget has 504 of 1000") as info:
        b.feed(encode_frame(b"y" * 800)[:700])  # 696 more would not fit
    assert info.value.code == ErrorCode.CAPACITY and budget.used == 496
    with pytest.raises(WireError):  # that decoder stays failed
        b.feed(b"")
    tail = whole[500:] + encode_frame(b"z" * 50)[:20]  # completes a frame and starts the next in one chunk
    assert a.feed(tail) == [b"x" * 900] and budget.used == 16
    a.close()  # a stream that ends inside a frame returns its share
    assert budget.used == 0 and budget.held_by("") == 0


def test_one_peer_holds_at_most_its_share_and_other_peers_keep_theirs():
    budget = ByteBudget(10_000, per_peer=1000)
    mine = [FrameDecoder(5000, budget, peer="attacker") for _ in range(3)]
    assert mine[0].feed(_prefix(4000) + bytes(600)) == []
    assert mine[1].feed(_prefix(4000) + bytes(400)) == [] and budget.held_by("attacker") == 1000
    with pytest.raises(BufferBudgetError, match="per-peer share of 1000"):
        mine[2].feed(_prefix(4000) + bytes(1))
    other = FrameDecoder(5000, budget, peer="client")
    frame = encode_frame(b"c" * 900)
    assert other.feed(frame[:500]) == [] and budget.held_by("client") == 496
    assert other.feed(frame[500:]) == [b"c" * 900]
    mine[0].close()
    assert budget.held_by("attacker") == 400 and budget.used == 400 and budget.held_by("client") == 0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_partial_frame_gets_a_deadline_from_its_first_byte_and_its_length():
    clock = Clock()
    budget = ByteBudget(1 << 20, partial_timeout=5.0, partial_rate=1000)
    d = FrameDecoder(1 << 20, budget, clock=clock)
    assert d.time_left() is None  # nothing partial
    d.feed(b"\x00\x00")  # half a prefix: the length is not known yet
    assert d.time_left() == 5.0
    clock.now += 1
    d.feed(b"\x07\xd0")  # 2000 bytes announced: 5 s + 2 s from the first byte
    assert d.time_left() == 6.0
    clock.now += 3
    d.feed(bytes(1500))  # bytes arriving do not move the deadline
    assert d.time_left() == 3.0
    clock.now += 10
    assert d.feed(bytes(500) + _prefix(10) + b"abc") == [bytes(2000)]
    assert d.time_left() == pytest.approx(5.01)  # the next frame's clock starts with its own first byte
    clock.now += 6
    exc = d.expire()
    assert isinstance(exc, BufferBudgetError) and "did not arrive within its deadline" in str(exc)
    assert budget.used == 0 and d.time_left() is None
    with pytest.raises(BufferBudgetError):
        d.feed(b"defg")


def test_a_stream_whose_partial_frame_misses_its_deadline_fails_with_a_typed_error():
    budget = ByteBudget(1 << 20, partial_timeout=0.2)

    async def main() -> None:
        mine, theirs = memory_stream_pair(_Id(), _Id())
        fs = FramedStream(theirs, budget=budget)
        frame = encode_message_frame(InfoRequest())
        await mine.write(frame + _prefix(100) + b"half")  # one whole frame, then a frame that never completes
        with trio.fail_after(10):
            assert isinstance(await fs.recv(), InfoRequest)
            with pytest.raises(BufferBudgetError, match="did not arrive within its deadline"):
                await fs.recv()
        assert budget.used == 0
        await fs.aclose()

    trio.run(main)


class _Id:
    def to_base58(self) -> str:
        return "peer"


def test_a_large_frame_in_many_reads_holds_what_arrived_and_comes_out_whole():
    budget = ByteBudget(8 << 20)
    d = FrameDecoder(8 << 20, budget)
    payload = bytes(range(256)) * (3 << 12)  # 3 MiB: kept in a mapping of its own while partial
    frame = encode_frame(payload) + encode_frame(b"next")
    got = []
    for i in range(0, len(frame), 100_000):
        got += d.feed(frame[i:i + 100_000])
        assert budget.used == d.buffered <= len(payload)
    assert got == [payload, b"next"] and budget.used == 0 and d.at_boundary
    d.feed(frame[:1_500_000])
    d.close()  # cut off: the mapping and the share go
    assert budget.used == 0
