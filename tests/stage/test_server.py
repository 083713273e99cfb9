"""Stage servers on loopback: ownership, two clients, memory limits, typed refusals over the wire."""

from __future__ import annotations

import os
from contextlib import aclosing

import pytest
import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.errors import ErrorCode, StageError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.messages import (
    CloseSession,
    ErrorMessage,
    InfoRequest,
    InfoResponse,
    OpenSession,
    SessionOpened,
    Step,
)
from sangama_p2p.wire.protocols import STAGE_PROTOCOL, WIRE_VERSION

SPLIT = [(0, 4), (4, 8)]


async def _raw(client_node, server) -> FramedStream:
    """A stage stream from ``client_node`` to ``server``'s node."""
    await client_node.connect(server.node.peer_id, server.node.listen_addrs())
    return FramedStream(await client_node.host.new_stream(server.node.peer_id, [STAGE_PROTOCOL]))


def _open(sid, client, start, end, next_hop, length=64, prev_hop=None):
    return OpenSession(sid, "test-org/tiny-pipeline", start, end, next_hop, prev_hop, client, length, 0.0, 1.0, 0, 0,
                       False)


def test_a_client_cannot_step_close_or_claim_a_session_it_did_not_open(ckpt, fl):
    async def main():
        with trio.fail_after(60):
            async with fl.fleet(ckpt, SPLIT, clients=2) as f:
                (_, s1, _), (_, s2, _) = f.stages
                a, b = f.clients
                a_id = a.peer_id.to_base58()
                sa1, sa2, sb1, sb2 = [await _raw(n, s) for n in (a, b) for s in (s1, s2)]
                sid = os.urandom(16)
                await sa1.send(_open(sid, a_id, 0, 4, s2.peer_id))
                await sa2.send(_open(sid, a_id, 4, 8, None, prev_hop=s1.peer_id))
                assert isinstance(await sa1.recv(), SessionOpened)
                assert isinstance(await sa2.recv(), SessionOpened)
                # B claims to be A when opening a session of its own: refused
                await sb1.send(_open(os.urandom(16), a_id, 0, 4, s2.peer_id))
                refusal = await sb1.recv()
                assert isinstance(refusal, ErrorMessage) and refusal.code == ErrorCode.NOT_OWNER
                # A's first trip: stage 2 takes it from stage 1, the upstream A named
                await sa1.send(Step(sid, 0, 0, (1, 2, 3), None, (), ()))
                first = await sa2.recv()
                assert first.step == 0 and len(first.tokens) == 1 and len(first.trace) == 2
                # B steps, rolls back or closes A's session on either stage: NOT_OWNER, nothing changes
                for stream in (sb1, sb2):
                    await stream.send(Step(sid, 1, 0, (1,), None, (), ()))
                    err = await stream.recv()
                    assert isinstance(err, ErrorMessage) and err.code == ErrorCode.NOT_OWNER and err.session_id == sid
                    await stream.send(CloseSession(sid))
                    err = await stream.recv()
                    assert isinstance(err, ErrorMessage) and err.code == ErrorCode.NOT_OWNER
                await sb1.send(Step(os.urandom(16), 0, 0, (1,), None, (), ()))
                assert (await sb1.recv()).code == ErrorCode.UNKNOWN_SESSION
                assert sid in s1.table.sessions and s1.table.sessions[sid].state.position == 3
                # A's next trip continues where it was: the same token as a plain run of 4 tokens
                tok = first.tokens[0]
                await sa1.send(Step(sid, 1, 3, (tok,), None, (), ()))
                second = await sa2.recv()
                assert second.step == 1
                chain = fl.local_chain(ckpt, SPLIT)
                assert [first.tokens[0], second.tokens[0]] == chain.generate([1, 2, 3], 2).tokens
                # a bad position is the owner's error, sent to the owner, and the session survives it
                await sa1.send(Step(sid, 2, 9, (tok,), None, (), ()))
                err = await sa1.recv()
                assert err.code == ErrorCode.BAD_POSITION and err.step == 2
                await sa1.send(InfoRequest())
                info = await sa1.recv()
                assert isinstance(info, InfoResponse) and (info.start, info.end) == (0, 4) and info.throughput > 0
                # the owner's stream ends: its sessions are freed on that stage
                await sa1.aclose()
                with trio.fail_after(5):
                    while sid in s1.table.sessions:
                        await trio.sleep(0.02)
                assert s1.table.used_bytes == 0

    trio.run(main)


def test_two_clients_sessions_never_mix(ckpt, fl):
    prompts = [[1, 2, 3, 4], [9, 8, 7]]
    chain = fl.local_chain(ckpt, SPLIT)
    want = [chain.generate(p, 12, guesses=2).tokens for p in prompts]

    async def main():
        got = [None, None]
        with trio.fail_after(60):
            async with fl.fleet(ckpt, SPLIT, clients=2) as f:
                async def run(i):
                    async with ChainClient(f.clients[i], ClientConfig(fl.MODEL)) as client:
                        got[i] = await client.generate(prompts[i], 12, guesses=2)

                async with trio.open_nursery() as nursery:
                    for i in range(2):
                        nursery.start_soon(run, i)
        return got

    got = trio.run(main)
    assert [r.tokens for r in got] == want


def test_a_full_stage_refuses_new_sessions_while_running_ones_continue(ckpt, fl):
    c = open_checkpoint(ckpt)
    length = 4 + 24 + 1  # prompt + new tokens + 1, no guesses
    need = max(StageModel.load(c.spec, c.source, a, b).session_bytes(length, 0) for a, b in SPLIT)
    chain = fl.local_chain(ckpt, SPLIT)
    prompts = [[1, 2, 3, 4], [4, 3, 2, 1]]
    want = [chain.generate(p, 24).tokens for p in prompts]

    async def main():
        got: list[list[int]] = [[], []]
        with trio.fail_after(90):
            async with fl.fleet(ckpt, SPLIT, memory_budget=int(2.5 * need), typical_session_length=length) as f:
                async with ChainClient(f.clients[0], ClientConfig(fl.MODEL, max_failovers=1)) as client:
                    # two generations hold their sessions, paused after their first token (no race with the refusal)
                    async with aclosing(client.stream(prompts[0], 24)) as one, \
                            aclosing(client.stream(prompts[1], 24)) as two:
                        for i, tokens in enumerate((one, two)):
                            got[i].append(await tokens.__anext__())
                        assert all(len(s.table.sessions) == 2 for _, s, _ in f.stages)
                        with pytest.raises(StageError) as info:
                            await client.generate([5, 6, 7, 8], 24)
                        assert info.value.code == ErrorCode.CAPACITY
                        for i, tokens in enumerate((one, two)):  # the two continue
                            got[i].extend([tok async for tok in tokens])
        return got

    got = trio.run(main)
    assert got == want


def test_a_bad_field_fails_only_its_session_and_garbage_closes_only_that_stream(ckpt, fl):
    import struct

    import msgpack

    from sangama_p2p.wire.framing import encode_frame

    def payload(tag, fields):
        header = msgpack.packb(fields, use_bin_type=True)
        return struct.pack(">BBI", WIRE_VERSION, tag, len(header)) + header

    async def main():
        with trio.fail_after(60):
            async with fl.fleet(ckpt, [(0, 8)], clients=2) as f:
                (_, server, _), (a, b) = f.stages[0], f.clients
                sa, sb = await _raw(a, server), await _raw(b, server)
                sid = os.urandom(16)
                await sa.send(_open(sid, a.peer_id.to_base58(), 0, 8, None))
                assert isinstance(await sa.recv(), SessionOpened)
                # a Step whose guess is out of range: the session and step are readable, so only it fails
                await sa.send_frame(encode_frame(payload(3, [sid, 4, 0, [1, 2], None, [2**31], [], False])))
                err = await sa.recv()
                assert err.code == ErrorCode.BAD_FRAME and err.session_id == sid and err.step == 4
                await sa.send(Step(sid, 5, 0, (1, 2), None, (), ()))  # the stream and the session still work
                res = await sa.recv()
                assert res.step == 5 and len(res.tokens) == 1
                # more guesses than the session was opened with; token ids out of the vocabulary
                await sa.send(Step(sid, 6, 2, (3, 4), None, (4,), ()))
                assert (await sa.recv()).code == ErrorCode.TOO_MANY_GUESSES
                await sa.send(Step(sid, 6, 2, (10**6,), None, (), ()))
                assert (await sa.recv()).code == ErrorCode.BAD_FRAME
                # garbage: B's stream is closed, A's stream and session are untouched
                await sb.send_frame(b"\x00\x00\x00\x03abc")
                with trio.fail_after(5):
                    while True:
                        msg = await sb.recv()
                        if msg is None:
                            break
                        assert isinstance(msg, ErrorMessage) and msg.session_id is None
                await sa.send(Step(sid, 7, 2, (res.tokens[0],), None, (), ()))
                assert (await sa.recv()).step == 7

    trio.run(main)


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_non_finite_hidden_states_are_refused_to_their_owner_with_a_typed_code(ckpt, fl, poison):
    import torch

    from sangama_p2p.tensors import to_wire

    async def main():
        with trio.fail_after(60):
            async with fl.fleet(ckpt, [(4, 8)], clients=1) as f:
                (_, server, _), (a,) = f.stages[0], f.clients
                s = await _raw(a, server)
                good, bad = os.urandom(16), os.urandom(16)
                for sid in (good, bad):
                    await s.send(_open(sid, a.peer_id.to_base58(), 4, 8, None))
                    assert isinstance(await s.recv(), SessionOpened)
                width = server.model.spec.hidden_size
                hidden = torch.randn(2, width)
                poisoned = hidden.clone()
                poisoned[1, 7] = poison
                await s.send(Step(bad, 3, 0, (1, 2), to_wire(poisoned, "bf16"), (), ()))
                await s.send(Step(good, 4, 0, (1, 2), to_wire(hidden, "bf16"), (), ()))
                replies = {msg.session_id: msg for msg in [await s.recv(), await s.recv()]}
                err = replies[bad]
                assert isinstance(err, ErrorMessage) and err.code == ErrorCode.NON_FINITE and err.step == 3
                assert replies[good].step == 4 and len(replies[good].tokens) == 1

    trio.run(main)


def test_a_grammar_holds_the_last_stage_and_is_refused_elsewhere(tmp_path, fl):
    """Through ChainClient: output held to a schema (guesses asked for are off); over raw streams: a grammar sent to
    a stage before the last, or one the engine cannot compile, is a BAD_FRAME for that session only."""
    import json

    from sangama_p2p.model.constraint import json_grammar

    ckpt = fl.make_checkpoint(tmp_path, vocab=None)  # the made tokenizer's 1000 tokens spell JSON
    c = open_checkpoint(ckpt)
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [7, 8]}},
              "required": ["ok", "n"], "additionalProperties": False}
    grammar = json_grammar(schema)

    async def main():
        with trio.fail_after(90):
            async with fl.fleet(ckpt, SPLIT) as f:
                async with ChainClient(f.clients[0], ClientConfig(fl.MODEL)) as client:
                    held = await client.generate([5, 9, 2], 24, guesses=2, grammar=grammar,
                                                 stop_tokens=c.spec.eos_token_ids)
                    free = await client.generate([5, 9, 2], 24, guesses=2)
                (_, s1, _), (_, s2, _) = f.stages
                me = f.clients[0].peer_id.to_base58()
                first, last = await _raw(f.clients[0], s1), await _raw(f.clients[0], s2)
                sid = os.urandom(16)
                bad = OpenSession(sid, fl.MODEL, 0, 4, s2.peer_id, None, me, 64, 0.0, 1.0, 0, 0, False, None, grammar)
                await first.send(bad)
                refused = await first.recv()
                sid2 = os.urandom(16)
                await last.send(OpenSession(sid2, fl.MODEL, 4, 8, None, s1.peer_id, me, 64, 0.0, 1.0, 0, 0, False,
                                            None, '{"grammars": [{"nope": 1}]}', 3))
                broken = await last.recv()
                await last.send(_open(os.urandom(16), me, 4, 8, None, prev_hop=s1.peer_id))  # the stream goes on
                fine = await last.recv()
        return held, free, refused, broken, fine

    held, free, refused, broken, fine = trio.run(main)
    text = c.tokenizer.decode([t for t in held.tokens if t not in c.spec.eos_token_ids])
    value = json.loads(text)
    assert isinstance(value["ok"], bool) and value["n"] in (7, 8), text
    assert held.tokens[-1] in c.spec.eos_token_ids and held.guesses_proposed == 0
    assert free.tokens != held.tokens
    assert isinstance(refused, ErrorMessage) and refused.code == ErrorCode.BAD_FRAME and "last stage" in refused.message
    assert isinstance(broken, ErrorMessage) and broken.code == ErrorCode.BAD_FRAME and "grammar" in broken.message
    assert isinstance(fine, SessionOpened)
