"""A stage refuses hidden states holding NaN or Inf (``NON_FINITE``): the client tries once without the peer that
computed them, and when another peer computes the same, the input is the cause: one typed error, not retried."""

from __future__ import annotations

import pytest
import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.client.session import NonFiniteHidden
from sangama_p2p.errors import ErrorCode, StageError

from .fleet import MODEL, fleet, local_chain

SPLIT = [(0, 4), (4, 8)]
PROMPT = [3, 1, 4, 1, 5, 9]


def _poison(server) -> None:
    """The stage's layers compute NaN from now on (a broken device or copy of the weights, or an input that
    overflows the model: the stage after it cannot tell which)."""
    real = server.model.forward
    server.model.forward = lambda steps: real(steps) * float("nan")


def test_one_peer_computing_nan_is_routed_around_with_the_same_tokens(ckpt):
    want = local_chain(ckpt, SPLIT, batch_invariant=True).generate(PROMPT, 12).tokens

    async def main():
        with trio.fail_after(90):
            async with fleet(ckpt, [*SPLIT, (0, 4)], batch_invariant=True) as f:
                async with ChainClient(f.clients[0], ClientConfig(MODEL, step_timeout=10)) as client:
                    poisoned: list[str] = []

                    def on_tokens(new):
                        if poisoned:
                            return
                        for node, server, _ in f.stages:  # the first stage this generation uses
                            if server.model.start == 0 and server.table.sessions:
                                _poison(server)
                                poisoned.append(node.peer_id.to_base58())
                                return

                    res = await client.generate(PROMPT, 12, on_tokens=on_tokens)
        return res, poisoned

    res, poisoned = trio.run(main)
    assert len(poisoned) == 1
    assert res.tokens == want and res.failovers == 1
    assert poisoned[0] not in res.route


def test_nan_from_two_peers_is_one_typed_error_naming_both(ckpt):
    async def main():
        with trio.fail_after(90):
            async with fleet(ckpt, [*SPLIT, (0, 4)]) as f:
                firsts = [(n.peer_id.to_base58(), s) for n, s, _ in f.stages if s.model.start == 0]
                for _, server in firsts:
                    _poison(server)
                async with ChainClient(f.clients[0], ClientConfig(MODEL, step_timeout=10)) as client:
                    with pytest.raises(NonFiniteHidden) as info:
                        await client.generate(PROMPT, 12)
                    assert not client.active  # the sessions were closed
        return info.value, [p for p, _ in firsts]

    err, peers = trio.run(main)
    assert isinstance(err, StageError) and err.code == ErrorCode.NON_FINITE
    assert "for this input" in str(err) and all(p in str(err) for p in peers), err
