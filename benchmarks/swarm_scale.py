"""A public swarm of many real peers on this machine, with churn (issue 25, item 3). A benchmark script, not a test
(tests/net/test_swarm_scale.py runs it small).

What it does:

1. makes the tiny Qwen3.5-MoE model (vocabulary cut to 16) and the local run's greedy tokens of 4 prompts
   (``LocalChain``, batch-invariant);
2. starts ``--boots`` DHT bootstrap servers (one process, at ``--boot-nice`` -5: a bootstrap runs on a machine of its
   own, and at 300 peers one process among 33 on two cores got too little CPU to finish handshakes), then
   ``--peers`` serving peers, ``--per-process`` to a process (benchmarks/swarm_worker.py: real py-libp2p hosts on
   loopback, each with the real stage server of one of ``--ranges``, batch-invariant, every one a DHT server as a
   public peer is; a peer that cannot join is started again, up to 5 times, each failure counted);
3. starts ``--clients`` client loops (``--client-processes`` processes): each generation is a fresh client (a new host
   and ``ChainClient``), timed from the host's start to its first token, its tokens compared with the local run's;
4. churns: every ``60 / (churn x processes)`` s one peer process is killed with SIGKILL and a fresh one (new keys,
   the same ranges) started, so ``--churn`` of the peers leave and join each minute, for ``--minutes``;
5. prints a table and writes ``--json``: ``completed_fraction`` (generations with tokens equal to the local run's
   over those started), ``ttft_p50_s`` / ``ttft_p99_s``, ``max_dials_per_survey`` (distinct peers a survey asked:
   DHT servers and probes), ``ghost_chosen_s`` (the longest a killed peer was still chosen in a route after it
   died), DHT and record streams served per peer per minute, and RSS per peer.

    python benchmarks/swarm_scale.py --peers 300 --churn 0.1 --minutes 30 --json benchmarks/results/swarm_300.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PROMPTS = [[1, 5, 9, 2, 7, 3], [2, 7, 1, 8, 2, 8], [3, 1, 4, 1, 5, 9, 2], [6, 2, 8, 3, 1]]
WORKER = [sys.executable, str(HERE / "swarm_worker.py")]


def make_model(workdir: Path) -> Path:
    from sangama_p2p.model.make import make_model as make, truncate_vocab

    return truncate_vocab(make(workdir / "made", "qwen3_5_moe", "tiny", seed=4), workdir / "swarm-tiny", 16)


def references(model: Path, ranges: list[tuple[int, int]], tokens: int) -> list[list[int]]:
    import torch

    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    torch.set_num_threads(1)
    chain = LocalChain.load(open_checkpoint(model), [LayerRange(a, b) for a, b in ranges], batch_invariant=True)
    return [chain.generate(p, tokens).tokens for p in PROMPTS]


def read_events(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut short by SIGKILL
                continue
    return out


def wait_for(path: Path, event: str, count: int, timeout: float) -> list[dict[str, Any]]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [e for e in read_events(path) if e.get("event") == event]
        if len(found) >= count:
            return found
        time.sleep(0.5)
    raise TimeoutError(f"{path.name}: {event} x{count} not seen within {timeout:.0f} s")


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class Swarm:
    def __init__(self, args: argparse.Namespace, work: Path, model: Path, boots: list[str]) -> None:
        self.args, self.work, self.model, self.boots = args, work, model, boots
        self.procs: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}  # index -> (process, its events)
        self.next = 0
        self.killed: dict[int, float] = {}  # index -> when
        self.first: dict[int, int] = {}  # index -> the index of its first peer (which decides the ranges)

    def start(self, index: int, first: int) -> None:
        out = self.work / f"peers-{index}.jsonl"
        cmd = [*WORKER, "peers", "--boot", *self.boots, "--model", str(self.model), "--ranges", self.args.ranges,
               "--count", str(self.args.per_process), "--first", str(first), "--out", str(out)]
        err = (self.work / f"peers-{index}.err").open("wb")
        self.procs[index] = (subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err), out)
        self.first[index] = first

    def kill(self, index: int) -> None:
        proc, _ = self.procs[index]
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        self.killed[index] = time.time()

    def departed(self) -> dict[str, float]:
        """Peer id -> when it was killed."""
        out = {}
        for index, when in self.killed.items():
            for e in read_events(self.procs[index][1]):
                if e.get("event") == "up":
                    out[e["peer"]] = when
        return out

    def stop(self) -> None:
        for proc, _ in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
                proc.wait()


def summarize(args: argparse.Namespace, swarm: Swarm, client_files: list[Path], boot_file: Path, t_start: float,
              t_end: float) -> dict[str, Any]:
    gens = [e for f in client_files for e in read_events(f) if e.get("event") == "gen" and e["start"] >= t_start]
    gens = [g for g in gens if g["start"] < t_end]
    done = [g for g in gens if g["equal"] and not g["error"]]
    wrong = [g for g in gens if not g["error"] and not g["equal"]]
    ttft = [g["first"] - g["start"] for g in gens if g["first"] is not None]
    dials = [s["dials"] for g in gens for s in g.get("surveys", [])]
    lookups = [s["directories"] for g in gens for s in g.get("surveys", [])]
    departed = swarm.departed()
    ghost = 0.0
    ghosts = 0
    for g in gens:
        for r in g.get("routes", []):
            for p in r["peers"]:
                if p in departed and departed[p] < r["t"]:
                    ghost = max(ghost, r["t"] - departed[p])
                    ghosts += 1
    # streams served per peer per minute, from each process's last stats line (counts since it started)
    kad, rss_per_peer = [], []
    record_lookups = enumerations = 0  # by the peers: dials that looked a record up, surveys that enumerated
    for index, (_, path) in swarm.procs.items():
        events = read_events(path)
        stats = [e for e in events if e.get("event") == "stats"]
        ups = [e for e in events if e.get("event") == "up"]
        if not stats or not ups:
            continue
        last = stats[-1]
        minutes = (last["t"] - min(u["t"] for u in ups)) / 60
        if minutes <= 0.2:
            continue
        for counts in last["streams"].values():
            kad.append(counts.get("kad", 0) / minutes)
            record_lookups += counts.get("record_addrs", 0)
            enumerations += counts.get("_enumerate", 0)
        rss_per_peer.append(last["rss"] / max(1, last["peers"]))
    join_failures = sum(1 for _, path in swarm.procs.values() for e in read_events(path)
                        if e.get("event") == "join_failed")
    errors: dict[str, int] = {}
    for g in gens:
        if g["error"]:
            key = g["error"].split(":")[0] + ": " + g["error"].split(":", 1)[-1][:90]
            errors[key] = errors.get(key, 0) + 1
    return {
        "peers": args.peers, "per_process": args.per_process, "boots": args.boots, "boot_nice": args.boot_nice,
        "ranges": args.ranges,
        "churn_per_min": args.churn, "minutes": args.minutes, "clients": args.clients,
        "started": len(gens), "completed": len(done), "wrong_tokens": len(wrong),
        "completed_fraction": len(done) / len(gens) if gens else 0.0,
        "ttft_p50_s": percentile(ttft, 0.5), "ttft_p99_s": percentile(ttft, 0.99),
        "max_dials_per_survey": max(dials, default=None), "mean_dials_per_survey": statistics.fmean(dials) if dials
        else None, "directory_lookups_per_survey": statistics.fmean(lookups) if lookups else None,
        "surveys": len(dials), "killed_processes": len(swarm.killed), "departed_peers": len(departed),
        "ghost_chosen_s": ghost, "ghost_routes": ghosts,
        "kad_streams_per_peer_per_min_p50": percentile(kad, 0.5), "kad_streams_per_peer_per_min_max": max(kad,
                                                                                                            default=None),
        "join_failures": join_failures, "peer_record_lookups": record_lookups, "peer_enumerations": enumerations,
        "rss_per_peer_mib": statistics.fmean(rss_per_peer) / (1 << 20) if rss_per_peer else None,
        "errors": errors,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peers", type=int, default=300)
    ap.add_argument("--per-process", type=int, default=10)
    ap.add_argument("--boots", type=int, default=3)
    ap.add_argument("--ranges", default="0:3,3:5,5:8")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--client-processes", type=int, default=2)
    ap.add_argument("--churn", type=float, default=0.1, help="fraction of the peers that leave and join per minute")
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup-s", type=float, default=30.0, help="after every peer is up, before counting")
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--boot-nice", type=int, default=-5, help="the bootstrap process's nice value (0: as the peers)")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--json", default=str(HERE / "results" / "swarm_scale.json"))
    args = ap.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="sangama-swarm-"))
    work.mkdir(parents=True, exist_ok=True)
    ranges = [tuple(map(int, r.split(":"))) for r in args.ranges.split(",")]
    model = make_model(work)
    want = work / "want.json"
    want.write_text(json.dumps({"prompts": PROMPTS, "tokens": references(model, ranges, args.tokens)}))
    boot_file = work / "boot.jsonl"
    boot = subprocess.Popen([*WORKER, "boot", "--count", str(args.boots), "--out", str(boot_file)],
                            stderr=(work / "boot.err").open("wb"))
    if args.boot_nice:  # the bootstraps as on machines of their own: not one process in 30 sharing two cores
        os.setpriority(os.PRIO_PROCESS, boot.pid, args.boot_nice)
    clients: list[subprocess.Popen[bytes]] = []
    swarm: Swarm | None = None
    try:
        boots = wait_for(boot_file, "boot", 1, 120)[0]["addrs"]
        swarm = Swarm(args, work, model, boots)
        processes = max(1, args.peers // args.per_process)
        t0 = time.time()
        for i in range(processes):
            swarm.start(i, i * args.per_process)
            swarm.next = i + 1
        for i in range(processes):
            wait_for(swarm.procs[i][1], "ready", 1, 600)
        print(f"{processes * args.per_process} peers up in {time.time() - t0:.0f} s", flush=True)
        client_files = []
        per = max(1, args.clients // args.client_processes)
        for c in range(args.client_processes):
            out = work / f"clients-{c}.jsonl"
            client_files.append(out)
            clients.append(subprocess.Popen(
                [*WORKER, "clients", "--boot", *boots, "--model", str(model), "--count", str(per), "--first",
                 str(c * per), "--want", str(want), "--tokens", str(args.tokens), "--out", str(out)],
                stderr=(work / f"clients-{c}.err").open("wb")))
        time.sleep(args.warmup_s)
        t_start = time.time()
        t_end = t_start + args.minutes * 60
        every = 60.0 / (args.churn * processes) if args.churn > 0 else math.inf
        next_churn = t_start + every
        victim = 0
        while time.time() < t_end:
            if time.time() >= next_churn:
                alive = [i for i in swarm.procs if i not in swarm.killed]
                target = alive[victim % len(alive)]
                victim += 1
                swarm.kill(target)
                swarm.start(swarm.next, swarm.first[target])  # fresh keys, the ranges of the peers that left
                swarm.next += 1
                next_churn += every
            time.sleep(0.5)
            done = sum(1 for f in client_files for e in read_events(f) if e.get("event") == "gen"
                       and e["start"] >= t_start)
            if int(time.time()) % 30 == 0:
                print(f"  {(time.time() - t_start) / 60:4.1f} min: {done} generations, "
                      f"{len(swarm.killed)} processes killed", flush=True)
                time.sleep(1)
        summary = summarize(args, swarm, client_files, boot_file, t_start, t_end)
    finally:
        for proc in clients:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if swarm is not None:
            swarm.stop()
        boot.send_signal(signal.SIGKILL)
        boot.wait()
    summary["workdir"] = str(work)
    rows = [(k, v) for k, v in summary.items() if k not in ("errors",)]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v:.3f}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    for e, n in sorted(summary["errors"].items(), key=lambda kv: -kv[1]):
        print(f"  error x{n}: {e}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    ok = summary["completed_fraction"] >= 0.99 and summary["wrong_tokens"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
