"""A survey does not wait out a dead peer's probe (issue 25: "a dead peer must not cost each client a dial
timeout"): once the peers that answered chain the whole model, the rest get a short while more, and answer into
the survey later."""

from __future__ import annotations

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.client.probes import covers
from sangama_p2p.client.routing import RouteCandidate
from sangama_p2p.wire.messages import InfoRequest

from .fleet import MODEL, fleet, local_chain

SPLIT = [(0, 4), (4, 8)]
PROMPT = [2, 7, 1, 8]


def _silent_to_probes(server, until: trio.Event) -> None:
    """``server`` takes its stage streams but holds every InfoRequest unanswered until ``until`` is set (a peer
    whose machine died looks like this to a probe), then answers them."""
    real = server._dispatch

    async def later(fs, outbox, msg, recv_ns):
        await until.wait()
        real(fs, outbox, msg, recv_ns)

    def dispatch(fs, outbox, msg, recv_ns):
        if isinstance(msg, InfoRequest) and not until.is_set():
            server._nursery.start_soon(later, fs, outbox, msg, recv_ns)
            return None
        return real(fs, outbox, msg, recv_ns)

    server._dispatch = dispatch


def test_a_survey_settles_once_a_route_exists_and_a_late_peer_answers_into_it_later(ckpt):
    want = local_chain(ckpt, SPLIT).generate(PROMPT, 8).tokens

    async def main():
        with trio.fail_after(120):
            async with fleet(ckpt, [*SPLIT, (4, 8)]) as f:
                wake = trio.Event()
                node, quiet, _ = f.stages[2]
                _silent_to_probes(quiet, wake)
                silent = node.peer_id.to_base58()
                # a probe time-out far above the settling (0.25 s, or 4x the slowest answer); no verifying (a
                # drawn trip's search for a second chain - the silent peer is the only one - waits for every probe)
                config = ClientConfig(MODEL, probe_timeout=30.0, verify=0)
                async with ChainClient(f.clients[0], config) as client:
                    t0 = trio.current_time()
                    offers = await client.survey()
                    took = trio.current_time() - t0
                    assert silent not in {o.peer_id for o in offers} and covers(offers, 8)
                    res = await client.generate(PROMPT, 8)
                    wake.set()  # its answer to the probe still in flight joins the survey the client holds
                    with trio.move_on_after(20):
                        while silent not in {o.peer_id for o in client.offers}:
                            await trio.sleep(0.05)
                    return took, res, silent in {o.peer_id for o in client.offers}

    took, res, joined = trio.run(main)
    assert took < 10.0, took  # not the 30 s probe time-out
    assert res.tokens == want and joined


def test_covers_needs_one_fingerprint_chaining_every_layer():
    def c(peer, a, b, fp="x"):
        return RouteCandidate(peer, a, b, 1.0, 0, 1, 0.001, (), fp, 8, (), (), "tcp")

    assert covers([c("a", 0, 4), c("b", 4, 8)], 8)
    assert not covers([c("a", 0, 4), c("b", 5, 8)], 8)
    assert not covers([c("a", 0, 4), c("b", 4, 8, "y")], 8)  # two checkpoints chain nothing
    assert covers([c("a", 0, 3), c("b", 0, 4), c("c", 4, 8)], 8) and not covers([c("a", 0, 8)], 0)
