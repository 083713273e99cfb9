"""Floods of buffered bytes against a stage over loopback (issue 15, item 5): partial records on lanes, replies that
are never read. The stage's own accounting must stay within its budgets, and the process's RSS must come back within
10% of what it was before the attack, within 60 s of its end. Bounded: 8 lanes x 24 MiB, 8 s of requests."""

from __future__ import annotations

import gc
import os

import trio

from sangama_p2p.net.lane import open_lane

from ..hostile import flood_unread, partial_record

ONE = [(0, 8)]
MiB = 1 << 20


def _rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def _back_to(baseline: int, within: float) -> int:
    """Wait (at most ``within`` s) for RSS to come within 10% of ``baseline``; return the last reading."""
    rss = _rss()
    with trio.move_on_after(within):
        while rss > 1.1 * baseline:
            await trio.sleep(0.5)
            rss = _rss()
    return rss


def test_partial_records_stay_within_the_input_budget_and_memory_returns(ckpt, fl):
    chunk = bytes(MiB)

    async def main():
        with trio.fail_after(90):
            async with fl.fleet(ckpt, ONE, clients=1, input_budget=64 * MiB) as f:
                server = f.stages[0][1]
                a = f.clients[0]
                await a.connect(server.node.peer_id, server.node.listen_addrs())
                lanes = [await open_lane(a, server.node.peer_id) for _ in range(8)]
                await trio.sleep(0.2)
                baseline = _rss()
                took = []
                async with trio.open_nursery() as nursery:
                    async def one(lane):
                        took.append(await partial_record(lane, 48 * MiB, 24 * MiB, chunk))

                    for lane in lanes:
                        nursery.start_soon(one, lane)
                budget = server.input_budget
                # bytes are held as they arrive (issue 23): two lanes' 24 MiB fit the 64 MiB budget, the others are
                # closed when a chunk of theirs does not fit (a lane closed after its sender was done reads 24 MiB)
                assert took.count(-1) >= 5 and took.count(24 * MiB) >= 2, took
                with trio.fail_after(10):  # the two that fit hold all their bytes once the stage has read them
                    while budget.used != 48 * MiB:
                        await trio.sleep(0.05)
                during = _rss()
                assert budget.peak <= budget.limit
                # the old code grew by 194 MiB here; inside a long pytest process the allocator keeps some freed
                # chunks, so the figure read 110 MiB in a whole-suite run and 131.6 MiB after tests/model, gguf and
                # client in one process (the lone test: under 64 MiB); 160 still fails the old code
                assert during - baseline < 160 * MiB, (during - baseline) / MiB
                for lane in lanes:
                    await lane.close()
                with trio.fail_after(5):
                    while budget.used:
                        await trio.sleep(0.05)
                after = await _back_to(baseline, 60)
                print(f"partial records: baseline {baseline / MiB:.0f} MiB, during +{(during - baseline) / MiB:.1f},"
                      f" after +{(after - baseline) / MiB:.1f}")
                assert after <= 1.1 * baseline

    trio.run(main)


def test_replies_that_are_never_read_stay_within_the_outbox_bound_and_memory_returns(ckpt, fl):
    async def main():
        with trio.fail_after(90):
            async with fl.fleet(ckpt, ONE, clients=1, outbox_bytes=1 * MiB) as f:
                server = f.stages[0][1]
                a = f.clients[0]
                await a.connect(server.node.peer_id, server.node.listen_addrs())
                lane = await open_lane(a, server.node.peer_id)
                await trio.sleep(0.2)
                baseline = _rss()
                sent, _ = await flood_unread(lane, 8)  # the attacker sends InfoRequests and reads nothing
                during = _rss()
                (outbox,) = server._inbound.values()
                print(f"replies: {sent} requests sent, outbox peak {outbox.peak_bytes} bytes, "
                      f"RSS +{(during - baseline) / MiB:.1f} MiB")
                assert outbox.congested and outbox.max_bytes < outbox.peak_bytes <= 2 * outbox.max_bytes
                assert during - baseline < 32 * MiB
                await lane.reset()
                with trio.fail_after(5):
                    while server._inbound:
                        await trio.sleep(0.05)
                after = await _back_to(baseline, 60)
                print(f"replies: after +{(after - baseline) / MiB:.1f} MiB")
                assert after <= 1.1 * baseline

    trio.run(main)


def test_an_outbox_bounds_its_queue_and_a_shared_link_refuses_only_the_item_over_it():
    from sangama_p2p.errors import OutboxFull
    from sangama_p2p.stage.links import Outbox
    from sangama_p2p.wire.messages import InfoRequest as Req

    async def main():
        async def never() -> object:
            await trio.sleep_forever()

        lost: list = []
        reply = Outbox(peer="p", opener=never, on_failed=lambda o, items, exc: lost.append((items, exc)),
                       max_bytes=4096)
        link = Outbox(peer="q", opener=never, max_bytes=4096, fail_when_full=False)
        for box in (reply, link):
            assert all(box.put(Req(), 1024) for _ in range(8))  # 8 KiB: up to twice the bound
            assert box.congested and box.queued_bytes == 8192
        assert not link.put(Req(), 1024) and link.failed is None and link.queued_bytes == 8192
        assert not reply.put(Req(), 1024) and isinstance(reply.failed, OutboxFull)
        assert reply.queued_bytes == 0 and len(lost[0][0]) == 9  # dropped at once, and reported
        await reply.wait_uncongested()  # a failed outbox never blocks its reader

    trio.run(main)
