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
                config = ClientConfig(MODEL, lanes=client_lanes)
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
        # inbound from the client (+ the previous stage) and the stream to the next stage, all lanes
        assert [t["lane"] for t in totals] == [2, 3, 2] and not any(t["libp2p"] for t in totals), totals
    elif kind == "libp2p":  # no stage offers lanes: the client tried, failed fast, remembers
        assert all(k and set(k) == {"libp2p"} for k in kinds), kinds
        assert len(failed) == 3
    else:  # the client keeps to libp2p, the stages use lanes between themselves
        assert kinds[0] == ["libp2p"]
        assert "lane" in kinds[1] and "lane" in kinds[2] and "libp2p" in kinds[2], kinds
