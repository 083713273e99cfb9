"""Greedy tokens over the network equal LocalChain's for the same model and split."""

from __future__ import annotations

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.model.sampling import SamplingParams

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


def test_guesses_fixed_and_auto_equal_local_chain(ckpt):
    chain = local_chain(ckpt, SPLIT)
    want = {g: chain.generate(PROMPT, 16, guesses=g) for g in (2, "auto")}

    async def main():
        got = {}
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    for g in (2, "auto"):
                        got[g] = await client.generate(PROMPT, 16, guesses=g)
        return got

    got = trio.run(main)
    for g in (2, "auto"):
        assert got[g].tokens == want[g].tokens
        assert got[g].guesses_accepted == want[g].guesses_accepted > 0
        assert got[g].steps == want[g].steps < 15  # accepted guesses save trips


def test_auto_guesses_on_the_network_price_guesses_with_measured_trips(ckpt):
    chain = local_chain(ckpt, SPLIT)
    want = chain.generate(PROMPT, 40, guesses="auto")

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                last = f.stages[-1][1]
                opened = []
                table_open = last.table.open
                last.table.open = lambda *a, **k: opened.append(table_open(*a, **k)) or opened[-1]
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    t0 = trio.current_time()
                    res = await client.generate(PROMPT, 40, guesses="auto")
                    wall = trio.current_time() - t0
        return res, opened, wall

    res, opened, wall = trio.run(main)
    assert res.tokens == want.tokens
    assert res.guesses_accepted > 0
    (session,) = opened
    cost = session.decoder.policy.cost
    # the last stage measured what steps cost (the prior would leave every cost None): a plain step and a step
    # with guesses, each a whole trip (three stages and four hops): about the client's trip times, not one stage's
    assert cost[0] is not None and any(c is not None for c in cost[1:]), cost
    fastest = min(t.trip_s for t in res.trips[1:])
    for c in cost:
        assert c is None or 0.5 * fastest < c < wall, (cost, fastest, wall)


def test_eight_concurrent_requests_are_batched_and_equal_local_chain(ckpt):
    prompts = [[1 + i, 3, (5 * i) % 16, 2] for i in range(8)]
    chain = local_chain(ckpt, SPLIT, batch_invariant=True)
    want = [chain.generate(p, 10, guesses=2).tokens for p in prompts]

    async def main():
        got: list = [None] * 8
        with trio.fail_after(90):
            async with fleet(ckpt, SPLIT, batch_invariant=True) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    async def one(i):
                        got[i] = await client.generate(prompts[i], 10, guesses=2)

                    async with trio.open_nursery() as nursery:
                        for i in range(8):
                            nursery.start_soon(one, i)
                batches = [s.scheduler.stats for _, s, _ in f.stages]
        return got, batches

    got, stats = trio.run(main)
    assert [r.tokens for r in got] == want
    # several sessions shared batched steps on every stage
    assert all(s.jobs > s.steps for s in stats)
    assert max(st.batch_size for r in got for t in r.trips for st in t.stages) > 1


def test_stream_yields_the_tokens_of_generate(ckpt):
    want = local_chain(ckpt, SPLIT).generate(PROMPT, 8, guesses=2).tokens

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    return [t async for t in client.stream(PROMPT, 8, guesses=2)]

    assert trio.run(main) == want


def test_sampling_with_guesses_equals_local_chain_for_the_same_seed(ckpt):
    chain = local_chain(ckpt, SPLIT)
    want = [chain.generate(PROMPT, 16, SamplingParams(0.8, 0.9, seed=7), guesses=g).tokens for g in (0, 3)]

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    return [(await client.generate(PROMPT, 16, temperature=0.8, top_p=0.9, seed=7, guesses=g)).tokens
                            for g in (0, 3)]

    got = trio.run(main)
    assert got == want
    assert got[0] != local_chain(ckpt, SPLIT).generate(PROMPT, 16).tokens  # really sampled, not greedy


def test_a_node_that_serves_a_stage_can_put_its_own_stage_in_its_chain(ckpt):
    from sangama_p2p.stage import StageConfig, StageServer

    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split).generate(PROMPT, 10, guesses=2).tokens

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, [(4, 8)]) as f:
                node = f.clients[0]
                server = await trio.to_thread.run_sync(
                    StageServer.load, node, f.ckpt, StageConfig(MODEL, 0, 4, announce=True))
                async with server:
                    async with ChainClient(node, ClientConfig(MODEL), local_stage=server.open_local_stream) as c:
                        res = await c.generate(PROMPT, 10, guesses=2)
                    async with ChainClient(node, ClientConfig(MODEL, max_failovers=0)) as plain:
                        offers = await plain.survey()
        return res, offers, node.peer_id.to_base58()

    res, offers, me = trio.run(main)
    assert res.tokens == want
    assert res.route[0] == me
    assert me not in [o.peer_id for o in offers]  # without local_stage the node's own stage is left out


def test_a_long_prompt_is_sent_in_chunks(ckpt):
    prompt = [(7 * i) % 16 for i in range(11)]
    want = local_chain(ckpt, SPLIT).generate(prompt, 8).tokens

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, SPLIT) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL, max_step_tokens=4)) as client:
                    return await client.generate(prompt, 8)

    res = trio.run(main)
    assert [t.tokens for t in res.trips[:3]] == [4, 4, 3] and [t.emitted for t in res.trips[:3]] == [0, 0, 1]
    assert res.tokens == want


def test_auto_guesses_take_what_the_stages_allow_and_a_capacity_refusal_says_what_the_generation_needs(ckpt):
    """auto asks for up to 6 guesses; stages allowing 2 (or none, as a model without an MTP layer) refuse that with
    TOO_MANY_GUESSES: auto then asks for fewer (6 -> 3 -> 1 -> 0) instead of failing. A fixed count still fails."""
    from sangama_p2p.client.session import StageRefused
    from sangama_p2p.errors import ErrorCode

    chain = local_chain(ckpt, SPLIT)
    want = chain.generate(PROMPT, 16).tokens

    async def main():
        got = {}
        with trio.fail_after(90):
            for allowed in (2, 0):
                async with fleet(ckpt, SPLIT, max_guesses=allowed, max_session_length=40) as f:
                    async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                        got[allowed] = await client.generate(PROMPT, 16, guesses="auto")
                        try:
                            await client.generate(PROMPT, 16, guesses=3)
                        except StageRefused as exc:
                            got[allowed, "fixed"] = exc
                        try:
                            await client.generate(PROMPT, 40)
                        except StageRefused as exc:
                            got[allowed, "long"] = exc
        return got

    got = trio.run(main)
    for allowed in (2, 0):
        res = got[allowed]
        assert res.tokens == want
        assert res.guesses_proposed <= res.steps + 1  # at most one guess per trip: auto settled on 1 (or 0)
        assert got[allowed, "fixed"].code == ErrorCode.TOO_MANY_GUESSES
        long = got[allowed, "long"]
        assert long.code == ErrorCode.CAPACITY
        assert "needs 47 positions on every stage: a prompt of 6 tokens + 40 new tokens + 0 guesses + 1" in str(long)
    assert got[2].guesses_proposed > 0 and got[0].guesses_proposed == 0
