"""Peers that lie (issue 15, item 7), over loopback: real stages that compute and then serve wrong outputs on the
real wire (tests/client/liars.py), announcing a high throughput so that routing picks them.

Without verification the liar's tokens are the generation's (the attack, shown first); with ``verify=1.0`` every
trip is re-run on a second chain of other peers for the same ranges, the liar is found by mixing the two chains,
banned with a reason, and the generation replays from the last verified position: its tokens are an honest run's.
"""

from __future__ import annotations

import random

import pytest
import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.errors import RouteError

from .fleet import MODEL, fleet, local_chain
from .liars import lie_constant, lie_noise, modest

PROMPT = [3, 1, 4, 1, 5, 9]
N = 12


def _liar_token(want: list[int]) -> int:
    return next(t for t in range(16) if t != want[0])  # its very first answer is already wrong


async def _run(ckpt, ranges, liar_range, lie, **client_options):
    """A fleet over ``ranges``; the (first) stage of ``liar_range`` lies; one generation through it. The honest
    peers of that range announce 1 step/s, so routing takes the liar whatever RTTs a loaded machine measures (the
    liar's boast alone lost to 10 ms of RTT noise once: "the liar was never chained")."""
    async with fleet(ckpt, ranges, batch_invariant=True) as f:
        same = [s for _, s, _ in f.stages if (s.model.start, s.model.end) == liar_range]
        liar = same[0]
        for honest in same[1:]:
            modest(honest)
        lies = lie(liar)
        async with ChainClient(f.clients[0], ClientConfig(MODEL, **client_options)) as client:
            # the subject is verification, not discovery: the generation starts on a survey that saw every peer (under
            # two busy loops a survey once missed the liar and the test tested nothing)
            with trio.fail_after(60):
                while len(await client.survey(max_age=0.0, retry_slow=True)) < len(ranges):
                    await trio.sleep(0.5)
            res = await client.generate(PROMPT, N)
            return res, liar.peer_id, lies, client


def test_without_verification_a_lying_last_stage_is_chained_and_its_tokens_returned(ckpt):
    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens
    bad = _liar_token(want)

    async def main():
        with trio.fail_after(90):
            return await _run(ckpt, [*split, (4, 8)], (4, 8), lambda s: lie_constant(s, bad), verify=0.0)

    res, liar, lies, client = trio.run(main)
    assert liar in res.route and lies
    assert res.tokens == [bad] * N != want  # the attack: the liar's constant token, all the way
    assert client.verification.trips == 0 and not client.verification.banned()


def test_a_lying_last_stage_is_found_banned_and_the_tokens_are_an_honest_runs(ckpt, tmp_path):
    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens
    bad = _liar_token(want)
    bans_file = tmp_path / "bans.json"

    async def main():
        with trio.fail_after(120):
            # three peers a range (the liar and two honest at 4:8: one for the second chain, one referee; a ban needs
            # a referee outside both chains at every other range too)
            return await _run(ckpt, [*split, (0, 4), (4, 8), (4, 8), (0, 4)], (4, 8), lambda s: lie_constant(s, bad),
                              verify=1.0, bans_file=bans_file)

    res, liar, lies, client = trio.run(main)
    assert lies, "the liar was never chained"
    assert res.tokens == want
    assert liar not in res.route
    reasons = client.verification.banned()
    assert list(reasons) == [liar] and "wrong tokens" in reasons[liar] and str([bad]) in reasons[liar]
    ev = client.verification.events
    assert len(ev) == 1 and ev[0].verdict.liar == liar and ev[0].trip == 1  # caught on its first trip
    assert res.failovers == 1
    stats = client.stats  # what the API's /metrics exports
    assert (stats.generations, stats.failed, stats.tokens, stats.failovers, stats.liars_banned) == (1, 0, N, 1, 1)
    assert stats.verified_trips == res.verified_trips > 0
    from sangama_p2p.net.bans import load_bans

    assert [b.peer_id for b in load_bans(bans_file)] == [liar]  # kept for the next run and for `status`


def test_a_noisy_middle_stage_is_found_banned_and_the_tokens_are_an_honest_runs(ckpt):
    split = [(0, 3), (3, 5), (5, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens

    async def main():
        with trio.fail_after(150):
            return await _run(ckpt, [*split, (0, 3), (3, 5), (3, 5), (5, 8), (0, 3), (5, 8)], (3, 5),
                              lambda s: lie_noise(s, 3.0), verify=1.0)

    res, liar, lies, client = trio.run(main)
    assert lies, "the liar was never chained"
    assert res.tokens == want
    assert liar not in res.route
    assert list(client.verification.banned()) == [liar]
    assert [e.verdict.liar for e in client.verification.events] == [liar]


def test_with_two_peers_per_range_a_liar_in_the_second_chain_stays_undecided_and_the_tokens_are_right(ckpt):
    """No referee: the two peers of the liar's range explain the answers equally; nobody is banned, the generation
    keeps its own (honest) chain's tokens, and both peers are reported as disputed. (Not strict: strict
    verification keeps no trip that nobody could confirm, and fails such a generation, as the other-checkpoint test
    shows.)"""
    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens
    bad = _liar_token(want)

    async def main():
        with trio.fail_after(90):
            async with fleet(ckpt, [*split, (0, 4), (4, 8)], batch_invariant=True) as f:
                liar = f.stages[3][1]
                lie_constant(liar, bad)
                type(liar).throughput = property(lambda self: 1e-3)  # slow: the generation's chain avoids it
                async with ChainClient(f.clients[0], ClientConfig(MODEL, verify=1.0, verify_strict=False)) as client:
                    res = await client.generate(PROMPT, N)
                    return res, liar.peer_id, client

    res, liar, client = trio.run(main)
    assert res.tokens == want and liar not in res.route
    assert not client.verification.banned()
    assert liar in client.verification.disputed
    assert client.verification.events and all(e.verdict.liar is None for e in client.verification.events)


@pytest.mark.parametrize("private", [False, True])
def test_verification_is_on_by_default_in_public_swarms_and_off_in_private_fleets(private):
    from types import SimpleNamespace

    from sangama_p2p.client.verifier import Verification
    from sangama_p2p.client.verify import PUBLIC_FRACTION

    node = SimpleNamespace(config=SimpleNamespace(fleet_secret=b"s" * 32 if private else None))
    client = SimpleNamespace(node=node, config=ClientConfig(MODEL))
    v = Verification.for_client(client)
    assert v.fraction == (0.0 if private else PUBLIC_FRACTION)
    from sangama_p2p.client.session import SessionParams

    assert (v.start(SessionParams(MODEL, "me", 64)) is None) == private
    assert Verification.for_client(SimpleNamespace(node=node, config=ClientConfig(MODEL, verify=0.5))).fraction == 0.5


def test_a_spare_of_another_checkpoint_is_never_a_verifier_so_never_banned(ckpt, tmp_path):
    """Peers of another checkpoint under the same model id answer other tokens without lying: routing leaves them
    out, and so does verification (no second chain: the trips go unchecked, nobody is banned). At ``verify`` 1
    verification is strict: an unchecked trip is not kept, so the generation fails, saying why, and returns no
    token; with ``verify_strict=False`` it keeps them, said unverified."""
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.fingerprint import checkpoint_identity

    from .fleet import make_checkpoint

    other = open_checkpoint(make_checkpoint(tmp_path / "other", seed=1))
    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens

    async def main():
        with trio.fail_after(90):
            async with fleet(ckpt, split, batch_invariant=True) as f:
                for a, b in split:
                    await f.add_stage(a, b, ckpt=other, batch_invariant=True)
                pin = checkpoint_identity(ckpt).fingerprint  # chain the fleet's own checkpoint
                config = ClientConfig(MODEL, verify=1.0, fingerprint=pin, max_verify_reroutes=2)
                async with ChainClient(f.clients[0], config) as client:
                    with pytest.raises(RouteError, match="could not be verified") as strict:
                        await client.generate(PROMPT, N)
                    assert client.verification.refused >= 1 and not client.verification.banned()
                config = ClientConfig(MODEL, verify=1.0, verify_strict=False, fingerprint=pin)
                async with ChainClient(f.clients[0], config) as client:
                    res = await client.generate(PROMPT, N)
                    return res, client, strict.value

    res, client, strict = trio.run(main)
    assert "no second chain of other peers" in str(strict) and "2 re-routes for verification" in str(strict), strict
    v = client.verification
    assert res.tokens == want and not v.banned() and not v.events
    assert v.verified == 0 and v.unverifiable == v.trips == N


def test_honest_peers_computing_in_another_dtype_are_never_banned(ckpt):
    """A bf16 last stage and an fp32 one are both honest, and flip a near-tie now and then (this prompt: at trip 3,
    measured). Before the earlier-position rechecks, the fp32 peer was banned there, outvoted by two bf16 peers."""
    from .liars import _attractive

    prompt = [3, 1, 4, 1, 5, 12]

    async def main():
        with trio.fail_after(120):
            async with fleet(ckpt, [(0, 4), (4, 8), (0, 4)], batch_invariant=True) as f:
                _attractive(f.stages[1][1])  # the fp32 last stage: the generation's chain
                for _ in range(2):
                    await f.add_stage(4, 8, batch_invariant=True, dtype="bfloat16", wire_dtype="bf16")
                async with ChainClient(f.clients[0], ClientConfig(MODEL, verify=1.0)) as client:
                    res = await client.generate(prompt, 12)
                    return res, client.verification, f.stages[1][1].peer_id

    res, v, fp32 = trio.run(main)
    assert len(res.tokens) == 12
    assert not v.banned(), v.banned()
    assert v.events, "no disagreement this time: the test did not see a near-tie"
    assert all(e.verdict.liar is None and e.verdict.suspect is not None for e in v.events)
    assert v.events[0].verdict.suspect == fp32 and fp32 in v.disputed


@pytest.mark.parametrize("guesses, temperature", [(2, 0.0), (0, 1.0)])
def test_honest_chains_verify_equal_with_guesses_and_seeded_sampling_and_chunked_catch_up(ckpt, guesses,
                                                                                           temperature):
    """Every trip re-run on the second chain agrees (the catch-up is chunked: max_step_tokens = 4), nobody is
    judged, and the tokens are the one-process run's."""
    from sangama_p2p.model.sampling import SamplingParams

    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(
        PROMPT, N, SamplingParams(temperature=temperature, seed=11), guesses=guesses).tokens

    async def main():
        with trio.fail_after(120):
            async with fleet(ckpt, [*split, *split], batch_invariant=True) as f:
                config = ClientConfig(MODEL, verify=1.0, max_step_tokens=4)
                async with ChainClient(f.clients[0], config) as client:
                    res = await client.generate(PROMPT, N, guesses=guesses, temperature=temperature, seed=11)
                    return res, client.verification

    res, v = trio.run(main)
    assert res.tokens == want
    assert not v.events and not v.banned()
    assert v.verified == v.trips == res.steps + 1 - (len(PROMPT) - 1) // 4  # every kept trip (prefill chunks are not)
    assert (res.verified_trips, res.unverified_trips) == (v.verified, 0)


def test_a_verifying_chain_late_once_is_given_more_time_and_every_trip_is_still_verified(ckpt):
    """The loaded suite once verified 0 of 12 trips: the second chain's first (catch-up) trip missed its deadline,
    its peers were skipped for the generation, and every later trip went unverified. Now a late chain is opened
    again with LATE_GRACE x the time, once per generation; only a second miss skips it."""
    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens

    async def main():
        with trio.fail_after(120):
            async with fleet(ckpt, [*split, *split], batch_invariant=True) as f:
                spare = f.stages[2][1]
                for _, s, _ in f.stages[2:]:  # the spares announce 1 step/s: the generation's chain is the first two
                    modest(s)
                real, held = spare._on_step, []

                def late_once(*args, **kwargs):  # the spare's first step answers 2.5 s late
                    if held:
                        return real(*args, **kwargs)
                    held.append(1)

                    async def later():
                        await trio.sleep(2.5)
                        real(*args, **kwargs)
                    f._nursery.start_soon(later)

                spare._on_step = late_once
                config = ClientConfig(MODEL, verify=1.0, stall_factor=0.0, stall_floor_s=0.25)  # deadline 1 s
                async with ChainClient(f.clients[0], config) as client:
                    res = await client.generate(PROMPT, N)
                    return res, client.verification, held, {s.peer_id for _, s, _ in f.stages[:2]}

    res, v, held, first = trio.run(main)
    assert held and set(res.route) == first
    assert res.tokens == want
    assert v.verified == v.trips > 0 and v.unverifiable == 0 and not v.events
    assert (res.verified_trips, res.unverified_trips) == (v.verified, 0)  # said with the result (and by the CLI)


@pytest.mark.parametrize("streaming", [False, True])
def test_a_lie_caught_after_unverified_tokens_rewinds_or_stops_the_stream_never_a_silent_retraction(ckpt,
                                                                                                 streaming):
    """Issue 26: with ``--verify`` below 1 a liar's tokens of unverified trips are returned before a later trip is
    caught; the verifier then cut ``out`` back while the loop went on from the lied position (a result with a gap)
    and a stream had already shown them. Now a generation rewinds to the last verified token and goes on around the
    liar (the result is an honest run's), and a stream stops with TokensRetracted instead of taking tokens back."""
    from sangama_p2p.client.verifier import TripVerifier, Verification
    from sangama_p2p.errors import TokensRetracted

    split = [(0, 4), (4, 8)]
    want = local_chain(ckpt, split, batch_invariant=True).generate(PROMPT, N).tokens
    bad = _liar_token(want)

    async def main():
        with trio.fail_after(120):
            async with fleet(ckpt, [*split, (0, 4), (4, 8), (4, 8), (0, 4)], batch_invariant=True) as f:
                same = [s for _, s, _ in f.stages if (s.model.start, s.model.end) == (4, 8)]
                liar = same[0]
                lie_constant(liar, bad)
                for honest in same[1:]:  # 1 step/s: RTT noise on a loaded machine never outweighs the liar's boast
                    modest(honest)
                async with ChainClient(f.clients[0], ClientConfig(MODEL, verify=0.5)) as client:
                    # the coin: trip 1 (the prefill) unverified, trip 2 verified
                    v: Verification = client.verification
                    v.start = lambda params: TripVerifier(v, params, random.Random(15))  # type: ignore[method-assign]
                    if not streaming:
                        return await client.generate(PROMPT, N), liar.peer_id, client, None
                    got: list[int] = []
                    try:
                        async for tok in client.stream(PROMPT, N):
                            got.append(tok)
                    except TokensRetracted as exc:
                        return got, liar.peer_id, client, exc
                    return got, liar.peer_id, client, None

    res, liar, client, err = trio.run(main)
    assert list(client.verification.banned()) == [liar]
    if streaming:
        assert err is not None and res == [bad] and (err.kept, err.retracted) == (0, 1), (res, err)
    else:
        assert res.tokens == want and res.retracted == 1 and liar not in res.route and err is None
        assert "taken back" in res.failover_note()
