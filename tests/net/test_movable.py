"""A movable stage stream keeps every frame, in order, exactly once while it moves to another stream mid-flow
(both directions writing), and refuses a continuation from a peer other than the one that opened it.

The streams are in-process pairs (``memory_stream_pair``), which half-close like libp2p's yamux streams; the move
over a real relay and a real hole punch is checked in network namespaces (test_nat_fleet.py).
"""

from __future__ import annotations

import trio
from libp2p.peer.id import ID

from sangama_p2p.net.movable import NEW, NEXT, MovableAcceptor, MovableStream, header
from sangama_p2p.net.streams import memory_stream_pair
from sangama_p2p.wire.framing import FrameReader, encode_frame

A = ID.from_base58("12D3KooWGUgys4GKCq6ao6pibv5HvGiSJF1HPu9SbyUUhgpbdyTh")
B = ID.from_base58("12D3KooWD8HNt8rYK7dBSBNKqCE3bYUieVatWsFodcyXTkMoJLW4")
C = ID.from_base58("12D3KooWNTR7eALxrivfGck5yC46ewFT4trwSNvGZUAtyfdAnyMC")
TOKEN = bytes(range(16))
N = 400


class _Counting:
    """A raw stream that counts the bytes written to it (which of the two streams carried the frames)."""

    def __init__(self, raw) -> None:  # type: ignore[no-untyped-def]
        self.raw, self.written = raw, 0
        self.muxed_conn = raw.muxed_conn

    async def read(self, n: int) -> bytes:
        return await self.raw.read(n)

    async def write(self, data: bytes) -> None:
        self.written += len(data)
        await self.raw.write(data)

    async def close(self) -> None:
        await self.raw.close()

    async def reset(self) -> None:
        await self.raw.reset()


async def _pump(stream: MovableStream, tag: bytes, moved: trio.Event, at: int) -> None:
    for i in range(N):
        await stream.write(encode_frame(tag + i.to_bytes(4, "big")))
        if i == at:
            moved.set()  # the move starts here, with frames still flowing both ways
        await trio.sleep(0)
    await stream.close()


async def _collect(stream: MovableStream, tag: bytes) -> list[int]:
    reader = FrameReader(stream.read, 1 << 16)
    got = []
    while (frame := await reader.next_frame()) is not None:
        assert frame[:1] == tag
        got.append(int.from_bytes(frame[1:], "big"))
    return got


async def _opened(dialer_raw, served_raw):  # type: ignore[no-untyped-def]
    """A movable stream opened over ``dialer_raw`` -> ``served_raw``: (the acceptor, the dialler's end, the served
    end)."""
    accepted: list[MovableStream] = []

    async def on_stream(ms: MovableStream) -> None:
        accepted.append(ms)

    acceptor = MovableAcceptor(on_stream)
    await dialer_raw.write(header(NEW, TOKEN))
    await acceptor.handle(served_raw)
    (served,) = accepted
    return acceptor, MovableStream(dialer_raw, TOKEN), served


def test_frames_cross_a_move_in_both_directions_each_exactly_once_and_in_order() -> None:
    async def main() -> None:
        a_old, b_old = memory_stream_pair(A, B)
        a_new, b_new = memory_stream_pair(A, B)
        old_a, new_a, old_b = _Counting(a_old), _Counting(a_new), _Counting(b_old)
        acceptor, dialer, served = await _opened(old_a, old_b)
        go = trio.Event()
        results: dict[str, list[int]] = {}
        moved: list[bool] = []

        async def collect(name: str, s: MovableStream, tag: bytes) -> None:
            results[name] = await _collect(s, tag)

        async def mover() -> None:
            await go.wait()
            async with trio.open_nursery() as n:
                n.start_soon(acceptor.handle, b_new)
                moved.append(await dialer.move(new_a))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(mover)
            nursery.start_soon(_pump, dialer, b"c", go, N // 3)
            nursery.start_soon(_pump, served, b"s", trio.Event(), -1)
            nursery.start_soon(collect, "at_stage", served, b"c")
            nursery.start_soon(collect, "at_client", dialer, b"s")
        assert moved == [True] and dialer.moves == served.moves == 1
        assert results["at_stage"] == list(range(N))
        assert results["at_client"] == list(range(N))
        assert 0 < old_a.written < new_a.written  # the first third went the old way, the rest the new way

    trio.run(main)


def test_a_continuation_from_another_peer_is_refused_and_the_stream_stays() -> None:
    async def main() -> None:
        a_old, b_old = memory_stream_pair(A, B)
        acceptor, dialer, served = await _opened(a_old, b_old)
        c_new, b_from_c = memory_stream_pair(C, B)  # C learned the token and tries to take the stream over
        await c_new.write(header(NEXT, TOKEN))
        await acceptor.handle(b_from_c)
        assert served.moves == 0
        await dialer.write(encode_frame(b"still here"))
        assert await FrameReader(served.read, 64).next_frame() == b"still here"
        # and a move the acceptor does not answer fails within its timeout, leaving the stream in place
        a_new, b_new = memory_stream_pair(A, B)
        assert await dialer.move(a_new, timeout_s=0.2) is False
        await dialer.write(encode_frame(b"after"))
        assert await FrameReader(served.read, 64).next_frame() == b"after"

    trio.run(main)


def test_a_stage_stream_over_a_real_relay_moves_onto_the_direct_connection_once_there_is_one() -> None:
    """py-libp2p over loopback: a relay, a private peer B holding a reservation on it, A dialling B through it. The
    stream opens on the relayed connection; frames flow both ways while a direct connection comes up (the stand-in
    for a punch), and the stream moves onto it with every byte echoed back in order."""
    from contextlib import AsyncExitStack

    from multiaddr import Multiaddr

    from sangama_p2p.net.holepunch import stream_link
    from sangama_p2p.net.movable import STAGE_MOVABLE_PROTOCOL, TRAFFIC, open_movable, watch_and_move
    from sangama_p2p.net.traversal import Traversal, TraversalConfig
    from sangama_p2p.wire.protocols import STAGE_PROTOCOL

    from .net_swarm import first_addr
    from .test_relay import _node, _relay_and

    async def echo(ms: MovableStream) -> None:
        try:
            while data := await ms.read(65536):
                await ms.write(data)
        finally:
            await ms.close()

    async def main() -> None:
        async with AsyncExitStack() as stack:
            relay, b, b_t = await _relay_and(stack, punch=False)  # no punch: the direct link comes when we say
            nursery = await stack.enter_async_context(trio.open_nursery())

            async def on_stream(ms: MovableStream) -> None:
                nursery.start_soon(echo, ms)

            b.host.set_stream_handler(STAGE_MOVABLE_PROTOCOL, MovableAcceptor(on_stream).handle)
            a_t = Traversal(TraversalConfig(reachability="public"))
            a = await _node(stack, a_t)
            await a_t.connect(b.peer_id, [str(x) for x in b_t.circuit_addrs()])
            ms = await open_movable(a.host, b.peer_id, STAGE_PROTOCOL, punch_wait_s=0)
            assert isinstance(ms, MovableStream) and stream_link(ms).relay_id == str(relay.peer_id)
            direct0 = TRAFFIC.bytes["direct_out"]
            got: list[int] = []
            moved: list[bool] = []

            async def send() -> None:
                for i in range(300):
                    await ms.write(encode_frame(i.to_bytes(4, "big")))
                    if i == 60:  # frames in flight: a direct connection appears (as a punch would make one)
                        await a._dial_direct(b.peer_id, Multiaddr(first_addr(b).split("/p2p/")[0]))
                    await trio.sleep(0.002)

            async def receive() -> None:
                reader = FrameReader(ms.read, 64)
                while len(got) < 300:
                    frame = await reader.next_frame()
                    assert frame is not None
                    got.append(int.from_bytes(frame, "big"))

            with trio.fail_after(30):
                async with trio.open_nursery() as inner:
                    inner.start_soon(send)
                    inner.start_soon(receive)
                    moved.append(await watch_and_move(a.host, ms, b.peer_id, watch_s=20))
            assert moved == [True] and ms.moves == 1
            assert got == list(range(300))
            assert stream_link(ms).direct and TRAFFIC.bytes["direct_out"] > direct0
            await ms.close()
            nursery.cancel_scope.cancel()

    trio.run(main)
