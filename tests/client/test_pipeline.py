"""Greedy tokens over the network equal LocalChain's for the same model and split."""

from __future__ import annotations

import trio

from sangama_p2p.client import ChainClient, ClientConfig

from .fleet import MODEL, fleet, local_chain

SPLIT = [(0, 3), (3, 5), (5, 8)]
PROMPT = [1, 5, 9, 2, 7, 3]


def test_three_stages_equal_local_chain_without_guesses(ckpt):
    want = local_chain(ckpt, SPLIT).generate(PROMPT, 12).tokens

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    res = await client.generate(PROMPT, 12)
        return res

    res = trio.run(main)
    assert res.tokens == want
    assert len(res.trips) == 12
    assert [len(t.stages) for t in res.trips] == [3] * 12
