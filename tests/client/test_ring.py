"""The ring closes at the first stage (issue 29): the last stage hands each next trip on to the first stage itself, the
client sends only the first trip, checks every answer and the first stage's echo of every trip handed on, and gets
the tokens it would get with every trip through it (and those of the local chain)."""

from __future__ import annotations

import dataclasses
from typing import Any

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.client.session import ChainSession
from sangama_p2p.errors import NetworkError
from sangama_p2p.wire.messages import Step

from .fleet import MODEL, fleet, local_chain, make_checkpoint
from .liars import modest

SPLIT = [(0, 3), (3, 5), (5, 8)]
PROMPT = [1, 5, 9, 2, 7, 3]


def _count_client_steps(monkeypatch: Any) -> list[Step]:
    """Every Step the client sends (its own trips, on every chain)."""
    sent: list[Step] = []
    real = ChainSession._send_to

    async def send_to(self: ChainSession, link: Any, msg: object) -> None:
        if isinstance(msg, Step):
            sent.append(msg)
        await real(self, link, msg)

    monkeypatch.setattr(ChainSession, "_send_to", send_to)
    return sent


def _generate(ckpt: Any, split: list[tuple[int, int]], runs: list[dict[str, Any]], prompt: list[int] = PROMPT,
              **config: Any) -> list[Any]:
    async def main() -> list[Any]:
        out = []
        with trio.fail_after(120):
            async with fleet(ckpt, split) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL, **config)) as client:
                    for kw in runs:
                        out.append(await client.generate(prompt, **kw))
        return out

    return trio.run(main)


def test_the_ring_gives_the_tokens_of_the_local_chain_with_one_trip_sent(ckpt, monkeypatch):
    chain = local_chain(ckpt, SPLIT)
    runs = [{"max_new_tokens": 16}, {"max_new_tokens": 16, "guesses": 2}, {"max_new_tokens": 16, "guesses": "auto"}]
    want = [chain.generate(PROMPT, r["max_new_tokens"], guesses=r.get("guesses", 0)) for r in runs]
    sent = _count_client_steps(monkeypatch)
    got = _generate(ckpt, SPLIT, runs, ring=True)
    for w, g in zip(want, got):
        assert g.tokens == w.tokens and g.failovers == 0
        assert g.steps == w.steps and g.guesses_accepted == w.guesses_accepted
        assert [len(t.stages) for t in g.trips] == [3] * len(g.trips)
    assert got[1].guesses_accepted > 0
    assert len(sent) == len(runs) and all(s.ring for s in sent)  # one trip per generation: the prompt's


def test_without_the_ring_every_trip_goes_through_the_client(ckpt, monkeypatch):
    """``ring=False`` (``--no-ring``): the client sends every trip."""
    chain = local_chain(ckpt, SPLIT)
    want = chain.generate(PROMPT, 12, guesses=2)
    sent = _count_client_steps(monkeypatch)
    (got,) = _generate(ckpt, SPLIT, [{"max_new_tokens": 12, "guesses": 2}], ring=False)
    assert got.tokens == want.tokens
    assert len(sent) == got.steps + 1 and not any(s.ring for s in sent)


def test_the_ring_stops_at_a_stop_token_and_at_max_new(ckpt, monkeypatch):
    """The last stage hands nothing on past the request's end, so no stage computes a trip nobody wants."""
    chain = local_chain(ckpt, SPLIT)
    full = chain.generate(PROMPT, 20, guesses=2).tokens
    stop = full[7]
    want = chain.generate(PROMPT, 20, guesses=2, stop_tokens=[stop]).tokens
    assert want[-1] == stop and len(want) < 20

    async def main() -> tuple[Any, Any, int]:
        with trio.fail_after(120):
            async with fleet(ckpt, SPLIT) as f:
                first = f.stages[0][1]
                steps: list[int] = []
                real = first.scheduler.submit
                first.scheduler.submit = lambda job, **k: steps.append(job.msg.step) or real(job, **k)
                async with ChainClient(f.clients[0], ClientConfig(MODEL, ring=True)) as client:
                    a = await client.generate(PROMPT, 20, guesses=2, stop_tokens=[stop])
                    n_a = len(steps)
                    await trio.sleep(0.3)  # a trip handed on past the end would reach the first stage by now
                    assert len(steps) == n_a
                    b = await client.generate(PROMPT, 9, guesses=2)
                    await trio.sleep(0.3)
        return a, b, len(steps) - n_a

    a, b, n_b = trio.run(main)
    assert a.tokens == want
    assert b.tokens == chain.generate(PROMPT, 9, guesses=2).tokens
    assert n_b == b.steps + 1  # the first stage computed exactly the generation's trips


def test_seeded_sampling_is_the_same_with_and_without_the_ring(ckpt):
    runs = [{"max_new_tokens": 14, "temperature": 0.9, "seed": 7, "guesses": 2}]
    (ring,) = _generate(ckpt, SPLIT, runs, ring=True)
    (plain,) = _generate(ckpt, SPLIT, runs, ring=False)
    assert ring.tokens == plain.tokens and len(ring.tokens) == 14


def test_a_one_stage_chain_closes_the_ring_on_itself(ckpt, monkeypatch):
    want = local_chain(ckpt, [(0, 8)]).generate(PROMPT, 10, guesses=2)
    sent = _count_client_steps(monkeypatch)
    (got,) = _generate(ckpt, [(0, 8)], [{"max_new_tokens": 10, "guesses": 2}], ring=True)
    assert got.tokens == want.tokens and len(sent) == 1


def test_a_last_stage_that_hands_on_other_tokens_than_it_answers_is_left_out(ckpt):
    """A last stage that answers the right tokens but hands other ones on to the first stage would poison every later
    trip's context where the client cannot see it: the first stage's echo shows it, and the client re-routes around
    both ends of that ring and replays, with the local chain's tokens."""
    chain = local_chain(ckpt, SPLIT)
    want = chain.generate(PROMPT, 12, guesses=2).tokens

    async def main() -> tuple[Any, str, int]:
        with trio.fail_after(120):
            async with fleet(ckpt, SPLIT) as f:
                liar = f.stages[-1][1]
                # an honest spare of the last range, and of the first: the client leaves out both ends of the
                # poisoned ring. The spares announce 1 step/s so routing takes the liar first whatever RTT noise a
                # loaded machine measures (CI once chained the spare, and nothing was poisoned)
                modest(await f.add_stage(5, 8))
                modest(await f.add_stage(0, 3))
                from .liars import _attractive

                _attractive(liar)
                poisoned = []
                real = liar._send_on

                def send_on(session: Any, m: Any, peer: str, item: Any, nbytes: int, what: str) -> None:
                    if what.startswith("the ring"):
                        step = item()
                        bad = dataclasses.replace(step, token_ids=(1, *step.token_ids[1:]))
                        if bad != step:
                            poisoned.append(step.step)
                        item = lambda: bad  # noqa: E731
                    real(session, m, peer, item, nbytes, what)

                liar._send_on = send_on
                async with ChainClient(f.clients[0], ClientConfig(MODEL, ring=True)) as client:
                    res = await client.generate(PROMPT, 12, guesses=2)
        return res, liar.peer_id, len(poisoned)

    res, liar_id, poisoned = trio.run(main)
    assert poisoned >= 1
    assert res.tokens == want and res.failovers >= 1 and liar_id not in res.route


def _ring_breaks(ckpt: Any, monkeypatch: Any, breaker: Any) -> tuple[Any, list[Step], int, list[str]]:
    """A 20-token generation with the ring on an otherwise healthy chain (no spare: the only chain); ``breaker(first,
    last)`` (the stage servers) breaks the ring at the last stage's fourth hand-on; returns the result, the steps the
    client sent, the number of hand-ons and the chain's peers."""
    sent = _count_client_steps(monkeypatch)

    async def main() -> tuple[Any, int, list[str]]:
        with trio.fail_after(120):
            async with fleet(ckpt, SPLIT) as f:
                first, last = f.stages[0][1], f.stages[-1][1]
                handed: list[int] = []
                real = last._send_on

                def send_on(session: Any, m: Any, peer: str, item: Any, nbytes: int, what: str) -> None:
                    if what.startswith("the ring"):
                        handed.append(m.step)
                        if len(handed) == 4:
                            breaker(first, last)
                    real(session, m, peer, item, nbytes, what)

                last._send_on = send_on
                async with ChainClient(f.clients[0], ClientConfig(MODEL, ring=True, verify=0)) as client:
                    res = await client.generate(PROMPT, 20, guesses=2)
                return res, len(handed), [s[1].peer_id for s in f.stages]

    res, n_handed, peers = trio.run(main)
    return res, sent, n_handed, peers


def test_a_ring_whose_last_to_first_link_fails_goes_on_through_the_client(ckpt, monkeypatch):
    """The last stage's link to the first stage (which the client cannot probe: a relayed link whose relay restarted)
    is reset and cannot be dialled again: the hand-on's frame is reported lost, and the generation goes on through
    the client on the same chain - nobody blamed, nobody left out - with the local chain's tokens."""
    want = local_chain(ckpt, SPLIT).generate(PROMPT, 20, guesses=2)

    def cut(first: Any, last: Any) -> None:
        async def unreachable(peer: str) -> Any:
            raise NetworkError(f"{peer} cannot be reached (the test's cut)")

        link = last.next_hops.links[first.peer_id]
        last.next_hops._open_stream = unreachable
        link.close()  # the stream is gone; the next hand-on dials again, and fails

    res, sent, n_handed, peers = _ring_breaks(ckpt, monkeypatch, cut)
    assert res.tokens == want.tokens and res.failovers == 1 and res.route == peers
    ring = [s.ring for s in sent]
    assert ring[0] and not any(ring[1:]) and len(sent) > 5  # after the first, every trip went through the client


def test_a_ring_whose_hand_on_vanishes_goes_on_through_the_client(ckpt, monkeypatch):
    """A link that swallows what the last stage hands on (a dead relay that has not said so): the trip never comes
    round; after the stall clock the client sends the trips itself, on the same chain, with the local tokens."""
    want = local_chain(ckpt, SPLIT).generate(PROMPT, 20, guesses=2)

    def swallow(first: Any, last: Any) -> None:
        real = first._on_step
        first._on_step = lambda peer, *a, **k: None if peer == last.peer_id else real(peer, *a, **k)

    res, sent, n_handed, peers = _ring_breaks(ckpt, monkeypatch, swallow)
    assert res.tokens == want.tokens and res.failovers == 1 and res.route == peers
    assert sent[0].ring and not any(s.ring for s in sent[1:]) and len(sent) > 5


def test_the_verifiers_chains_never_close_a_ring(ckpt):
    """With the ring on (the default) and every trip verified, only the generation's own chain opens with a ring:
    the verifier's chains step trip by trip, and a ring there would have their last stage dial their first one (and
    every stage keep rollback for windows in flight) for nothing."""
    want = local_chain(ckpt, SPLIT, batch_invariant=True).generate(PROMPT, 8).tokens

    async def main() -> tuple[Any, list[bool]]:
        with trio.fail_after(120):
            async with fleet(ckpt, [*SPLIT, *SPLIT], batch_invariant=True) as f:
                opened: list[bool] = []
                for _, server, _ in f.stages:
                    real = server.table.open

                    def spy(msg: Any, *args: Any, real: Any = real, **kwargs: Any) -> Any:
                        opened.append(msg.ring is not None)
                        return real(msg, *args, **kwargs)

                    server.table.open = spy
                async with ChainClient(f.clients[0], ClientConfig(MODEL, verify=1.0)) as client:
                    res = await client.generate(PROMPT, 8)
                return res, opened

    res, opened = trio.run(main)
    assert res.tokens == want and res.verified_trips
    assert opened.count(True) == 2 and opened.count(False) >= 3, opened  # the ring's two ends; the verifier's chains


def test_several_windows_in_flight_give_the_tokens_of_one(tmp_path, monkeypatch):
    """Issue 29, item 2: after a trip whose guesses were all kept, the last stage drafts a window past the next trip
    and hands it on before that trip is checked; a window that does not stand is dropped and every stage rolls back
    past it. Greedy tokens and trips equal the local chain's with windows cut short (a three-token vocabulary: the
    MTP layer's guesses are mostly wrong) and with every window standing (one token: every guess is kept)."""
    import sangama_p2p.stage.server as server_mod

    real = server_mod.ring_steps
    ahead: list[tuple[int, bool | None]] = []

    def counting(session: Any, m: Any, res: Any) -> Any:
        out = real(session, m, res)
        ahead.append((len(out), res.ahead_stands))
        return out

    monkeypatch.setattr(server_mod, "ring_steps", counting)
    for vocab, prompt in ((3, [1, 2, 0, 1, 2, 2]), (1, [0] * 6)):
        ahead.clear()
        ckpt = make_checkpoint(tmp_path / f"v{vocab}", vocab=vocab)
        chain = local_chain(ckpt, SPLIT)
        want = {k: chain.generate(prompt, 40, guesses=k) for k in (1, 2)}
        runs = [{"max_new_tokens": 40, "guesses": 1}, {"max_new_tokens": 40, "guesses": 2}]
        got = _generate(ckpt, SPLIT, runs, prompt, windows=2)
        for g, k in zip(got, (1, 2)):
            assert g.tokens == want[k].tokens and g.failovers == 0, vocab
            assert g.steps == want[k].steps and g.guesses_accepted == want[k].guesses_accepted, vocab
        assert any(n == 2 for n, _ in ahead), ahead  # a window ahead went with the next trip
        if vocab == 3:
            assert any(stood is False for _, stood in ahead), ahead  # and was cut short
        else:
            assert sum(bool(stood) for _, stood in ahead) > len(ahead) / 2, ahead  # the next trip, already sent
