"""Writes on a lane without waiting (``LaneStream.try_write``, ``FramedStream.send_nowait``, the stage's ``Outbox``):
frames stay whole and in order when the socket takes only part of one. Plain TCP on loopback, no libp2p."""

from __future__ import annotations

import socket

import pytest
import trio

from sangama_p2p.net.lane import LaneStream
from sangama_p2p.stage.links import Outbox
from sangama_p2p.net.streams import FramedStream, PeerConn
from sangama_p2p.wire.messages import CloseSession, Step
from sangama_p2p.wire.tensor import Tensor

KEY = b"k" * 32


class _Peer:
    def to_base58(self) -> str:
        return "peer"


async def _lanes(nursery: trio.Nursery, sndbuf: int | None = None) -> tuple[LaneStream, LaneStream]:
    """Two ends of a lane over loopback TCP (``sndbuf`` shrinks the dialler's send buffer)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    dialled = await trio.open_tcp_stream("127.0.0.1", port)
    accepted = await listeners[0].accept()
    await listeners[0].aclose()
    if sndbuf is not None:
        dialled.socket.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        accepted.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    return LaneStream(dialled, KEY, _Peer(), dialer=True), LaneStream(accepted, KEY, _Peer(), dialer=False)


def _step(i: int, numel: int = 4) -> Step:
    return Step(b"s" * 16, i, i, (1,), Tensor("fp32", (1, numel), bytes([i % 256]) * (4 * numel)), (), ())


def test_send_nowait_writes_at_once_and_only_on_lanes():
    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                up, down = await _lanes(nursery)
                fs, peer = FramedStream(up), FramedStream(down)
                assert fs.can_send_nowait
                assert fs.send_nowait(_step(1)) and not fs.pending
                await fs.send(_step(2))
                assert [await peer.recv(), await peer.recv()] == [_step(1), _step(2)]
                await fs.aclose()
                assert not fs.can_send_nowait and not fs.send_nowait(_step(3))
                await peer.aclose()

                class NotALane:  # a libp2p or in-process stream: no try_write, never written without waiting
                    muxed_conn = PeerConn(_Peer())

                other = FramedStream(NotALane())
                assert not other.can_send_nowait and not other.send_nowait(_step(4))

    trio.run(main)


def test_a_frame_the_socket_takes_in_part_is_finished_before_the_next_one():
    big = 1 << 16  # 256 KiB of hidden states against a ~16 KiB send buffer: the socket takes only part at once

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                up, down = await _lanes(nursery, sndbuf=8192)
                fs, peer = FramedStream(up), FramedStream(down)
                assert fs.send_nowait(_step(1, big))
                assert fs.pending and not fs.can_send_nowait  # the rest waits: nothing may overtake it
                assert not fs.send_nowait(_step(2))
                got = []

                async def read() -> None:
                    for _ in range(3):
                        got.append(await peer.recv())

                nursery.start_soon(read)
                await fs.send(_step(2))  # flushes the rest of the first frame, then writes its own
                await fs.flush()
                assert not fs.pending
                assert fs.send_nowait(_step(3))
                while len(got) < 3:
                    await trio.sleep(0.01)
                assert got == [_step(1, big), _step(2), _step(3)]
                await fs.aclose()
                await peer.aclose()

    trio.run(main)


@pytest.mark.parametrize("sndbuf", [None, 8192])
def test_outbox_writes_at_once_when_idle_and_keeps_the_order(sndbuf):
    """``put`` writes an idle lane's frame itself (its builder runs at once: the send stamp is the write); with a
    frame in flight or queued, later items queue behind it; every frame arrives whole and in order."""
    numel = 1 << 15 if sndbuf else 4  # 128 KiB frames against an 8 KiB send buffer: written in parts

    async def main():
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                up, down = await _lanes(nursery, sndbuf=sndbuf)
                fs, peer = FramedStream(up), FramedStream(down)
                outbox = Outbox(fs)
                nursery.start_soon(outbox.run)
                await outbox.ready.wait()
                built: list[int] = []

                def builder(i: int):
                    def build() -> Step:
                        built.append(i)
                        return _step(i, numel)
                    return build

                assert outbox.put(builder(0))
                assert built == [0]  # written by put itself
                for i in range(1, 4):
                    assert outbox.put(builder(i))
                assert outbox.put(CloseSession(b"s" * 16))
                if sndbuf:  # the first frame was taken in part: the rest wait for the writer
                    assert built == [0]
                got = [await peer.recv() for _ in range(5)]
                assert got == [*(_step(i, numel) for i in range(4)), CloseSession(b"s" * 16)]
                assert built == [0, 1, 2, 3]
                outbox.close()
                assert not outbox.put(_step(9))  # closed: refused, the caller reports the loss
                await outbox.done.wait()
                await fs.aclose()
                await peer.aclose()

    trio.run(main)


def test_a_failed_write_in_put_fails_the_outbox_with_the_item():
    failed: list = []

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                up, down = await _lanes(nursery)
                fs = FramedStream(up)
                outbox = Outbox(fs, on_failed=lambda box, lost, exc: failed.append((lost, type(exc).__name__)))
                nursery.start_soon(outbox.run)
                await outbox.ready.wait()
                await up.sock.aclose()  # the socket is gone under the FramedStream
                item = _step(1)
                assert outbox.put(item)  # taken, then reported lost through on_failed
                assert outbox.failed is not None and not outbox.put(_step(2))
                await outbox.done.wait()
                await down.sock.aclose()

    trio.run(main)
    assert failed == [([_step(1)], "StreamClosed")]


def test_has_frames_tells_whether_more_frames_wait_behind_the_one_read():
    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                up, down = await _lanes(nursery)
                fs, peer = FramedStream(up), FramedStream(down)
                assert fs.send_nowait(_step(1)) and fs.send_nowait(_step(2))
                await trio.sleep(0.05)  # both records are in the receiver's socket: one read brings them
                assert await peer.recv() == _step(1)
                assert peer.has_frames
                assert await peer.recv() == _step(2)
                assert not peer.has_frames
                await fs.aclose()
                await peer.aclose()

    trio.run(main)
