"""Kill -9 a running stage mid-generation, over real ``sangama-peer join`` processes: the harness shared by
``test_failover_exact.py`` (a few kills) and ``benchmarks/failover_exact.py`` (ten, with the replay's cost).

A fleet of ``ranges`` plus one spare of the middle range; a client in this process (``ChainClient``, what
``generate`` and the API drive) generates once uninterrupted, then once per kill: at the kill's token the middle
stage of the running chain gets SIGKILL, the generation fails over to the spare, and a fresh ``join`` of the killed
range becomes the next spare.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from sangama_p2p.cli.local_fleet import READY_PREFIX, LocalFleet
from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair


@dataclass
class KillRun:
    kill_at: int | None  # the token after which the middle stage was killed (None: uninterrupted)
    tokens: list[int]
    failovers: int
    replayed_trips: int
    replay_exact: bool
    gap_s: float  # the longest wait between two tokens (the failover's: probe, re-route, replay)
    total_s: float


def start_fleet(model: Path, ranges: list[str], spare: str, workdir: Path, threads: int = 1) -> LocalFleet:
    fleet = LocalFleet(model, [*ranges, spare], workdir, join_args=["--threads", str(threads)],
                       start_timeout=240.0)
    fleet.start()
    return fleet


def _respawn(fleet: LocalFleet, layers: str, n: int, threads: int) -> Any:
    """A fresh ``join`` of ``layers`` (the next spare). Called on the thread that runs trio, not a worker thread: the
    children ask for SIGTERM when the thread that started them ends (``PR_SET_PDEATHSIG``), and trio's worker
    threads end when idle."""
    return fleet._spawn(f"spare{n}", [  # noqa: SLF001 - the fleet's own spawner: same logs, same cleanup
        "join", "--model", str(fleet.model_dir), "--layers", layers, "--bootstrap", fleet.bootstrap_addr,
        "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(fleet.workdir / f"spare{n}.key"), "--threads", str(threads),
    ])


def run_kills(fleet: LocalFleet, model_id: str, prompt: list[int], n_tokens: int, kill_at: list[int],
              threads: int = 1, client_changes: dict[str, Any] | None = None) -> list[KillRun]:
    """One uninterrupted generation, then one per entry of ``kill_at``; greedy, no guesses."""
    by_id = dict(zip(fleet.stage_ids, fleet.children[1:]))
    layers_of = dict(zip(fleet.stage_ids, fleet.layers))

    async def main() -> list[KillRun]:
        runs: list[KillRun] = []
        host = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(fleet.bootstrap_addr,),
                          handshake_timeout=3.0)
        async with open_host(host, key_pair=generate_key_pair()) as node:
            # generous probe and stall bounds: on a busy 2-core machine a fresh spare answers slowly, and a probe or
            # stall misfire would exclude the live spare (what is measured here is the replay, not those bounds)
            changes = {"step_timeout": 30.0, "probe_timeout": 15.0, "stall_floor_s": 10.0, **(client_changes or {})}
            config = ClientConfig(model_id, **changes)
            async with ChainClient(node, config) as client:
                for n, at in enumerate([None, *kill_at]):
                    seen: list[int] = []
                    stamps: list[float] = []

                    def on_tokens(new: list[int], at: int | None = at) -> None:
                        seen.extend(new)
                        stamps.append(time.perf_counter())
                        if at is not None and len(seen) >= at and not killed:
                            victim = client.routes[0][1]  # the middle stage of the running chain
                            os.kill(by_id[victim].proc.pid, signal.SIGKILL)
                            killed.append(victim)

                    killed: list[str] = []
                    t0 = time.perf_counter()
                    try:
                        res = await client.generate(prompt, n_tokens, on_tokens=on_tokens)
                    except Exception as exc:
                        raise RuntimeError(f"run {n} (kill after {at}) failed; the client saw "
                                           f"{[(o.peer_id[-6:], o.start, o.end) for o in client.offers]}, silent "
                                           f"{[p[-6:] for p in client.probes.silent]}, fleet "
                                           f"{[(p[-6:], layers_of[p]) for p in layers_of]}") from exc
                    total = time.perf_counter() - t0
                    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
                    runs.append(KillRun(at, list(res.tokens), res.failovers, res.replayed_trips,
                                        res.replay_diverged is None, max(gaps, default=0.0), total))
                    if killed:  # the next spare, so that every kill has one
                        layers = layers_of[killed[0]]
                        child = _respawn(fleet, layers, n, threads)
                        ready = await trio.to_thread.run_sync(child.wait_for, READY_PREFIX, 240.0)
                        peer = ready.split()[1]
                        by_id[peer] = fleet.children[-1]
                        layers_of[peer] = layers
                        with trio.fail_after(120):  # until the client's survey sees it (a busy machine is slow)
                            while peer not in {o.peer_id for o in await client.survey()}:
                                await trio.sleep(1.0)
        return runs

    return trio.run(main)
