"""Partial frames against a stage over loopback (issue 23, item 2): length prefixes that are never followed by their
bytes must not hold the stage's input budget (the old code reserved each announced length up front, so 16 bytes
held 256 MiB and long prompts failed), one peer's real bytes stay within its share, and a partial frame that does
not complete in time closes its stream with a typed error. Bounded: a 4 MiB budget, a few streams and lanes."""

from __future__ import annotations

import struct

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.net.lane import open_lane
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.codec import encode_message_frame
from sangama_p2p.wire.messages import InfoRequest, InfoResponse

from ..hostile import answer_of, raw_stage_stream

SPLIT = [(0, 4), (4, 8)]
MiB = 1 << 20
KiB = 1 << 10
# 1,500 tokens: the first stage forwards 1,500 x 64 fp32 hidden states (384,000 bytes), more than one read takes
LONG = [1 + (i * 7) % 15 for i in range(1500)]


async def _hold_prefix(fs: FramedStream, announced: int, then: bytes = b"") -> None:
    """A whole InfoRequest, a prefix announcing ``announced`` bytes and ``then`` in one write; the stage has read
    the prefix once its InfoResponse is back (both came in one chunk)."""
    await fs.stream.write(encode_message_frame(InfoRequest()) + struct.pack(">I", announced) + then)
    assert isinstance(await fs.recv(), InfoResponse)


def test_length_prefixes_hold_no_budget_one_peer_keeps_to_its_share_and_long_prompts_succeed(ckpt, fl):
    want = fl.local_chain(ckpt, SPLIT).generate(LONG, 4).tokens
    answers: list[str] = []

    async def main():
        with trio.fail_after(120):
            async with fl.fleet(ckpt, SPLIT, clients=2, input_budget=4 * MiB, input_per_peer=1 * MiB,
                                partial_frame_s=600) as f:
                legit, attacker = f.clients
                servers = [server for _, server, _ in f.stages]
                held = []
                for server in servers:  # four streams per stage, each announcing a quarter of the budget
                    for _ in range(4):
                        fs = await raw_stage_stream(attacker, server.node.peer_id, server.node.listen_addrs())
                        await _hold_prefix(fs, 1 * MiB - 4)
                        held.append(fs)
                me = attacker.peer_id.to_base58()
                assert [s.input_budget.used for s in servers] == [0, 0]  # the old code: 4 MiB each, all of it
                # the same peer now sends real bytes on six more streams to the second stage: 6 x 300 KiB is over
                # its 1 MiB share, so at most three keep theirs and the others are closed
                second = servers[1]
                pushed = []
                for _ in range(6):
                    fs = await raw_stage_stream(attacker, second.node.peer_id, second.node.listen_addrs())
                    await _hold_prefix(fs, 1 * MiB - 4, bytes(300 * KiB))
                    pushed.append(fs)

                async def answer(fs: FramedStream) -> None:
                    answers.append(await answer_of(fs, 2.0))

                async with trio.open_nursery() as nursery:
                    for fs in pushed:
                        nursery.start_soon(answer, fs)
                assert answers.count("error:CAPACITY") >= 3, answers
                assert second.input_budget.held_by(me) <= 1 * MiB
                assert second.input_budget.peak <= 1 * MiB
                # while all of that is held, a long prompt goes through (its hidden states arrive in several reads)
                async with ChainClient(legit, ClientConfig(fl.MODEL)) as client:
                    got = (await client.generate(LONG, 4)).tokens
                assert got == want
                for fs in held:  # the prefixes' streams are still open: they only lost the power to block others
                    assert await answer_of(fs, 0.01) == "silent"
                    await fs.aclose(reset=True)
                for fs in pushed:
                    await fs.aclose(reset=True)
                with trio.fail_after(5):
                    while any(s.input_budget.used for s in servers):
                        await trio.sleep(0.05)

    trio.run(main)


def test_a_partial_frame_or_record_that_does_not_complete_in_time_closes_its_stream(ckpt, fl):
    results: list[str] = []

    async def main():
        with trio.fail_after(60):
            async with fl.fleet(ckpt, [(0, 8)], clients=1, partial_frame_s=0.5) as f:
                server = f.stages[0][1]
                a = f.clients[0]
                fs = await raw_stage_stream(a, server.node.peer_id, server.node.listen_addrs())
                await _hold_prefix(fs, 1000, b"only part of it")
                lane = await open_lane(a, server.node.peer_id)
                await lane.sock.send_all(struct.pack(">I", 5000) + bytes(100))  # a record cut short on the lane
                on_lane = FramedStream(lane)
                for stream in (fs, on_lane):  # the stage says why, then closes
                    results.extend([await answer_of(stream, 10.0), await answer_of(stream, 10.0)])
                assert server.input_budget.used == 0
                assert not server._inbound
                await fs.aclose()
                await on_lane.aclose()

    trio.run(main)
    assert results == ["error:CAPACITY", "closed"] * 2, results
