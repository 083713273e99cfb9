"""One stage-wide budget for every outbox (issue 23, item 4): 16 lanes (8 from each of two peer ids) that send
requests and never read the replies must not queue more than ``outbox_budget`` between them; the queues holding the
most are failed and their lanes closed, and a legitimate client still generates. Bounded: 16 lanes, 8 s of requests."""

from __future__ import annotations

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.net.lane import open_lane

from ..hostile import flood_unread

ONE = [(0, 8)]
PROMPT = [1, 5, 9, 2, 7, 3]
MiB = 1 << 20
PER_PEER = 8  # lanes from each attacking identity (max_lanes_per_peer)
FLOOD_S = 8.0


def _queued(server) -> int:
    """Bytes queued by the stage's live outboxes (replies to its streams and lanes, frames to its next hops)."""
    boxes = [*server._inbound.values(), *server.next_hops.links.values()]
    return sum(o.queued_bytes for o in boxes if o.failed is None)


def test_sixteen_unread_lanes_stay_within_the_outbox_budget_and_a_client_still_generates(ckpt, fl):
    want = fl.local_chain(ckpt, ONE).generate(PROMPT, 6).tokens
    budget = 4 * MiB
    floods: list[tuple[int, bool]] = []
    peak = [0]

    async def main():
        with trio.fail_after(120):
            async with fl.fleet(ckpt, ONE, clients=3, outbox_bytes=1 * MiB, outbox_budget=budget,
                                max_frame=2 * MiB) as f:
                server = f.stages[0][1]
                lanes = []
                for attacker in f.clients[:2]:
                    await attacker.connect(server.node.peer_id, server.node.listen_addrs())
                    lanes += [await open_lane(attacker, server.node.peer_id) for _ in range(PER_PEER)]

                async def watch():
                    while True:
                        peak[0] = max(peak[0], _queued(server))
                        await trio.sleep(0.005)

                async def flood(lane):
                    floods.append(await flood_unread(lane, FLOOD_S))

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch)
                    async with trio.open_nursery() as attack:
                        for lane in lanes:
                            attack.start_soon(flood, lane)
                    # the lanes that are still open keep their replies unread while a real client generates
                    async with ChainClient(f.clients[2], ClientConfig(fl.MODEL)) as client:
                        got = (await client.generate(PROMPT, 6)).tokens
                    nursery.cancel_scope.cancel()
                print(f"16 unread lanes: {sum(n for n, _ in floods)} requests, {sum(c for _, c in floods)} lanes"
                      f" closed, queued peak {peak[0] / MiB:.2f} MiB (budget {budget / MiB:.0f})")
                assert got == want
                for lane in lanes:
                    await lane.reset()

    trio.run(main)
    assert peak[0] <= budget, peak[0] / MiB  # the old code queued ~1 MiB on each of the 16 lanes
    closed = sum(c for _, c in floods)
    assert closed >= 2 * PER_PEER - budget // MiB, floods  # at most 3 lanes of ~1 MiB each still fit the budget

