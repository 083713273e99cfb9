"""Framing: length prefixes, incremental decoding, exact reads through short reads, size limits."""

from __future__ import annotations

import random
import struct

import pytest
import trio
import trio.testing

from sangama_p2p.errors import FrameTooLargeError, TruncatedFrameError, WireError
from sangama_p2p.wire import FrameDecoder, FrameReader, encode_frame, read_exactly, read_frame

PAYLOADS = [b"hello", b"", bytes(range(256)) * 3, b"\x00\x00\x00\x05x"]
STREAM = b"".join(encode_frame(p) for p in PAYLOADS)


def test_frame_is_big_endian_length_then_payload() -> None:
    assert encode_frame(b"abc") == b"\x00\x00\x00\x03abc"
    assert encode_frame(b"ab", memoryview(b"c")) == b"\x00\x00\x00\x03abc"


def test_encode_refuses_frames_over_the_limit() -> None:
    assert encode_frame(b"x" * 8, max_frame=8)[4:] == b"x" * 8
    with pytest.raises(FrameTooLargeError):
        encode_frame(b"x" * 9, max_frame=8)


def test_several_frames_in_one_chunk() -> None:
    dec = FrameDecoder()
    assert dec.feed(STREAM) == PAYLOADS
    assert dec.at_boundary


@pytest.mark.parametrize("cut", range(len(STREAM) + 1))
def test_split_at_every_byte_boundary(cut: int) -> None:
    dec = FrameDecoder()
    got = dec.feed(STREAM[:cut]) + dec.feed(STREAM[cut:])
    assert got == PAYLOADS
    dec.finish()


def test_byte_by_byte() -> None:
    dec = FrameDecoder()
    got = [frame for i in range(len(STREAM)) for frame in dec.feed(STREAM[i : i + 1])]
    assert got == PAYLOADS
    assert dec.buffered == 0


def test_a_lone_prefix_is_not_a_boundary() -> None:
    dec = FrameDecoder()
    assert dec.feed(b"\x00\x00\x00\x02") == []
    assert not dec.at_boundary
    with pytest.raises(TruncatedFrameError):
        dec.finish()
    assert dec.feed(b"hi") == [b"hi"]
    assert dec.at_boundary


def test_memoryview_chunks_of_any_format() -> None:
    import array

    dec = FrameDecoder()
    words = array.array("H", encode_frame(b"abcd"))  # 8 bytes viewed as 4 uint16s
    assert dec.feed(memoryview(words)) == [b"abcd"]


def test_oversized_length_is_refused_before_buffering() -> None:
    dec = FrameDecoder(max_frame=1000)
    assert dec.feed(encode_frame(b"ok")) == [b"ok"]
    with pytest.raises(FrameTooLargeError):
        dec.feed(struct.pack(">I", 1001))
    assert dec.buffered == 0
    with pytest.raises(FrameTooLargeError):  # the stream lost sync: stays failed
        dec.feed(encode_frame(b"ok"))


def test_oversized_length_behind_a_good_frame_in_one_chunk() -> None:
    dec = FrameDecoder(max_frame=16)
    with pytest.raises(FrameTooLargeError):
        dec.feed(encode_frame(b"ok") + struct.pack(">I", 2**32 - 1))


def test_finish_reports_a_cut_off_frame() -> None:
    dec = FrameDecoder()
    dec.feed(STREAM[:-1])
    assert not dec.at_boundary
    with pytest.raises(TruncatedFrameError):
        dec.finish()
    half_prefix = FrameDecoder()
    half_prefix.feed(b"\x00\x00")
    with pytest.raises(TruncatedFrameError):
        half_prefix.finish()


def test_bad_max_frame_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        FrameDecoder(max_frame=-1)
    with pytest.raises(ValueError):
        FrameDecoder(max_frame=2**32)


class ShortReads:
    """A source whose read(n) returns between 1 and n bytes, like trio and py-libp2p streams."""

    def __init__(self, data: bytes, seed: int = 0, max_chunk: int | None = None) -> None:
        self.data = data
        self.pos = 0
        self.rng = random.Random(seed)
        self.max_chunk = max_chunk
        self.calls = 0

    async def read(self, n: int) -> bytes:
        self.calls += 1
        await trio.lowlevel.checkpoint()
        limit = min(n, self.max_chunk) if self.max_chunk else n
        take = self.rng.randint(1, max(1, limit))
        chunk = self.data[self.pos : self.pos + take]
        self.pos += len(chunk)
        return chunk


@pytest.mark.parametrize("seed", range(5))
def test_read_frame_through_short_reads_reads_no_further(seed: int) -> None:
    async def main() -> None:
        src = ShortReads(STREAM, seed=seed, max_chunk=3)
        got = []
        while (frame := await read_frame(src.read)) is not None:
            if len(got) == 0:
                assert src.pos == 4 + len(PAYLOADS[0])  # nothing of the next frame was consumed
            got.append(frame)
        assert got == PAYLOADS

    trio.run(main)


@pytest.mark.parametrize("cut", [1, 3, 4, 6, len(encode_frame(b"hello")) - 1])
def test_read_frame_raises_on_a_cut_off_frame(cut: int) -> None:
    async def main() -> None:
        src = ShortReads(encode_frame(b"hello")[:cut], max_chunk=2)
        with pytest.raises(TruncatedFrameError):
            await read_frame(src.read)

    trio.run(main)


def test_read_frame_refuses_a_huge_length_without_reading_it() -> None:
    async def main() -> None:
        src = ShortReads(struct.pack(">I", 10_000) + b"x" * 10_000)
        with pytest.raises(FrameTooLargeError):
            await read_frame(src.read, max_frame=9_999)
        assert src.pos == 4

    trio.run(main)


def test_read_exactly_rejects_a_transport_that_over_delivers() -> None:
    async def too_much(n: int) -> bytes:
        return b"x" * (n + 1)

    with pytest.raises(WireError):
        trio.run(read_exactly, too_much, 4)


def test_frame_reader_over_a_trio_stream_with_odd_writes() -> None:
    frames = [bytes([i]) * (i * 37) for i in range(40)]
    wire = b"".join(encode_frame(f) for f in frames)

    async def main() -> None:
        send, recv = trio.testing.memory_stream_pair()
        got: list[bytes] = []

        async def writer() -> None:
            rng = random.Random(7)
            pos = 0
            while pos < len(wire):
                step = rng.randint(1, 300)
                await send.send_all(wire[pos : pos + step])
                pos += step
            await send.aclose()

        async def reader() -> None:
            fr = FrameReader(recv.receive_some, chunk_size=512)
            while (frame := await fr.next_frame()) is not None:
                got.append(frame)
            assert await fr.next_frame() is None

        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            nursery.start_soon(reader)
        assert got == frames

    trio.run(main)


def test_frame_reader_raises_on_a_stream_cut_mid_frame() -> None:
    async def main() -> None:
        src = ShortReads(STREAM[:-2], max_chunk=5)
        fr = FrameReader(src.read)
        got = []
        with pytest.raises(TruncatedFrameError):
            while (frame := await fr.next_frame()) is not None:
                got.append(frame)
        assert got == PAYLOADS[:-1]

    trio.run(main)
