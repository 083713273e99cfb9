"""Hostile input on a stage's lane port: idle connections that never say who they are must not take the stage
away from real clients (issue 15, item 2). Loopback only, bounded in connections and time."""

from __future__ import annotations

import trio

from sangama_p2p.client import ChainClient, ClientConfig

from ..hostile import hold_idle

SPLIT = [(0, 4), (4, 8)]
PROMPT = [1, 5, 9, 2, 7, 3]
IDLE = 256  # connections the attacker keeps open on each stage's lane port


def test_idle_connections_on_the_lane_port_do_not_take_the_stage_away(ckpt, fl):
    want = fl.local_chain(ckpt, SPLIT).generate(PROMPT, 6).tokens
    results: list[object] = []
    opened = [0]

    async def main():
        # a bound against a hang, not a timing: 36 s with two busy loops beside the suite, 123 s once with four
        with trio.fail_after(360):
            async with fl.fleet(ckpt, SPLIT) as f, trio.open_nursery() as attack:
                for _, server, _ in f.stages:
                    attack.start_soon(hold_idle, server.lane_listener.bound_port, IDLE, opened)
                while opened[0] < IDLE * len(SPLIT):
                    await trio.sleep(0.05)
                for _ in range(10):  # a fresh client each time: each one sets its links (and lanes) up again
                    try:
                        async with ChainClient(f.clients[0], ClientConfig(fl.MODEL)) as client:
                            results.append((await client.generate(PROMPT, 6)).tokens)
                    except Exception as exc:  # noqa: BLE001 - counted and reported below
                        results.append(f"{type(exc).__name__}: {exc}")
                attack.cancel_scope.cancel()

    trio.run(main)
    assert results == [want] * 10, results
