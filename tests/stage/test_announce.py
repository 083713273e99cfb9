"""Each stage keeps its DHT record current: range, measured throughput, free sessions."""

from __future__ import annotations

import os

import trio

from sangama_p2p.net.discovery import find_serving_peers
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.messages import InfoRequest, InfoResponse, OpenSession, SessionOpened
from sangama_p2p.wire.protocols import INFO_PROTOCOL, STAGE_PROTOCOL


def test_record_tracks_free_sessions_and_measured_throughput(ckpt, fl):
    async def main():
        with trio.fail_after(60):
            async with fl.fleet(ckpt, [(0, 8)], announce_every=0.2, max_sessions=3,
                                max_sessions_per_peer=3, typical_session_length=64) as f:
                node, server, _ = f.stages[0]
                client = f.clients[0]
                me = server.peer_id
                records = await find_serving_peers(client, fl.MODEL)
                assert [(r.peer_id, r.start, r.end, r.free_sessions) for r in records] == [(me, 0, 8, 3)]
                assert records[0].throughput > 0  # measured at start
                await client.connect(node.peer_id, node.listen_addrs())
                info_stream = FramedStream(await client.host.new_stream(node.peer_id, [INFO_PROTOCOL]))
                await info_stream.send(InfoRequest())
                info = await info_stream.recv()
                assert isinstance(info, InfoResponse) and (info.peer, info.start, info.end) == (me, 0, 8)
                assert info.free_sessions == 3 and info.queue == 0 and info.throughput > 0
                assert await info_stream.recv() is None  # one request, one answer, then the stage closes it
                fs = FramedStream(await client.host.new_stream(node.peer_id, [STAGE_PROTOCOL]))
                for _ in range(2):
                    await fs.send(OpenSession(os.urandom(16), fl.MODEL, 0, 8, None, None, client.peer_id.to_base58(), 64,
                                              0.0, 1.0, 0, 0, False))
                    assert isinstance(await fs.recv(), SessionOpened)
                while True:  # refreshed within a few announce periods
                    records = await find_serving_peers(client, fl.MODEL)
                    if records and records[0].free_sessions == 1:
                        break
                    await trio.sleep(0.1)
                await fs.aclose()  # the owner leaves: its sessions are freed and the record says so
                while True:
                    records = await find_serving_peers(client, fl.MODEL)
                    if records and records[0].free_sessions == 3:
                        break
                    await trio.sleep(0.1)

    trio.run(main)
