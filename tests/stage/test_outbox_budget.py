"""One stage-wide budget for every outbox (issue 23, item 4): 16 lanes (8 from each of two peer ids) that send
requests and never read the replies must not queue more than ``outbox_budget`` between them; the queues holding the
most are failed and their lanes closed, and a legitimate client still generates. Bounded by state, not by time:
each lane floods until the stage stops reading it (its queue is over ``outbox_bytes``) or fails its queue."""

from __future__ import annotations

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.net.lane import open_lane

from ..hostile import flood_unread_until

ONE = [(0, 8)]
PROMPT = [1, 5, 9, 2, 7, 3]
MiB = 1 << 20
PER_PEER = 8  # lanes from each attacking identity (max_lanes_per_peer)
BUDGET = 4 * MiB  # four lanes' worth of outbox_bytes, as the defaults (64 MiB per stream, 256 MiB in all)


def _queued(boxes) -> int:
    return sum(o.queued_bytes for o in boxes if o.failed is None)


def test_sixteen_unread_lanes_stay_within_the_outbox_budget_and_a_client_still_generates(ckpt, fl):
    want = fl.local_chain(ckpt, ONE).generate(PROMPT, 6).tokens
    peak = [0]
    sent: list[int] = []

    async def main():
        with trio.fail_after(150):
            async with fl.fleet(ckpt, ONE, clients=3, outbox_bytes=1 * MiB, outbox_budget=BUDGET,
                                max_frame=2 * MiB) as f:
                server = f.stages[0][1]
                boxes: list = []  # the stage's reply outbox of each attacking lane
                lanes: list = []  # held: a lane dropped would be closed by the garbage collector

                async def watch():
                    while True:
                        peak[0] = max(peak[0], _queued({*server._inbound.values(), *boxes}))
                        await trio.sleep(0.005)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    for attacker in f.clients[:2]:
                        await attacker.connect(server.node.peer_id, server.node.listen_addrs())
                        for _ in range(PER_PEER):
                            before = set(server._inbound)
                            lane = await open_lane(attacker, server.node.peer_id)
                            lanes.append(lane)
                            while not set(server._inbound) - before:
                                await trio.sleep(0.01)
                            (fs,) = set(server._inbound) - before
                            box = server._inbound[fs]
                            boxes.append(box)
                            n, _ = await flood_unread_until(lane, lambda b=box: b.congested or b.failed is not None)
                            sent.append(n)
                    queued = _queued(boxes)  # the old code: every lane still open with ~1 MiB queued
                    # the lanes still open keep their replies unread while a real client generates
                    async with ChainClient(f.clients[2], ClientConfig(fl.MODEL)) as client:
                        got = (await client.generate(PROMPT, 6)).tokens
                    nursery.cancel_scope.cancel()
                failed = [b for b in boxes if b.failed is not None]
                print(f"16 unread lanes: {sum(sent)} requests, queued {queued / MiB:.2f} MiB after the flood, peak"
                      f" {peak[0] / MiB:.2f} MiB (budget {BUDGET / MiB:.0f}), {len(failed)} outboxes failed")
                assert queued <= BUDGET and peak[0] <= BUDGET, (queued / MiB, peak[0] / MiB)
                assert server.outbox_budget.peak <= BUDGET
                assert got == want
                # at most 3 lanes' ~1 MiB fit: the others were failed as the largest, and their lanes reset at once
                assert len(failed) >= 2 * PER_PEER - BUDGET // MiB, [b.queued_bytes for b in boxes]
                assert all(b.congested for b in boxes if b.failed is None)
                with trio.fail_after(10):
                    while any(b.stream in server._inbound for b in failed):
                        await trio.sleep(0.05)
                assert all(b.stream.closed for b in failed)
                for lane in lanes:
                    await lane.reset()

    trio.run(main)
