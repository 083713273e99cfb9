"""What verification costs, and how soon it catches a liar (issue 15, item 7).

    python benchmarks/verify.py [--tokens 64] [--repeats 5] [--fraction 0.05] [--liar-runs 20]

One process, one trio loop, loopback: a bootstrap node and stage peers holding the tiny Llama (hidden 256, 6 layers,
vocab 1000, fp32; the Petals anchor shape) split 0:3 + 3:6, two peers per range (so a second chain exists).

1. Cost: greedy generations of ``--tokens`` tokens, alternating ``verify=0`` and ``verify=FRACTION`` (and 1.0 for
   scale), ``--repeats`` each; decode tokens/s (median) and the trips re-run.
2. Detection: a third peer joins 3:6 that answers a constant token and announces a high throughput (routing picks
   it); ``--liar-runs`` generations of up to 400 tokens with ``verify=FRACTION``, each on a fresh client (no ban
   carried over). The detection delay is the trip at which the liar was convicted (1 = the prefill); also the time
   the conviction took (the re-runs on mixed chains) and whether the tokens then equal an honest run's.

Every torch call runs on one thread. Prints a table and writes benchmarks/results/verify.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from pathlib import Path

import torch
import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.stage import StageConfig, StageServer

RESULTS = Path(__file__).parent / "results"
MODEL = "bench/tiny-llama"
SPLIT = [(0, 3), (3, 6)]
PROMPT = [5, 17, 101, 3, 999, 42, 7, 256]


def host(keys: Path, boot: str | None = None) -> HostConfig:
    return HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(boot,) if boot else (),
                      handshake_timeout=3.0, key_path=keys / f"{os.urandom(6).hex()}.key")


async def add_stage(nursery, stack, keys, boot, ckpt, start, end) -> StageServer:
    node = await stack.enter_async_context(open_host(host(keys, boot), key_pair=generate_key_pair()))
    server = await trio.to_thread.run_sync(StageServer.load, node, ckpt,
                                           StageConfig(model_id=MODEL, start=start, end=end, batch_invariant=True))
    await stack.enter_async_context(server)
    return server


def make_liar(server: StageServer, token: int) -> list[int]:
    """A real last stage that answers ``token`` as every trip's new token and announces a high throughput; returns
    the list its lies are counted in."""

    class Boastful(type(server)):
        @property
        def throughput(self) -> float:
            return 1e6

    server.__class__ = Boastful
    real, lies = server.scheduler.deliver, []

    def deliver(job, out):
        if out.error is None and out.last is not None:
            lies.append(job.msg.step)
            out = dataclasses.replace(out, last=dataclasses.replace(out.last, tokens=(*out.last.tokens[:-1], token)))
        real(job, out)

    server.scheduler.deliver = deliver
    return lies


async def generate(client_node, fraction: float, tokens: int):
    """One generation on a fresh client (as one ``sangama-peer generate`` would run): result, the client's
    verification figures, wall seconds, and process CPU seconds (every stage runs in this process: the CPU time is
    the work of the whole fleet, less moved by other load on the machine than the wall time)."""
    async with ChainClient(client_node, ClientConfig(MODEL, verify=fraction)) as client:
        t, c = time.perf_counter(), time.process_time()
        res = await client.generate(PROMPT, tokens)
        return res, client.verification, time.perf_counter() - t, time.process_time() - c


async def main(args) -> dict:
    work = Path(tempfile.mkdtemp(prefix="sangama-verify-"))
    ckpt = open_checkpoint(make_model(work / "m", "llama", "tiny", seed=0))
    keys = work / "keys"
    out: dict = {"tokens": args.tokens, "fraction": args.fraction, "split": SPLIT}
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_host(host(keys), key_pair=generate_key_pair()))
        addr = str(boot.advertised_addrs()[0])
        nursery = await stack.enter_async_context(trio.open_nursery())
        for a, b in [*SPLIT, *SPLIT]:
            await add_stage(nursery, stack, keys, addr, ckpt, a, b)
        client_node = await stack.enter_async_context(open_host(host(keys, addr), key_pair=generate_key_pair()))
        honest, _, _, _ = await generate(client_node, 0.0, args.tokens)  # warm-up, and the honest tokens
        rows: dict[float, list] = {0.0: [], args.fraction: [], 1.0: []}
        for _ in range(args.repeats):
            for f in rows:
                res, ver, wall, cpu = await generate(client_node, f, args.tokens)
                assert res.tokens == honest.tokens, (f, res.tokens, honest.tokens)
                rows[f].append((res.decode_tokens_per_s, ver.trips, ver.verified, cpu / len(res.tokens) * 1e3,
                                ver.seconds / max(res.prefill_s + res.decode_s, 1e-9),
                                ver.open_seconds / max(res.prefill_s + res.decode_s, 1e-9)))
        base = statistics.median(r[0] for r in rows[0.0])
        out["cost"] = [{"verify": f, "decode_tokens_per_s": round(statistics.median(r[0] for r in v), 1),
                        "vs_off": round(statistics.median(r[0] for r in v) / base, 3),
                        "trips": v[0][1], "trips_verified_mean": round(statistics.mean(r[2] for r in v), 1),
                        "cpu_ms_per_token": round(statistics.median(r[3] for r in v), 3),
                        "share_verifying": round(statistics.median(r[4] for r in v), 3),
                        "share_opening_second_chain": round(statistics.median(r[5] for r in v), 3),
                        "all_runs_tokens_per_s": [round(r[0], 1) for r in v]} for f, v in rows.items()]

        base_cpu = statistics.median(r[3] for r in rows[0.0])
        for row, (f, v) in zip(out["cost"], rows.items()):
            row["cpu_vs_off"] = round(row["cpu_ms_per_token"] / base_cpu, 3)
            # each run against the verify=0 run just before it: steadier than the ratio of medians under load
            row["vs_off_paired"] = round(statistics.median(a[0] / b[0] for a, b in zip(v, rows[0.0])), 3)
        long_honest, _, _, _ = await generate(client_node, 0.0, args.liar_tokens)
        bad = next(t for t in range(1000) if t not in long_honest.tokens[:50])
        liar = await add_stage(nursery, stack, keys, addr, ckpt, 3, 6)
        lies = make_liar(liar, bad)
        runs = []
        for _ in range(args.liar_runs):
            told = len(lies)
            res, ver, wall, _ = await generate(client_node, args.fraction, args.liar_tokens)
            ev = [e for e in ver.events if e.verdict.liar is not None]
            runs.append({"detected_at_trip": ev[0].trip if ev else None,
                         "banned_liar": bool(ev) and ev[0].verdict.liar == liar.peer_id,
                         "chains_run": ev[0].verdict.chains_run if ev else 0,
                         "judging_s": round(ev[0].seconds, 3) if ev else None,
                         "tokens_equal_honest": res.tokens == long_honest.tokens, "wall_s": round(wall, 3),
                         "liar_in_final_route": liar.peer_id in res.route,
                         "events": [(e.trip, e.verdict.liar == liar.peer_id, e.verdict.reason[:120]) for e in ver.events],
                         "trips": ver.trips, "verified": ver.verified, "unverifiable": ver.unverifiable,
                         "lies": len(lies) - told})
        nursery.cancel_scope.cancel()
    delays = [r["detected_at_trip"] for r in runs if r["detected_at_trip"] is not None]
    out["detection"] = {"runs": runs, "liar_tokens": args.liar_tokens, "detected": len(delays),
                        "liar_chained": sum(1 for r in runs if r["lies"]),
                        "median_trip": statistics.median(delays) if delays else None,
                        "mean_trip": round(statistics.mean(delays), 1) if delays else None,
                        "max_trip": max(delays) if delays else None,
                        "judging_s_median": statistics.median(r["judging_s"] for r in runs if r["judging_s"])
                        if delays else None,
                        "expected_mean_trip": round(1 / args.fraction, 1),
                        "wrong_bans": sum(1 for r in runs if r["detected_at_trip"] and not r["banned_liar"]),
                        "tokens_equal_honest": sum(r["tokens_equal_honest"] for r in runs)}
    return out


def show(out: dict) -> None:
    print(f"\nverification cost, tiny Llama 0:3 + 3:6 on loopback, {out['tokens']} tokens, greedy")
    print(f"{'verify':>8} {'tok/s':>8} {'vs off':>7} {'paired':>7} {'cpu ms/tok':>11} {'vs off':>7} {'trips':>6} "
          f"{'re-run':>7} {'time verifying':>15}")
    for r in out["cost"]:
        print(f"{r['verify']:>8} {r['decode_tokens_per_s']:>8} {r['vs_off']:>7} {r['vs_off_paired']:>7} "
              f"{r['cpu_ms_per_token']:>11} {r['cpu_vs_off']:>7} {r['trips']:>6} {r['trips_verified_mean']:>7} "
              f"{r['share_verifying']:>15} (opening {r['share_opening_second_chain']})")
    d = out["detection"]
    print(f"\nlying last stage, verify {out['fraction']}: chained in {d['liar_chained']} of {len(d['runs'])} runs, "
          f"detected in {d['detected']} "
          f"(up to {d['liar_tokens']} trips); trip of detection median {d['median_trip']}, mean {d['mean_trip']} "
          f"(1/fraction = {d['expected_mean_trip']}), max {d['max_trip']}; judging took {d['judging_s_median']} s "
          f"(median); wrong bans {d['wrong_bans']}; "
          f"tokens equal to an honest run in {d['tokens_equal_honest']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fraction", type=float, default=0.05)
    p.add_argument("--liar-runs", type=int, default=20)
    p.add_argument("--liar-tokens", type=int, default=400)
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    out = trio.run(main, args)
    out.update(seconds=round(time.perf_counter() - t0, 1), load_average=os.getloadavg(),
               machine=platform.machine(), cpus=os.cpu_count())
    show(out)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "verify.json").write_text(json.dumps(out, indent=1))
    print(f"wrote {RESULTS / 'verify.json'}")
