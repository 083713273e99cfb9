"""Peers of one model id that serve other checkpoints are never chained; the depth comes from the fingerprint.

Loopback fleets as in test_pipeline.py, with stages of several checkpoints announcing the same model id.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.errors import RouteError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.fingerprint import checkpoint_identity
from sangama_p2p.net.discovery import ServingOffer

from .fleet import MODEL, fleet, local_chain, make_checkpoint

PROMPT = [1, 5, 9, 2, 7, 3]
N = 10


@pytest.fixture(scope="module")
def seed1(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("seed1"), seed=1)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from sangama_p2p.model.make import make_model, truncate_vocab

    root = tmp_path_factory.mktemp("llama")
    return truncate_vocab(make_model(root / "made", "llama", "tiny", seed=0), root / "v16", 16)


def fp(path: Path) -> str:
    return checkpoint_identity(path).fingerprint


def test_a_stage_of_another_seed_is_never_chained_with_ours(ckpt, seed1):
    """Seed 0 serves 0:4, seed 1 serves 4:8 under the same id: no chain covers the model (before, it chained them)."""
    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, [(0, 4)]) as f:
                other = await f.add_stage(4, 8, ckpt=open_checkpoint(seed1))
                async with ChainClient(f.clients[0], ClientConfig(MODEL, max_failovers=0)) as client:
                    with pytest.raises(RouteError) as err:
                        await client.generate(PROMPT, 4)
                    return str(err.value), client.left_out, f.stages[0][1].peer_id, other.peer_id

    message, left_out, ours, other = trio.run(main)
    assert "no chain of peers covers layers 0..8" in message and "left out" in message
    (out,) = left_out.values()  # the two one-peer groups: one is chosen (and cannot cover), the other left out
    assert out.peer_id in (ours, other) and (out.start, out.end) == ((0, 4) if out.peer_id == ours else (4, 8))
    assert "another checkpoint serves this model id" in out.reason


def test_two_checkpoints_under_one_id_each_chain_only_their_own_peers(ckpt, seed1):
    want0 = local_chain(ckpt, [(0, 4), (4, 8)]).generate(PROMPT, N).tokens
    want1 = local_chain(seed1, [(0, 4), (4, 8)]).generate(PROMPT, N).tokens
    assert want0 != want1  # the two checkpoints really answer differently

    async def main():
        with trio.fail_after(90):
            async with fleet(ckpt, [(0, 4), (4, 8)]) as f:
                ours = {s.peer_id for _, s, _ in f.stages}
                c1 = open_checkpoint(seed1)
                theirs = {(await f.add_stage(0, 4, ckpt=c1)).peer_id, (await f.add_stage(4, 8, ckpt=c1)).peer_id}
                results = {}
                for name, pin in (("any", None), ("seed0", fp(ckpt)), ("seed1", fp(seed1))):
                    async with ChainClient(f.clients[0], ClientConfig(MODEL, fingerprint=pin)) as client:
                        results[name] = (await client.generate(PROMPT, N), dict(client.left_out))
                return ours, theirs, results

    ours, theirs, results = trio.run(main)
    res, left = results["any"]
    assert set(res.route) in (ours, theirs)  # one group, whole
    assert res.tokens == (want0 if set(res.route) == ours else want1)
    assert set(left) == (theirs if set(res.route) == ours else ours)
    res0, left0 = results["seed0"]
    assert set(res0.route) == ours and res0.tokens == want0 and set(left0) == theirs
    assert all("differs from the local checkpoint" in o.reason for o in left0.values())
    res1, left1 = results["seed1"]
    assert set(res1.route) == theirs and res1.tokens == want1 and set(left1) == ours


def test_a_llama_under_the_qwen_id_is_left_out(ckpt, llama):
    want_qwen = local_chain(ckpt, [(0, 4), (4, 8)]).generate(PROMPT, N).tokens
    want_llama = local_chain(llama, [(0, 6)]).generate(PROMPT, N).tokens

    async def main():
        with trio.fail_after(90):
            async with fleet(ckpt, [(0, 4), (4, 8)]) as f:
                qwen = {s.peer_id for _, s, _ in f.stages}
                intruder = (await f.add_stage(0, 6, ckpt=open_checkpoint(llama))).peer_id
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    res = await client.generate(PROMPT, N)  # two qwen peers cover the model: the bigger group
                    left = dict(client.left_out)
                async with ChainClient(f.clients[0], ClientConfig(MODEL, fingerprint=fp(llama))) as client:
                    res_llama = await client.generate(PROMPT, N)
                return qwen, intruder, res, left, res_llama

    qwen, intruder, res, left, res_llama = trio.run(main)
    assert set(res.route) == qwen and res.tokens == want_qwen
    assert set(left) == {intruder} and left[intruder].num_layers == 6
    assert res_llama.route == [intruder] and res_llama.tokens == want_llama


@pytest.mark.parametrize("lie_about_depth", [False, True])
def test_a_peer_announcing_layers_4_to_a_million_is_ignored_and_the_depth_stays(ckpt, lie_about_depth):
    want = local_chain(ckpt, [(0, 4), (4, 8)]).generate(PROMPT, N).tokens

    async def main():
        with trio.fail_after(60):
            async with fleet(ckpt, [(0, 4), (4, 8)]) as f:
                liar = await f.add_stage(4, 8)  # where a survey's walk from layer 0 finds it
                honest_info = liar.info()
                liar.info = lambda: replace(honest_info, end=1_000_000)  # its info answers lie too
                current = liar.announcer.current
                depth = 1_000_000 if lie_about_depth else 8
                liar.announcer.current = lambda: replace(current(), end=1_000_000, num_layers=depth)
                await liar.announcer.publish()
                assert isinstance(liar.announcer.offer, ServingOffer) and liar.announcer.offer.end == 1_000_000
                async with ChainClient(f.clients[0], ClientConfig(MODEL)) as client:
                    res = await client.generate(PROMPT, N)
                    return res, dict(client.left_out), liar.peer_id

    res, left, liar = trio.run(main)
    assert res.tokens == want and len(res.route) == 2
    assert set(left) == {liar}
    reason = left[liar].reason
    assert ("announce 8" in reason) if lie_about_depth else ("beyond its checkpoint's 8 layers" in reason)


def test_four_depth_liars_under_our_fingerprint_never_exclude_the_honest_peers_of_a_pinned_client(ckpt):
    """Issue 26: four records under the honest fingerprint claiming 1,000,000 layers outvoted every honest peer, even
    for a client pinned to its own checkpoint: the depth was a vote. A pinned client takes its checkpoint's depth."""
    want = local_chain(ckpt, [(0, 4), (4, 8)]).generate(PROMPT, N).tokens
    mine = checkpoint_identity(ckpt)

    async def main():
        with trio.fail_after(90):
            async with fleet(ckpt, [(0, 4), (4, 8)]) as f:
                liars = []
                for _ in range(4):  # real stages of our checkpoint whose records and info answers lie about depth
                    liar = await f.add_stage(4, 8)
                    honest_info = liar.info()
                    liar.info = lambda h=honest_info: replace(h, end=1_000_000)
                    current = liar.announcer.current
                    liar.announcer.current = lambda c=current: replace(c(), end=1_000_000, num_layers=1_000_000)
                    await liar.announcer.publish()
                    liars.append(liar.peer_id)
                async with ChainClient(f.clients[0], ClientConfig(MODEL, fingerprint=mine.fingerprint)) as client:
                    with pytest.raises(RouteError):  # the attack: pinned by fingerprint alone, outvoted
                        await client.generate(PROMPT, N)
                pinned = ClientConfig(MODEL, fingerprint=mine.fingerprint, num_layers=mine.num_layers)
                async with ChainClient(f.clients[0], pinned) as client:
                    res = await client.generate(PROMPT, N)
                    return res, dict(client.left_out), liars

    res, left, liars = trio.run(main)
    assert res.tokens == want and len(res.route) == 2 and not set(res.route) & set(liars)
    assert set(left) == set(liars) and all("the client's checkpoint has 8" in o.reason for o in left.values())
