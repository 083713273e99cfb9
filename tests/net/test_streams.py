"""What carries a framed stream, as status panels count it (``StageServer.link_kinds``)."""

from __future__ import annotations

import os

import trio

from sangama_p2p.net.lane import LaneStream
from sangama_p2p.net.streams import FramedStream, memory_stream_pair
from sangama_p2p.wire.messages import InfoRequest


class _Peer:
    def to_base58(self) -> str:
        return "peer"


class _Libp2pLike:
    """A stream with only py-libp2p's surface (no ``link_kind``)."""

    def __init__(self) -> None:
        self.muxed_conn = type("Conn", (), {"peer_id": _Peer()})()


def test_link_kind_names_lanes_local_streams_and_libp2p() -> None:
    async def main() -> None:
        a, b = memory_stream_pair(_Peer(), _Peer())
        local = FramedStream(a)
        assert local.link_kind == "local"
        await local.send(InfoRequest())
        assert isinstance(await FramedStream(b).recv(), InfoRequest)  # a real stream, not just a label

        (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
        sock = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
        lane = LaneStream(sock, os.urandom(32), _Peer(), dialer=True)
        assert FramedStream(lane).link_kind == "lane"
        await lane.close()
        await listener.aclose()

        assert FramedStream(_Libp2pLike()).link_kind == "libp2p"

    trio.run(main)
