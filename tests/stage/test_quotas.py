"""Bounded resources on a stage over loopback (issue 15, item 5): sessions per peer, idle sessions, lanes per peer.
The floods of buffered bytes are in test_floods.py."""

from __future__ import annotations

import os

import trio

from sangama_p2p.errors import ErrorCode, LaneError
from sangama_p2p.net.lane import LaneStream, open_lane
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.messages import ErrorMessage, SessionOpened, Step

from ..hostile import open_session, raw_stage_stream

ONE = [(0, 8)]  # one stage holding every layer: it is the first and the last


async def _raw(client_node, server) -> FramedStream:
    return await raw_stage_stream(client_node, server.node.peer_id, server.node.listen_addrs())


def _open(sid, client, length=16):
    return open_session(sid, client, length, model_id="test-org/tiny-pipeline", start=0, end=8)


def test_one_peer_is_held_to_its_session_quota_while_another_still_opens(ckpt, fl):
    async def main():
        with trio.fail_after(60):
            async with fl.fleet(ckpt, ONE, clients=2, max_sessions=8) as f:  # quota: 8 // 4 = 2 per peer
                server = f.stages[0][1]
                a, b = f.clients
                sa, sb = await _raw(a, server), await _raw(b, server)
                replies = []
                for _ in range(4):
                    await sa.send(_open(os.urandom(16), a.peer_id.to_base58()))
                    replies.append(await sa.recv())
                assert [type(r).__name__ for r in replies] == ["SessionOpened"] * 2 + ["ErrorMessage"] * 2
                assert replies[2].code == ErrorCode.CAPACITY and "per-peer quota" in replies[2].message
                for _ in range(2):  # the other peer still gets sessions (the stage holds 8)
                    await sb.send(_open(os.urandom(16), b.peer_id.to_base58()))
                    assert isinstance(await sb.recv(), SessionOpened)
                assert server.table.per_peer == {a.peer_id.to_base58(): 2, b.peer_id.to_base58(): 2}
                await sa.aclose()  # A's stream ends: its sessions are freed and its quota with them
                with trio.fail_after(5):
                    while a.peer_id.to_base58() in server.table.per_peer:
                        await trio.sleep(0.02)

    trio.run(main)


def test_idle_sessions_expire_and_their_owner_is_told_when_it_comes_back(ckpt, fl):
    """``busy`` steps every 0.2 s, far under the 3 s idle time (so a loaded machine's slow trips do not expire it;
    with 0.5 s they did), and is stepped until ``idle`` has gone: an order of events, not a time (issue 22 item 4)."""

    async def main():
        with trio.fail_after(120):
            async with fl.fleet(ckpt, ONE, clients=1, session_idle_s=3.0) as f:
                server = f.stages[0][1]
                a = f.clients[0]
                sa = await _raw(a, server)
                idle, busy = os.urandom(16), os.urandom(16)
                for sid in (idle, busy):
                    await sa.send(_open(sid, a.peer_id.to_base58(), length=64))
                    assert isinstance(await sa.recv(), SessionOpened)
                # ``busy`` steps every 0.2 s (under the idle time) and stays; ``idle`` never steps and goes
                pos, tok = 0, [1, 2, 3]
                for i in range(60):  # at most 60 steps: the session's length is 64
                    await sa.send(Step(busy, i, pos, tuple(tok), None, (), ()))
                    res = await sa.recv()
                    assert not isinstance(res, ErrorMessage), res
                    pos, tok = pos + len(tok), [res.tokens[0]]
                    if idle not in server.table.sessions:
                        break
                    await trio.sleep(0.2)
                assert busy in server.table.sessions and idle not in server.table.sessions
                assert server.table.used_bytes == server.table.sessions[busy].nbytes
                await sa.send(Step(idle, 0, 0, (1, 2), None, (), ()))
                err = await sa.recv()
                assert isinstance(err, ErrorMessage) and err.code == ErrorCode.EXPIRED and err.session_id == idle
                with trio.fail_after(30):  # and ``busy`` goes too once it stops stepping
                    while server.table.sessions:
                        await trio.sleep(0.05)
                assert server.table.used_bytes == 0

    trio.run(main)


def test_lanes_per_peer_are_capped_and_the_peer_falls_back_to_libp2p(ckpt, fl):
    async def main():
        with trio.fail_after(60):
            async with fl.fleet(ckpt, ONE, clients=2, max_lanes_per_peer=3) as f:
                server = f.stages[0][1]
                a, b = f.clients
                for n in (a, b):
                    await n.connect(server.node.peer_id, server.node.listen_addrs())
                lanes: list[LaneStream] = []
                refused = 0
                for _ in range(6):
                    try:
                        lanes.append(await open_lane(a, server.node.peer_id))
                    except LaneError as exc:
                        assert "lanes" in str(exc)
                        refused += 1
                    await trio.sleep(0.05)  # the stage takes each lane in
                assert (len(lanes), refused) == (3, 3)
                assert server.link_kinds()["lane"] == 3
                # another peer still gets its lanes; A, refused, still has libp2p streams
                other = await open_lane(b, server.node.peer_id)
                fs = await _raw(a, server)
                await fs.send(_open(os.urandom(16), a.peer_id.to_base58()))
                assert isinstance(await fs.recv(), SessionOpened)
                # a lane closed frees its place
                await lanes.pop().close()
                with trio.fail_after(5):
                    while server.link_kinds()["lane"] != 3:  # two of A's and B's
                        await trio.sleep(0.02)
                lanes.append(await open_lane(a, server.node.peer_id))
                for lane in (*lanes, other):
                    await lane.close()

    trio.run(main)
