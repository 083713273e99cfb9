"""Liars that adapt (issue 26, item 2), over loopback with real stages serving wrong outputs on the real wire.

- A last stage honest on a session's first step and wrong afterwards: the judging's re-runs were one-step prefills,
  where it was honest, so nobody was blamed and its tokens were kept (23 of 24 wrong at ``--verify 1``). Now every
  judging chain replays the generation's trips in their shapes, and an answer no other chain confirms is not kept.
- Colluders of 0:3 and 6:8 that lie only beside the honest 3:6 peer they were chained with: in every mix of the two
  chains that peer is the one that explains the answers, and it was banned. Now a conviction needs the liar to lie
  beside peers outside both disputed chains too.
"""

from __future__ import annotations

import pytest
import trio

from sangama_p2p.client import ChainClient, ClientConfig

from .fleet import MODEL, fleet, local_chain
from .liars import _attractive, after_first_step, beside, lie_constant, lie_noise, modest
from .test_liars import N, PROMPT, _liar_token, _run


def test_a_liar_honest_on_the_first_step_only_is_caught_banned_and_its_tokens_never_kept(ckpt):
    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens
    bad = _liar_token(want)

    async def main():
        with trio.fail_after(150):
            # three peers a range: the second chain, and referees outside both chains for a ban
            return await _run(ckpt, [*split, (0, 4), (4, 8), (4, 8), (0, 4)], (4, 8),
                              lambda s: lie_constant(s, bad, when=after_first_step), verify=1.0)

    res, liar, lies, client = trio.run(main)
    assert lies and min(lies) >= 1, "the liar never lied (or lied on a first step)"
    assert res.tokens == want
    assert liar not in res.route
    reasons = client.verification.banned()
    assert list(reasons) == [liar] and "wrong tokens" in reasons[liar]
    assert client.stats.liars_banned == 1


@pytest.mark.slow  # 20 generations, each judged once: ~30-50 s
def test_colluders_that_lie_only_beside_an_honest_peer_never_get_it_banned(ckpt):
    """20 generations of one client, each first chained through the two colluders and their target: the target is
    never banned, nobody is, and every generation's tokens are an honest run's or said unchecked."""
    split = [(0, 3), (3, 6), (6, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens
    bad = _liar_token(want)

    async def main():
        with trio.fail_after(600):
            async with fleet(ckpt, split * 3, batch_invariant=True) as f:
                first, target, last = (s for _, s, _ in f.stages[:3])
                lies = [lie_noise(first, 3.0, when=beside(target.peer_id)),
                        lie_constant(last, bad, when=beside(target.peer_id))]
                _attractive(target)  # the colluders' neighbour in the generation's chain
                for _, other, _ in f.stages[3:]:  # the rest announce 1 step/s: RTT noise never outweighs it
                    modest(other)
                async with ChainClient(f.clients[0], ClientConfig(MODEL, verify=1.0)) as client:
                    with trio.fail_after(60):
                        while len(await client.survey(max_age=0.0, retry_slow=True)) < 9:
                            await trio.sleep(0.5)
                    results = [await client.generate(PROMPT, 4) for _ in range(20)]
                    return results, target.peer_id, lies, client

    results, target, lies, client = trio.run(main)
    assert all(lies), "the colluders never lied"
    assert not client.verification.banned(), client.verification.banned()
    # every generation's tokens are an honest run's, unless it said a trip could not be checked (a verifying chain
    # late twice on a loaded machine: one of 20 came back wrong in a loaded suite run); never a wrong one said verified
    assert all(r.tokens == want[:4] or r.unverified_trips for r in results), [(r.tokens, r.unverified_trips)
                                                                            for r in results]
    assert sum(r.tokens == want[:4] for r in results) >= 15
    assert target in client.verification.disputed
    assert all(e.verdict.liar is None for e in client.verification.events)
