"""The pipeline's links are direct lanes where stages offer them, libp2p streams otherwise: same tokens either way."""

from __future__ import annotations

import pytest
import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.net.lane import LaneStream

from .fleet import MODEL, fleet, local_chain

SPLIT = [(0, 3), (3, 5), (5, 8)]
PROMPT = [1, 5, 9, 2, 7, 3]


def _inbound_kinds(server) -> list[str]:
    return ["lane" if isinstance(fs.stream, LaneStream) else "libp2p" for fs in server._inbound]


@pytest.mark.parametrize(("stage_lanes", "client_lanes", "kind"),
                         [(True, True, "lane"), (False, True, "libp2p"), (True, False, "mixed")])
def test_links_use_lanes_when_both_sides_allow_and_tokens_do_not_change(ckpt, stage_lanes, client_lanes, kind):
    want = local_chain(ckpt, SPLIT).generate(PROMPT, 10, guesses=2).tokens

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT, lanes=stage_lanes) as f:
                config = ClientConfig(MODEL, lanes=client_lanes, ring=True)  # the ring's link a lane too
                async with ChainClient(f.clients[0], config) as client:
                    res = await client.generate(PROMPT, 10, guesses=2)
                    kinds = [_inbound_kinds(server) for _, server, _ in f.stages]
                    totals = [server.link_kinds() for _, server, _ in f.stages]
                    failed = dict(client.pool.lanes.failed)
        return res, kinds, failed, totals

    res, kinds, failed, totals = trio.run(main)
    assert res.tokens == want
    if kind == "lane":  # client -> stage 1, stage 1 -> 2, stage 2 -> 3, and the client's own link to each stage
        assert all(k and set(k) == {"lane"} for k in kinds), kinds
        assert not failed
        # inbound from the client (+ the previous stage; on the first, the last stage closing the ring) and the
        # stream to the next stage (on the last, to the first), all lanes
        assert [t["lane"] for t in totals] == [3, 3, 3] and not any(t["libp2p"] for t in totals), totals
    elif kind == "libp2p":  # no stage offers lanes: the client tried, failed fast, remembers
        assert all(k and set(k) == {"libp2p"} for k in kinds), kinds
        assert len(failed) == 3
    else:  # the client keeps to libp2p, the stages use lanes between themselves (the ring's too)
        assert sorted(kinds[0]) == ["lane", "libp2p"]
        assert "lane" in kinds[1] and "lane" in kinds[2] and "libp2p" in kinds[2], kinds


def test_a_lane_port_that_never_answers_costs_the_lane_timeout_not_the_peer(ckpt):
    """Issue 15, item 2, under load: a lane handshake that hangs (a port whose connections are never answered, as
    a crowd of idle connections makes it) fails only after ``lane_timeout``; the survey's probe must still have its
    ``probe_timeout`` for the libp2p stream after it, else the peer counts as silent and no chain is found. Here
    ``lane_timeout`` alone is longer than ``probe_timeout``: the old probe budget could never be met."""
    import os
    import socket

    from sangama_p2p.net.streams import FramedStream
    from sangama_p2p.wire.messages import LaneOffer
    from sangama_p2p.wire.protocols import LANE_PROTOCOL

    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split).generate(PROMPT, 6).tokens
    with socket.socket() as dead:  # listens (connects succeed, into the backlog) and never accepts or answers
        dead.bind(("127.0.0.1", 0))
        dead.listen(64)

        async def offer_dead_port(stream) -> None:
            fs = FramedStream(stream)
            await fs.send(LaneOffer(dead.getsockname()[1], os.urandom(16), os.urandom(32)))
            await fs.aclose()

        async def main():
            with trio.fail_after(60):
                async with fleet(ckpt, split) as f:
                    for node, _, _ in f.stages:
                        node.serve(LANE_PROTOCOL, offer_dead_port)
                    config = ClientConfig(MODEL, probe_timeout=0.5, lane_timeout=1.0)
                    async with ChainClient(f.clients[0], config) as client:
                        res = await client.generate(PROMPT, 6)
                        kinds = [link.fs.link_kind for link in client.pool.links.values()]
            return res, kinds

        res, kinds = trio.run(main)
    assert res.tokens == want and kinds == ["libp2p", "libp2p"]
