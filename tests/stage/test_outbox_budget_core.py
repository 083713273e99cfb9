"""The stage-wide outbox budget's bookkeeping (issue 23, item 4): pure eviction by size, then real outboxes
sharing one budget (no network), and the config's check."""

from __future__ import annotations

import pytest
import trio
import trio.testing

from sangama_p2p.errors import ErrorCode, OutboxFull, StageError
from sangama_p2p.net.streams import FramedStream, memory_stream_pair
from sangama_p2p.stage import StageConfig
from sangama_p2p.stage.links import NextHops, Outbox, OutboxBudget
from sangama_p2p.wire.messages import CloseSession, InfoRequest


class _Id:
    def __init__(self, name: str) -> None:
        self.name = name

    def to_base58(self) -> str:
        return self.name


class _Box:
    """What the budget needs of an outbox: a peer to name and ``evict``."""

    def __init__(self, peer: str) -> None:
        self.peer, self.failed = peer, None

    def evict(self, exc: BaseException) -> None:
        self.failed = exc


def test_the_budget_evicts_the_largest_holders_until_an_item_fits():
    b = OutboxBudget(10)
    x, y, z, w = (_Box(p) for p in "xyzw")
    assert b.admit(x, 4) and b.admit(y, 3) and b.admit(z, 2) and b.used == 9
    assert b.admit(w, 9)  # 18 > 10: x (4), then y (3), then z (2) are failed, largest first
    assert all(isinstance(o.failed, OutboxFull) for o in (x, y, z)) and w.failed is None
    assert (b.used, b.held(w), b.held(x), b.evicted) == (9, 9, 0, 3)
    v = _Box("v")
    assert b.admit(v, 1) and w.failed is None and b.used == 10  # exactly the limit fits
    assert b.admit(v, 1)  # 11: w holds the most, not v
    assert isinstance(w.failed, OutboxFull) and v.failed is None and (b.used, b.held(v), b.peak) == (2, 2, 10)


def test_an_outbox_that_holds_the_most_fails_itself_and_written_bytes_return():
    b = OutboxBudget(10)
    small, big = _Box("small"), _Box("big")
    assert b.admit(small, 2) and b.admit(big, 7)
    assert not b.admit(big, 2)  # 11 > 10 and big holds the most: big fails, its item is not charged
    assert isinstance(big.failed, OutboxFull) and small.failed is None and (b.used, b.held(big)) == (2, 0)
    b.release(small, 1)
    assert (b.used, b.held(small)) == (1, 1)
    b.release(small, 5)  # never more than it holds
    assert (b.used, b.held(small)) == (0, 0)
    lone = _Box("lone")
    assert b.admit(lone, 25) and b.used == 25 == b.peak  # alone over the limit: it goes (config keeps limit >= a frame)
    assert b.drop(lone) == 25 and b.used == 0
    with pytest.raises(ValueError):
        OutboxBudget(0)


def test_outboxes_charge_one_budget_a_drained_one_returns_its_bytes_and_the_idle_one_is_failed():
    """Real outboxes: one whose peer reads (its bytes come back as they are written), one that never drains, and a
    shared next-hop link (``fail_when_full=False``) that fails once it holds the most."""
    k = 1024
    budget = OutboxBudget(8 * k)
    lost: dict[str, list] = {}

    def on_failed(box, items, exc):
        lost.setdefault(box.peer, []).extend(items)

    async def never() -> FramedStream:
        await trio.sleep_forever()

    async def main():
        with trio.fail_after(10):
            mine, theirs = memory_stream_pair(_Id("stage"), _Id("reader"))
            read = FramedStream(theirs)
            reader = Outbox(FramedStream(mine), budget=budget, max_bytes=64 * k)
            idle = Outbox(peer="idle", opener=never, on_failed=on_failed, budget=budget, max_bytes=64 * k)
            link = Outbox(peer="link", opener=never, on_failed=on_failed, budget=budget, max_bytes=64 * k,
                          fail_when_full=False)
            async with trio.open_nursery() as nursery:
                for box in (reader, idle, link):
                    nursery.start_soon(box.run)
                assert all(idle.put(InfoRequest(), k) for _ in range(6)) and budget.used == 6 * k
                for _ in range(50):  # 50 KiB through the reader's outbox: each frame's bytes return once written
                    assert reader.put(InfoRequest(), k)
                    assert await read.recv() == InfoRequest()
                await trio.testing.wait_all_tasks_blocked()
                assert reader.queued_bytes == 0 and budget.held(reader) == 0 and budget.used == 6 * k
                assert link.put(InfoRequest(), k) and link.put(InfoRequest(), k)
                assert link.put(InfoRequest(), k)  # 9 KiB: the idle outbox holds the most, it is failed
                assert isinstance(idle.failed, OutboxFull) and len(lost["idle"]) == 6 and idle.queued_bytes == 0
                assert budget.used == 3 * k and reader.failed is None and link.failed is None
                assert all(link.put(InfoRequest(), k) for _ in range(5)) and budget.used == 8 * k
                assert not link.put(InfoRequest(), k)  # now the link holds the most: it fails, its frames reported
                assert isinstance(link.failed, OutboxFull) and len(lost["link"]) == 8 and budget.used == 0
                assert reader.put(InfoRequest(), k) and await read.recv() == InfoRequest()  # the reader goes on
                nursery.cancel_scope.cancel()

    trio.run(main)


def test_the_outbox_budget_is_validated():
    base = dict(model_id="m", start=0, end=1)
    assert StageConfig(**base).outbox_budget == 256 << 20
    assert StageConfig(**base, outbox_budget=1 << 20, max_frame=1 << 20).outbox_budget == 1 << 20
    for bad in (0, -1):
        with pytest.raises(StageError, match="outbox_budget"):
            StageConfig(**base, outbox_budget=bad)
    with pytest.raises(StageError, match="at least max_frame"):
        StageConfig(**base, outbox_budget=(64 << 20) - 1)


def test_a_next_hop_link_failed_for_the_budget_reports_overloaded_to_its_sessions_and_is_replaced():
    k = 1024
    budget = OutboxBudget(4 * k)
    reports: list = []

    async def never(peer: str) -> FramedStream:
        await trio.sleep_forever()

    async def main():
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                hops = NextHops(never, spawn=nursery.start_soon, report=reports.append, max_bytes=64 * k,
                                budget=budget)
                link = hops.get("next")
                sids = [bytes([i]) * 16 for i in range(4)]
                assert all(link.put(CloseSession(sid), k) for sid in sids) and budget.used == 4 * k
                reply = Outbox(peer="client", opener=never, budget=budget)
                nursery.start_soon(reply.run)
                assert reply.put(InfoRequest(), k)  # 5 KiB: the link holds the most
                assert isinstance(link.failed, OutboxFull) and budget.used == k
                assert [(r.session_id, r.code) for r in reports] == [(sid, ErrorCode.OVERLOADED) for sid in sids]
                fresh = hops.get("next")
                assert fresh is not link and fresh.failed is None and fresh.put(CloseSession(sids[0]), k)
                nursery.cancel_scope.cancel()

    trio.run(main)
