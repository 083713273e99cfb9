"""Malformed frames and non-finite hidden states sent to a running stage over the network (issue 15): each is
answered with a typed error or a closed stream, the stage keeps serving, and a generation through it afterwards
gives the local chain's tokens. Loopback, bounded: 7 kinds x 3 frames, over libp2p streams and lanes."""

from __future__ import annotations

import math
import os
import random

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.net.lane import open_lane
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.messages import CloseSession, InfoRequest, SessionOpened, Step

from ..hostile import FUZZ_KINDS, answer_of, decodes, fuzz_frame, non_finite_hidden, open_session, raw_stage_stream

SPLIT = [(0, 4), (4, 8)]
PROMPT = [2, 7, 1, 8, 2, 8]


def test_fuzzed_frames_and_non_finite_steps_get_typed_answers_and_the_stage_keeps_serving(ckpt, fl):
    want = fl.local_chain(ckpt, SPLIT).generate(PROMPT, 8).tokens
    rng = random.Random(15)
    answers: dict[str, set[str]] = {}

    async def main():
        with trio.fail_after(120):
            async with fl.fleet(ckpt, SPLIT, clients=2) as f:
                server = f.stages[1][1]
                pid, addrs = server.node.peer_id, server.node.listen_addrs()
                a = f.clients[1]
                width = server.model.spec.hidden_size
                for kind in FUZZ_KINDS:
                    for i in range(3):
                        frame = fuzz_frame(rng, kind, width=width, max_frame=server.config.max_frame)
                        if i == 2:  # the last of each kind on a lane: the same decoder behind AES-GCM records
                            stream = await open_lane(a, pid)
                            await stream.write(frame)
                            if kind == "truncated":
                                await stream.sock.send_eof()
                            fs = FramedStream(stream)
                        else:
                            fs = await raw_stage_stream(a, pid, addrs)
                            await fs.stream.write(frame)
                            if kind == "truncated":
                                await fs.stream.close()  # our end of the stream: the stage sees the cut
                        if not decodes(frame):  # a bit flip may leave a well-formed message: any answer is fair
                            answers.setdefault(kind, set()).add(await answer_of(fs, 5))
                        await fs.aclose()
                fs = await raw_stage_stream(a, pid, addrs)
                for value in (math.nan, math.inf, -math.inf):
                    sid = os.urandom(16)
                    await fs.send(open_session(sid, a.peer_id.to_base58(), model_id=fl.MODEL, start=4, end=8))
                    assert isinstance(await fs.recv(), SessionOpened)
                    await fs.send(Step(sid, 0, 0, (1, 2, 3), non_finite_hidden(3, width, value, at=width + 5), (), ()))
                    answers.setdefault(f"hidden {value}", set()).add(await answer_of(fs, 5))
                    await fs.send(CloseSession(sid))
                await fs.send(InfoRequest())  # the stream that carried them still works
                assert await answer_of(fs, 5) == "reply:InfoResponse"
                async with ChainClient(f.clients[0], ClientConfig(fl.MODEL)) as client:
                    return (await client.generate(PROMPT, 8)).tokens

    tokens = trio.run(main)
    assert tokens == want
    for kind in ("hidden nan", "hidden inf", "hidden -inf"):
        assert answers[kind] == {"error:NON_FINITE"}, answers
    for kind in FUZZ_KINDS:  # never silence (a hang) and never a normal reply to a malformed frame
        assert all(a == "closed" or a.startswith("error:") for a in answers[kind]), answers
    print(answers)
