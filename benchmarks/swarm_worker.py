"""One process of benchmarks/swarm_scale.py: DHT bootstrap servers, serving peers, or clients that generate in a
loop. Every peer is a real py-libp2p host on loopback with the real stage server (or the real client); many run in
one trio loop. Events go to ``--out`` as JSON lines (appended, flushed per line):

* ``up``: a peer serves (peer id, range, time);
* ``stats`` (every 20 s): per peer, the inbound KAD streams (each carries one DHT request) and ``/sangama/``
  record, info and stage streams it served, and the process's RSS;
* ``gen``: one generation of a fresh client (a new host and ``ChainClient`` each): start, first token, end, tokens
  equal to the local run's, error, and each survey's dial count and each route chosen, with their times.

    python benchmarks/swarm_worker.py boot --count 3 --out F
    python benchmarks/swarm_worker.py peers --boot ADDR... --model DIR --ranges 0:3,3:5,5:8 --count 10 --first 0 --out F
    python benchmarks/swarm_worker.py clients --boot ADDR... --model DIR --count 2 --want WANT.json --out F
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import trio

STATS_EVERY_S = 20.0
JOIN_TRIES = 5
JOIN_RETRY_S = 5.0


class Events:
    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)

    def write(self, **event: Any) -> None:
        event.setdefault("t", time.time())
        event["pid"] = os.getpid()
        self.file.write(json.dumps(event) + "\n")


def rss() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def count_streams() -> dict[str, dict[str, int]]:
    """Count, per local peer, the streams it serves: KAD requests and the protocols of ours (patched in place)."""
    from libp2p.kad_dht.kad_dht import KadDHT

    counts: dict[str, dict[str, int]] = {}
    real = KadDHT.handle_stream

    async def handle_stream(self: Any, stream: Any) -> None:
        bucket = counts.setdefault(self.local_peer_id.to_base58(), {})
        bucket["kad"] = bucket.get("kad", 0) + 1
        await real(self, stream)

    KadDHT.handle_stream = handle_stream  # type: ignore[method-assign]

    from sangama_p2p.net import dial, discovery

    def counted(module: Any, name: str) -> None:
        real_fn = getattr(module, name)

        async def wrapper(node: Any, *args: Any, **kwargs: Any) -> Any:
            bucket = counts.setdefault(node.peer_id.to_base58(), {})
            bucket[name] = bucket.get(name, 0) + 1
            return await real_fn(node, *args, **kwargs)

        setattr(module, name, wrapper)

    counted(dial, "record_addrs")  # a dial that looked the peer's record up
    outbound(counts)
    counted(discovery, "_enumerate")  # a survey that enumerated every provider
    return counts


def outbound(counts: dict[str, dict[str, int]]) -> None:
    """Count the KAD requests each local peer sends, by kind (under ``"out"``)."""
    from libp2p.kad_dht.peer_routing import PeerRouting
    from libp2p.kad_dht.provider_store import ProviderStore
    from libp2p.kad_dht.value_store import ValueStore

    from sangama_p2p.net import kad_rpc

    totals = counts.setdefault("out", {})

    def bump(kind: str) -> None:
        totals[kind] = totals.get(kind, 0) + 1

    real_request = kad_rpc.kad_request

    async def kad_request(host: Any, peer: Any, kind: int, key: bytes) -> Any:
        bump({0: "put", 1: "get_value", 2: "add_provider", 3: "get_providers", 4: "find_node"}.get(kind, str(kind)))
        return await real_request(host, peer, kind, key)

    kad_rpc.kad_request = kad_request
    from sangama_p2p.net import directory

    directory.kad_request = kad_request
    for cls, name, kind in ((ValueStore, "_store_at_peer", "store"), (ValueStore, "_get_from_peer", "get_from_peer"),
                            (ProviderStore, "_send_add_provider", "add_provider_lib"),
                            (PeerRouting, "_query_peer_for_closest", "find_node_lib")):
        real = getattr(cls, name)

        def make(real: Any = real, kind: str = kind) -> Any:
            async def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
                bump(kind)
                return await real(self, *args, **kwargs)
            return wrapper

        setattr(cls, name, make())


def host_config(boot: list[str], *, server: bool = True) -> Any:
    from sangama_p2p.net.config import HostConfig

    return HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=tuple(boot), dht_server=server,
                      handshake_timeout=10.0, key_path=None)


async def run_boot(args: argparse.Namespace, events: Events) -> None:
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair

    counts = count_streams()
    async with AsyncExitStack() as stack:
        addrs: list[str] = []
        for _ in range(args.count):
            node = await stack.enter_async_context(open_host(host_config(addrs[:1]), key_pair=generate_key_pair()))
            addrs.append(str(node.advertised_addrs()[0]))
        events.write(event="boot", addrs=addrs)
        while True:
            await trio.sleep(STATS_EVERY_S)
            events.write(event="stats", role="boot", streams=counts, rss=rss())


async def run_peers(args: argparse.Namespace, events: Events) -> None:
    from sangama_p2p.errors import NetworkError
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair
    from sangama_p2p.stage import StageConfig, StageServer

    counts = count_streams()
    ranges = [tuple(map(int, r.split(":"))) for r in args.ranges.split(",")]
    ckpt = open_checkpoint(args.model)
    async with trio.open_nursery() as nursery:

        async def serve(index: int, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            start, end = ranges[index % len(ranges)]
            for attempt in range(JOIN_TRIES):  # as a supervisor restarts a peer that could not join
                try:
                    async with open_host(host_config(args.boot), key_pair=generate_key_pair()) as node:
                        cfg = StageConfig(model_id=args.model_id, start=start, end=end, batch_invariant=True,
                                          max_sessions=args.max_sessions)
                        server = await trio.to_thread.run_sync(StageServer.load, node, ckpt, cfg)
                        async with server:
                            events.write(event="up", peer=node.peer_id.to_base58(), start=start, end=end)
                            task_status.started()
                            await trio.sleep_forever()
                except NetworkError as exc:  # the join failed (a bootstrap too busy to finish a handshake)
                    events.write(event="join_failed", attempt=attempt, error=str(exc)[:300])
                    await trio.sleep(JOIN_RETRY_S)
            raise SystemExit(f"peer {index} could not join in {JOIN_TRIES} tries")

        for i in range(args.count):
            await nursery.start(serve, args.first + i)
        events.write(event="ready", count=args.count)
        while True:
            await trio.sleep(STATS_EVERY_S)
            events.write(event="stats", role="peers", streams=counts, rss=rss(), peers=args.count)


async def run_clients(args: argparse.Namespace, events: Events) -> None:
    from sangama_p2p.client import ChainClient, ClientConfig
    from sangama_p2p.client import generate as gen_mod
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair

    want = json.loads(Path(args.want).read_text())
    prompts, wanted = want["prompts"], want["tokens"]
    real_survey, real_route = gen_mod.ChainClient._survey, gen_mod.ChainClient._route
    log: dict[int, dict[str, list[Any]]] = {}  # id(client) -> its surveys and routes

    async def survey(self: Any, exclude: Any, retry_slow: bool) -> Any:
        out = await real_survey(self, exclude, retry_slow)
        facts = self.survey_facts
        log.setdefault(id(self), {"surveys": [], "routes": []})["surveys"].append(
            {"t": time.time(), "dials": len(facts.contacted), "directories": facts.directories,
             "records": facts.records, "candidates": facts.candidates, "offers": len(out)})
        return out

    def route(self: Any, offers: Any, exclude: Any, pin: Any) -> Any:
        chain, fp = real_route(self, offers, exclude, pin)
        log.setdefault(id(self), {"surveys": [], "routes": []})["routes"].append(
            {"t": time.time(), "peers": [o.peer_id for o in chain]})
        return chain, fp

    gen_mod.ChainClient._survey, gen_mod.ChainClient._route = survey, route  # type: ignore[method-assign]

    async def loop(worker: int) -> None:
        n = 0
        while True:
            i = (worker + n) % len(prompts)
            n += 1
            t0 = time.time()
            first = None
            tokens: list[int] = []
            error = ""
            mine: dict[str, list[Any]] = {"surveys": [], "routes": []}
            try:
                with trio.fail_after(args.timeout):
                    async with open_host(host_config(args.boot, server=False), key_pair=generate_key_pair()) as node:
                        config = ClientConfig(args.model_id, num_layers=args.num_layers, walk=True)
                        async with ChainClient(node, config) as client:
                            try:
                                async for tok in client.stream(prompts[i], args.tokens):
                                    if first is None:
                                        first = time.time()
                                    tokens.append(tok)
                            finally:
                                mine = log.pop(id(client), mine)
            except Exception as exc:  # every failure is counted, with its words
                error = f"{type(exc).__name__}: {exc}"[:300]
            events.write(event="gen", worker=worker, start=t0, first=first, end=time.time(), prompt=i,
                         equal=tokens == wanted[i], ntokens=len(tokens), error=error, **mine)
            await trio.sleep(args.pause)

    async with trio.open_nursery() as nursery:
        for w in range(args.count):
            nursery.start_soon(loop, args.first + w)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["boot", "peers", "clients"])
    ap.add_argument("--boot", nargs="*", default=[])
    ap.add_argument("--model", default="")
    ap.add_argument("--model-id", default="swarm/tiny")
    ap.add_argument("--ranges", default="0:3,3:5,5:8")
    ap.add_argument("--count", type=int, default=1)
    ap.add_argument("--first", type=int, default=0)
    ap.add_argument("--max-sessions", type=int, default=64)
    ap.add_argument("--want", default="")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--num-layers", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--pause", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import logging

    import torch

    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    events = Events(Path(args.out))
    run = {"boot": run_boot, "peers": run_peers, "clients": run_clients}[args.role]
    trio.run(run, args, events)
    return 0


if __name__ == "__main__":
    sys.exit(main())
