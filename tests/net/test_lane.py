"""Direct lanes: keyed through libp2p, authenticated per record, single-use offers, fallback when unusable."""

from __future__ import annotations

import pytest
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr

from sangama_p2p.errors import TruncatedFrameError
from sangama_p2p.net.host import open_host
from sangama_p2p.net.lane import HELLO, LaneDialer, LaneError, LaneListener, LaneStream, open_lane
from sangama_p2p.streams import FramedStream
from sangama_p2p.wire.codec import encode, encode_message_frame
from sangama_p2p.wire.messages import CloseSession, InfoRequest, LaneOffer
from sangama_p2p.wire.protocols import LANE_PROTOCOL

from .net_swarm import config

SID = b"s" * 16


async def _closed_on_us(sock) -> bool:
    """True when the other end closed the connection (cleanly, or with a reset when our bytes were unread)."""
    try:
        return await sock.receive_some(100) == b""
    except trio.BrokenResourceError:
        return True


def _offer_port(port: int):
    """A /sangama/lane/2 handler that offers ``port`` (with a token and key nobody listens for)."""

    async def handler(stream) -> None:
        fs = FramedStream(stream)
        await fs.send(LaneOffer(port, b"t" * 16, b"k" * 32))
        await fs.aclose()

    return handler


async def _pair(a, b):
    """Connect node ``a`` to node ``b`` over libp2p."""
    info = info_from_p2p_addr(b.advertised_addrs()[0])
    await a.connect(info.peer_id, info.addrs)
    return info.peer_id


def test_lane_carries_frames_both_ways_and_belongs_to_the_dialling_peer():
    got: list = []

    async def main():
        with trio.fail_after(20):
            async with open_host(config()) as a, open_host(config()) as b, trio.open_nursery() as nursery:
                async def on_lane(lane: LaneStream) -> None:
                    async def echo() -> None:
                        fs = FramedStream(lane)
                        got.append(fs.peer)
                        while (msg := await fs.recv()) is not None:
                            await fs.send(msg)
                        await fs.aclose()
                    nursery.start_soon(echo)

                listener = LaneListener(b, on_lane)
                await nursery.start(listener.run)
                pid = await _pair(a, b)
                lane = await open_lane(a, pid)
                assert lane.remote.startswith("127.0.0.1:") and lane.remote.endswith(f":{listener.bound_port}")
                fs = FramedStream(lane)
                for msg in (InfoRequest(), CloseSession(SID), InfoRequest()):
                    await fs.send(msg)
                    assert await fs.recv() == msg
                await fs.aclose()
                assert fs.peer == b.peer_id.to_base58()
                nursery.cancel_scope.cancel()
        assert got == [a.peer_id.to_base58()]

    trio.run(main)


def test_offers_are_single_use_and_need_the_key():
    """A stolen token without the key (or a token used twice) gets no lane; the real owner still does."""
    accepted: list = []

    async def main():
        with trio.fail_after(20):
            async with open_host(config()) as a, open_host(config()) as b, trio.open_nursery() as nursery:
                async def on_lane(lane: LaneStream) -> None:
                    accepted.append(lane)

                listener = LaneListener(b, on_lane)
                await nursery.start(listener.run)
                offer = listener.offer(a.peer_id)
                # 1. the token with a record under the wrong key: closed, no lane, offer kept
                thief = await trio.open_tcp_stream("127.0.0.1", offer.port)
                forged = LaneStream(thief, b"x" * 32, a.peer_id, dialer=True)
                await thief.send_all(offer.token + forged.seal(HELLO))
                assert await _closed_on_us(thief)
                # 2. an unknown token: closed
                stranger = await trio.open_tcp_stream("127.0.0.1", offer.port)
                await stranger.send_all(b"t" * 16 + forged.seal(HELLO))
                assert await _closed_on_us(stranger)
                # 3. the owner: ready
                sock = await trio.open_tcp_stream("127.0.0.1", offer.port)
                lane = LaneStream(sock, offer.key, b.peer_id, dialer=True)
                await sock.send_all(offer.token + lane.seal(HELLO))
                assert await lane.read_record() == b"sangama lane ready"
                # 4. the same token again: closed
                again = await trio.open_tcp_stream("127.0.0.1", offer.port)
                replay = LaneStream(again, offer.key, b.peer_id, dialer=True)
                await again.send_all(offer.token + replay.seal(HELLO))
                assert await _closed_on_us(again)
                await trio.sleep(0.05)
                assert len(accepted) == 1
                nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("attack", ["tamper", "replay", "drop", "truncate"])
def test_a_record_that_fails_authentication_ends_the_lane(attack):
    """Flip a bit, repeat, skip or cut a record on the wire: the reader raises instead of passing bytes on."""

    async def main():
        with trio.fail_after(20):
            async with open_host(config()) as a, open_host(config()) as b, trio.open_nursery() as nursery:
                lanes: list[LaneStream] = []
                arrived = trio.Event()

                async def on_lane(lane: LaneStream) -> None:
                    lanes.append(lane)
                    arrived.set()

                listener = LaneListener(b, on_lane)
                await nursery.start(listener.run)
                lane = await open_lane(a, await _pair(a, b))
                await arrived.wait()
                server = lanes[0]
                frame = encode_message_frame(InfoRequest())
                one, two = lane.seal(frame), lane.seal(frame)
                wire = {"tamper": one[:-1] + bytes([one[-1] ^ 1]), "replay": one + one, "drop": two,
                        "truncate": one[:-3]}[attack]
                await lane.sock.send_all(wire)
                if attack == "truncate":
                    await lane.sock.send_eof()
                    with pytest.raises(TruncatedFrameError):
                        await server.read(1 << 16)
                else:
                    if attack == "replay":
                        assert await server.read(1 << 16) == frame
                    with pytest.raises(LaneError, match="failed authentication"):
                        await server.read(1 << 16)
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_no_lane_protocol_or_a_dead_port_falls_back_and_is_remembered():
    async def main():
        with trio.fail_after(30):
            async with open_host(config()) as a, open_host(config()) as b:
                pid = await _pair(a, b)
                with pytest.raises(LaneError, match="offers no lanes"):
                    await open_lane(a, pid)

                # an offer for a port nobody listens on
                with trio.socket.socket() as s:
                    await s.bind(("127.0.0.1", 0))
                    dead_port = s.getsockname()[1]

                b.host.set_stream_handler(LANE_PROTOCOL, _offer_port(dead_port))
                with pytest.raises(LaneError, match="cannot reach the lane port"):
                    await open_lane(a, pid)
                dialer = LaneDialer(a, timeout=2.0)
                assert await dialer.open(pid) is None
                assert pid.to_base58() in dialer.failed
                b.host.remove_stream_handler(LANE_PROTOCOL)
                with trio.fail_after(0.05):  # remembered: not tried again
                    assert await dialer.open(pid) is None
                assert await LaneDialer(a, enabled=False).open(pid) is None

    trio.run(main)


def test_a_silent_lane_port_times_out():
    async def main():
        with trio.fail_after(30):
            async with open_host(config()) as a, open_host(config()) as b:
                pid = await _pair(a, b)
                silent = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
                port = silent.socket.getsockname()[1]  # accepts (backlog) but never answers the hello

                b.host.set_stream_handler(LANE_PROTOCOL, _offer_port(port))
                t0 = trio.current_time()
                with pytest.raises(LaneError, match="within 0.5 s"):
                    await open_lane(a, pid, timeout=0.5)
                assert trio.current_time() - t0 < 2
                await silent.aclose()

    trio.run(main)


def test_a_malformed_offer_is_a_lane_error():
    async def main():
        with trio.fail_after(20):
            async with open_host(config()) as a, open_host(config()) as b:
                pid = await _pair(a, b)

                async def garbage(stream) -> None:
                    payload = encode(InfoRequest())
                    await stream.write(len(payload).to_bytes(4, "big") + payload)
                    await stream.close()

                b.host.set_stream_handler(LANE_PROTOCOL, garbage)
                with pytest.raises(LaneError, match="answered the lane request with InfoRequest"):
                    await open_lane(a, pid)

    trio.run(main)


def test_offers_are_bounded_per_peer_and_in_all():
    class NotListening(LaneListener):  # offer() needs nothing but a port
        bound_port = 4242

    listener = NotListening(None, lambda lane: None, max_offers=5, max_offers_per_peer=2)
    a = [listener.offer("peer-a") for _ in range(4)]
    assert [o.token for o in a[2:]] == list(listener._offers)  # a's two newest
    b = [listener.offer(f"peer-{i}") for i in range(4)]
    assert list(listener._offers) == [a[3].token, *(o.token for o in b)]  # 5 in all: the oldest went first
    assert len({o.key for o in a + b}) == 8 and len({o.token for o in a + b}) == 8  # fresh every time
