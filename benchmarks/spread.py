"""Spread fleets (issue 24): predicted against measured tokens/s across the delay lab, placement against the exact
optimum, the time to re-cover a range after its only peer leaves, and a leave and a join under running generations.

    sudo python benchmarks/spread.py [--lab] [--best] [--placement] [--recover] [--churn] [--runs 3]
                                     [--recover-runs 2] [--tokens 48] [--every 5]

No flag: all five parts (15-18 minutes on 2 busy cores). Each writes benchmarks/results/spread_<part>.json.

``--lab`` (root, the delay lab ``tests/net/delaylab.py``): the tiny made model (``qwen3_5_moe/tiny``, 8 layers),
stages started through the CLI with ``join --no-lanes --threads 1``, a bootstrap and the client in region A.
Topologies (configured round trips; one way is half; 2 ms inside a region):

* ``near/far``: stage 0:4 and a near 4:8 in B, a far 4:8 in C; A-B 40, A-C 40, B-C 80;
* ``two@20``: 0:4 in B, 4:8 in C; A-B, A-C and B-C all 20;
* ``three@20/40/80``: 0:3 in B, 3:6 in C, 6:8 in D, the client and bootstrap in B; B-C 20, C-D 40, B-D 80.

Once every non-last stage's record carries its measured links (``status --json``), ``--runs`` times
``generate --json --guesses 0 --max-new-tokens N --ignore-eos``. Predicted: 1000 / (the route's planned one-way hop
latencies, the result's ``hops``, + each chained stage's step time 1000 / ``throughput`` from its record) tokens/s;
measured: the result's ``decode_tokens_per_s`` (median of the runs). The result's ``where_the_time_goes`` (what
``--timings`` prints) is kept per run: queue, compute and send per stage, the network the rest.

``--placement``: ``benchmarks/placement.py``'s comparison (``place`` and ``petals_greedy`` against the exact
``brute_force`` on 20 seeded random 8-peer swarms), min / median of the ratios.

``--recover`` (loopback, no root): a bootstrap and four ``join --layers auto`` peers started one at a time (0:3, 3:6,
6:8, a spare on 0:3; the default ``rebalance_every``, 20 s), ``kill -9`` of the only 3:6 peer, then (i) seconds until
a peer prints ``moved ... 3:6`` (polled every 0.2 s) and (ii) seconds until a fresh ``generate`` (started right after
the kill, again after each failure) succeeds with the tokens of ``generate --local``.

``--best`` (root, the delay lab): the chain the client picks against the best one alone (:func:`best_case`): the
near/far topology, and two 4:8 peers one of which is held to 10% of a core; the median tokens/s with every peer up
over that with the alternative stopped.

``--churn`` (root, the delay lab): a leave and a join under generations that keep running (:func:`part_churn`);
every generation must succeed with the tokens of ``generate --local``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[0] / "tests" / "net"))

RESULTS = HERE / "results"
CLI = [sys.executable, "-c", "from sangama_p2p.cli.main import entry; entry()"]
PROMPT = "5,17,300,42,7"

TOPOLOGIES: dict[str, dict[str, Any]] = {
    "near/far": {
        "hosts": {"boot": "A", "client": "A", "s0": "B", "near": "B", "far": "C"},
        "rtt": {("A", "A"): 2, ("B", "B"): 2, ("C", "C"): 2, ("A", "B"): 40, ("A", "C"): 40, ("B", "C"): 80},
        "stages": [("s0", "0:4"), ("near", "4:8"), ("far", "4:8")],
    },
    "two@20": {
        "hosts": {"boot": "A", "client": "A", "s0": "B", "s1": "C"},
        "rtt": {("A", "A"): 2, ("A", "B"): 20, ("A", "C"): 20, ("B", "C"): 20},
        "stages": [("s0", "0:4"), ("s1", "4:8")],
    },
    "three@20/40/80": {
        "hosts": {"boot": "B", "client": "B", "s0": "B", "s1": "C", "s2": "D"},
        "rtt": {("B", "B"): 2, ("B", "C"): 20, ("C", "D"): 40, ("B", "D"): 80},
        "stages": [("s0", "0:3"), ("s1", "3:6"), ("s2", "6:8")],
    },
}


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _last_json(text: str) -> dict[str, Any]:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return json.loads(text.strip().splitlines()[-1])


def make_tiny(tmp: Path, tokens: int, stages: str | None = None) -> tuple[Path, list[int]]:
    tiny = tmp / "tiny"
    if not tiny.exists():
        subprocess.run([*CLI, "make-model", "--arch", "qwen3_5_moe", "--preset", "tiny", str(tiny)], check=True,
                       capture_output=True, timeout=300)
    extra = ["--stages", stages] if stages else []
    local = subprocess.run([*CLI, "generate", "--local", str(tiny), *extra, "--prompt-ids", PROMPT,
                            "--max-new-tokens", str(tokens), "--ignore-eos", "--json", "--threads", "1"], check=True,
                           capture_output=True, text=True, timeout=300)
    return tiny, _last_json(local.stdout)["tokens"]


class _Lines:
    """A process's stdout lines, read by a thread."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.proc = proc
        self.seen: list[str] = []  # every line so far
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.seen.append(line.rstrip("\n"))
            self._q.put(self.seen[-1])
        self._q.put(None)

    def wait(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while (line := self._q.get(timeout=max(0.01, end - time.monotonic()))) is not None:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"the process ended before a {prefix!r} line")


def lab_start(lab: Any, host: str, *args: str, err: Path | None = None) -> _Lines:
    """A CLI process in ``host``'s namespace of ``lab``, its stdout read by lines; its stderr to ``err`` (kept for
    a look when it ends early) or nowhere."""
    sink = err.open("w") if err is not None else subprocess.DEVNULL
    return _Lines(lab.popen(host, *CLI, *args, stdout=subprocess.PIPE, stderr=sink, text=True))


def lab_cli(lab: Any, host: str, *args: str, timeout: float = 240) -> dict[str, Any]:
    """One CLI command in ``host``'s namespace, its JSON answer; RuntimeError with its stderr when it fails."""
    out = subprocess.run(["ip", "netns", "exec", lab.ns[host], *CLI, *args], capture_output=True, text=True,
                         timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{args[0]} failed: {out.stderr[-3000:]}")
    return _last_json(out.stdout)


def lab_bootstrap(lab: Any, key: Path, err: Path | None = None) -> tuple[_Lines, str]:
    """A bootstrap node in host ``boot``, and its address that the lab's hosts reach."""
    proc = lab_start(lab, "boot", "bootstrap", "--listen", "/ip4/0.0.0.0/tcp/4001", "--key", str(key), err=err)
    addr = ""
    while lab.ip["boot"] not in addr:
        addr = proc.wait("  --bootstrap ", 60).split()[1]
    return proc, addr


# -- part 1: the delay lab ---------------------------------------------------------------------------------------
def lab_topology(name: str, topo: dict[str, Any], tiny: Path, expected: list[int], tmp: Path, runs: int,
                 tokens: int) -> dict[str, Any]:
    from delaylab import DelayLab

    with DelayLab(topo["hosts"], rtt_ms=topo["rtt"]) as lab:
        def start(host: str, *args: str) -> _Lines:
            return lab_start(lab, host, *args)

        def cli(host: str, *args: str) -> dict[str, Any]:
            return lab_cli(lab, host, *args)

        t0 = time.monotonic()
        _, boot = lab_bootstrap(lab, tmp / "b.key")
        procs = {h: start(h, "join", "--model", str(tiny), "--layers", layers, "--bootstrap", boot, "--listen",
                          "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp / f"{name}-{h}.key"), "--no-lanes", "--threads",
                          "1")
                 for h, layers in topo["stages"]}
        ids = {h: p.wait("ready ", 180).split()[1] for h, p in procs.items()}
        host_of = {v: k for k, v in ids.items()}
        layers = dict(topo["stages"])
        ready_s = time.monotonic() - t0
        # every stage that has successors: a record whose links name all of them
        want = {ids[h]: {ids[g] for g, lg in topo["stages"] if lg.split(":")[0] == lr.split(":")[1]}
                for h, lr in topo["stages"]}
        want = {k: v for k, v in want.items() if v}
        deadline = time.monotonic() + 120
        while True:
            peers = {p["peer_id"]: p for p in cli("client", "status", "--bootstrap", boot, "--model", tiny.name,
                                                  "--json", "--timeout", "10")["peers"]}
            recs = {pid: (peers.get(pid, {}).get("records") or [{}])[0] for pid in ids.values()}
            links = {pid: dict(r.get("links") or []) for pid, r in recs.items()}
            if all(w <= set(links[p]) for p, w in want.items()):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name}: links not measured within 120 s: {links}")
            time.sleep(1)
        links_s = time.monotonic() - t0
        gens, recs_at = [], []
        for i in range(runs):
            if i:  # the records a client reads now (a stage re-measures its step and re-publishes it)
                peers = {p["peer_id"]: p for p in cli("client", "status", "--bootstrap", boot, "--model", tiny.name,
                                                      "--json", "--timeout", "10")["peers"]}
                recs = {pid: (peers.get(pid, {}).get("records") or [{}])[0] or recs[pid] for pid in ids.values()}
            recs_at.append(recs)
            r = cli("client", "generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot,
                    "--prompt-ids", PROMPT, "--max-new-tokens", str(tokens), "--ignore-eos", "--guesses", "0",
                    "--json")
            gens.append(r)
        # the records' throughput again, after the runs (a stage re-measures and re-publishes)
        peers = {p["peer_id"]: p for p in cli("client", "status", "--bootstrap", boot, "--model", tiny.name,
                                              "--json", "--timeout", "10")["peers"]}
        recs_after = {pid: (peers.get(pid, {}).get("records") or [{}])[0] for pid in ids.values()}

    per_run = []
    host_of[""] = "client"
    for r, recs in zip(gens, recs_at):
        hop_ms = sum(h["ms"] for h in r["hops"])
        step_ms = sum(1000.0 / recs[p]["throughput"] for p in r["route"])
        wt = r.get("where_the_time_goes") or {}
        per_run.append({
            "route": [host_of.get(p, p) for p in r["route"]],
            "hops": [{"from": host_of.get(h["from"], h["from"]), "to": host_of.get(h["to"], h["to"]),
                      "ms": h["ms"], "measured": h["measured"]} for h in r["hops"]],
            "record_throughput": {host_of[p]: recs[p]["throughput"] for p in r["route"]},
            "hop_ms": hop_ms, "step_ms": step_ms, "predicted_tps": 1000.0 / (hop_ms + step_ms),
            "measured_tps": r["decode_tokens_per_s"], "decode_ms": r["decode_ms"], "steps": r["steps"],
            "tokens_equal_local": r["tokens"] == expected, "failovers": r["failovers"],
            "where_the_time_goes": wt,
        })
    routes = {tuple(x["route"]) for x in per_run}
    pred = statistics.median(x["predicted_tps"] for x in per_run)
    meas = statistics.median(x["measured_tps"] for x in per_run)
    configured = {f"{a}-{b}": lab.rtt_ms(a, b) for a in topo["hosts"] for b in topo["hosts"] if a < b}
    return {
        "topology": name, "hosts": topo["hosts"], "layers": layers, "configured_rtt_ms": configured,
        "routes": [list(x) for x in routes], "start_to_ready_s": ready_s, "start_to_links_s": links_s,
        "records": {host_of[p]: {"throughput": r.get("throughput"),
                                 "links_ms": {host_of.get(k, k): 1e3 * v for k, v in (r.get("links") or [])}}
                    for p, r in recs_at[0].items()},
        "records_after": {host_of[p]: {"throughput": r.get("throughput")} for p, r in recs_after.items()},
        "runs": per_run, "predicted_tps": pred, "measured_tps": meas, "ratio": meas / pred,
    }


def _mean_where(runs: list[dict[str, Any]]) -> str:
    """Mean per trip over the runs: network, then each stage's queue + compute + send."""
    parts = []
    wts = [r["where_the_time_goes"] for r in runs if r["where_the_time_goes"]]
    if not wts:
        return "-"
    trip = statistics.mean(w.get("trip_ms", 0.0) for w in wts)
    net = statistics.mean(w.get("network_ms", 0.0) for w in wts)
    hop = statistics.mean(r["hop_ms"] for r in runs)
    step = statistics.mean(r["step_ms"] for r in runs)
    stages = 0.0
    for i in range(len(wts[0].get("stages", []))):
        st = [w["stages"][i] for w in wts if len(w.get("stages", [])) > i]
        q, c, s = (statistics.mean(x[k] for x in st) for k in ("queue_ms", "compute_ms", "send_ms"))
        stages += q + c + s
        parts.append(f"stage {i + 1} q {q:.1f} c {c:.1f} s {s:.1f}")
    head = (f"trip {trip:.1f} (predicted {hop + step:.1f}): network {net:.1f} (planned hops {hop:.1f}), stages "
            f"{stages:.1f} (records' steps {step:.1f})")
    return "; ".join([head, *parts])


def part_lab(runs: int, tokens: int, only: list[str] | None) -> dict[str, Any]:
    from delaylab import delaylab_unavailable_reason

    reason = delaylab_unavailable_reason()
    if reason is not None:
        raise SystemExit(f"cannot run the delay lab: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="sangama-spread-"))
    tiny, expected = make_tiny(tmp, tokens)
    load0, t0 = _load(), time.monotonic()
    rows = [lab_topology(n, t, tiny, expected, tmp, runs, tokens) for n, t in TOPOLOGIES.items()
            if not only or n in only]
    load1 = _load()
    print(f"\npredicted vs measured across the delay lab: qwen3_5_moe/tiny, {tokens} tokens, --guesses 0, "
          f"median of {runs} runs; load {load0} -> {load1}")
    print("| topology | route | hops one-way ms (m: measured, e: estimated) | step ms | predicted tok/s "
          "| measured tok/s | measured/predicted (runs) | tokens = local |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        first = r["runs"][0]
        hops = ", ".join(f"{h['from']}->{h['to']} {h['ms']:.1f}{'m' if h['measured'] else 'e'}" for h in first["hops"])
        step = statistics.median(x["step_ms"] for x in r["runs"])
        same = all(x["tokens_equal_local"] for x in r["runs"])
        each = [x["measured_tps"] / x["predicted_tps"] for x in r["runs"]]
        lo, hi = min(each), max(each)
        print(f"| {r['topology']} | {' -> '.join(first['route'])} | {hops} | {step:.1f} | {r['predicted_tps']:.2f} "
              f"| {r['measured_tps']:.2f} | {r['ratio']:.2f} ({lo:.2f}-{hi:.2f}) | {same} |")
    print("\nwhere the time goes (mean per trip over the runs, ms; q/c/s: queue/compute/send):")
    for r in rows:
        print(f"  {r['topology']}: {_mean_where(r['runs'])}")
    out = {"machine": platform.node(), "when": _now(), "load": [load0, load1], "seconds": time.monotonic() - t0,
           "tokens": tokens, "runs": runs, "topologies": rows}
    _write("spread_lab.json", out)
    return out


# -- part 1b: the chosen chain against the best one ---------------------------------------------------------------
BEST_CASES: dict[str, dict[str, Any]] = {
    # the near/far topology; then the far 4:8 stops: the chain the client is left with is the one it should pick
    "near/far": {**TOPOLOGIES["near/far"], "drop": "far", "slow": None},
    # uneven speeds: two 4:8 peers in C, one held to 10% of a core; then the slow one stops
    "uneven": {"hosts": {"boot": "A", "client": "A", "s0": "B", "fast": "C", "slow": "C"},
               "rtt": {("A", "A"): 2, ("B", "B"): 2, ("C", "C"): 2, ("A", "B"): 20, ("A", "C"): 20, ("B", "C"): 20},
               "stages": [("s0", "0:4"), ("fast", "4:8"), ("slow", "4:8")], "drop": "slow", "slow": "slow"},
}


def best_case(name: str, case: dict[str, Any], tiny: Path, expected: list[int], tmp: Path, runs: int,
              tokens: int) -> dict[str, Any]:
    """``runs`` generates with every peer up, then ``runs`` with ``case["drop"]`` stopped (the chain the client
    should have picked is then the only one); the first's median tokens/s over the second's."""
    from delaylab import DelayLab

    group = Path("/sys/fs/cgroup/cpu") / f"sangama-best-{os.getpid()}"
    try:
        with DelayLab(case["hosts"], rtt_ms=case["rtt"]) as lab:
            def start(host: str, *args: str) -> _Lines:
                return lab_start(lab, host, *args, err=tmp / f"best-{host}.err")

            def generate() -> dict[str, Any]:
                r = lab_cli(lab, "client", "generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap",
                            boot, "--prompt-ids", PROMPT, "--max-new-tokens", str(tokens), "--ignore-eos",
                            "--guesses", "0", "--json", timeout=300)
                return {"tps": r["decode_tokens_per_s"], "route": [host_of.get(p, p) for p in r["route"]],
                        "tokens_equal_local": r["tokens"] == expected}

            _, boot = lab_bootstrap(lab, tmp / "b.key", tmp / "best-boot.err")
            procs = {}
            for h, layers in case["stages"]:
                procs[h] = start(h, "join", "--model", str(tiny), "--layers", layers, "--bootstrap", boot, "--listen",
                                 "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp / f"{name}-{h}.key"), "--no-lanes",
                                 "--threads", "1")
                if h == case["slow"]:  # before its model loads: the step it measures at start runs under the quota
                    group.mkdir()
                    (group / "cpu.cfs_period_us").write_text("100000")
                    (group / "cpu.cfs_quota_us").write_text("10000")
                    (group / "cgroup.procs").write_text(str(procs[h].proc.pid))
            ids = {h: p.wait("ready ", 240).split()[1] for h, p in procs.items()}
            host_of = {v: k for k, v in ids.items()}
            time.sleep(15)  # the first stage measures its links to both 4:8 peers and publishes them (every 10 s)
            generate()  # warm-up
            both = [generate() for _ in range(runs)]
            victim = procs[case["drop"]].proc
            victim.terminate()
            victim.wait(timeout=30)
            time.sleep(2)
            alone = [generate() for _ in range(runs)]
    finally:
        if group.exists():
            group.rmdir()
    m_both = statistics.median(r["tps"] for r in both)
    m_alone = statistics.median(r["tps"] for r in alone)
    return {"case": name, "hosts": case["hosts"], "dropped": case["drop"], "with_all": both, "best_alone": alone,
            "median_with_all": m_both, "median_best_alone": m_alone, "ratio": m_both / m_alone,
            "tokens_equal_local": all(r["tokens_equal_local"] for r in both + alone)}


def part_best(runs: int, tokens: int) -> dict[str, Any]:
    from delaylab import delaylab_unavailable_reason

    if (reason := delaylab_unavailable_reason()) is not None:
        raise SystemExit(f"cannot run the delay lab: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="sangama-spread-best-"))
    tiny, expected = make_tiny(tmp, tokens)
    load0, t0 = _load(), time.monotonic()
    rows = [best_case(n, c, tiny, expected, tmp, runs, tokens) for n, c in BEST_CASES.items()]
    load1 = _load()
    print(f"\nthe chain chosen against the best one alone: qwen3_5_moe/tiny, {tokens} tokens, --guesses 0, median of "
          f"{runs} runs each way; load {load0} -> {load1}")
    print("| case | routes with every peer | tok/s | routes with the other stopped | tok/s | ratio | tokens = local |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ra = sorted({" -> ".join(x["route"]) for x in r["with_all"]})
        rb = sorted({" -> ".join(x["route"]) for x in r["best_alone"]})
        print(f"| {r['case']} | {', '.join(ra)} | {r['median_with_all']:.2f} | {', '.join(rb)} "
              f"| {r['median_best_alone']:.2f} | {r['ratio']:.2f} | {r['tokens_equal_local']} |")
    out = {"machine": platform.node(), "when": _now(), "load": [load0, load1], "seconds": time.monotonic() - t0,
           "tokens": tokens, "runs": runs, "cases": rows}
    _write("spread_best.json", out)
    return out


# -- part 2: placement -----------------------------------------------------------------------------------------
def part_placement(seeds: int) -> dict[str, Any]:
    from sangama_p2p.placement import brute_force, petals_greedy, place, random_swarm, score

    load0, t0 = _load(), time.monotonic()
    rows = []
    for seed in range(seeds):
        peers, links = random_swarm(seed)
        ta = time.perf_counter()
        ours = place(peers, links, 32)
        tb = time.perf_counter()
        best = brute_force(peers, links, 32)
        tc = time.perf_counter()
        s_ours, s_best = score(ours, peers, links, 32), score(best, peers, links, 32)
        s_greedy = score(petals_greedy(peers, links, 32), peers, links, 32)
        rows.append({"seed": seed, "optimum": s_best.served, "place": s_ours.served, "greedy": s_greedy.served,
                     "place_ratio": s_ours.served / s_best.served, "greedy_ratio": s_greedy.served / s_best.served,
                     "place_s": tb - ta, "exact_s": tc - tb})
    load1 = _load()
    summary = {k: {"min": min(r[k] for r in rows), "median": statistics.median(r[k] for r in rows)}
               for k in ("place_ratio", "greedy_ratio", "place_s", "exact_s")}
    print(f"\nplacement against the exact optimum: {seeds} random 8-peer swarms (32 layers, 3 regions, 8 sessions); "
          f"load {load0} -> {load1}")
    print("| search | min ratio | median ratio | min s | median s |")
    print("|---|---|---|---|---|")
    s = summary
    print(f"| place | {s['place_ratio']['min']:.3f} | {s['place_ratio']['median']:.3f} | {s['place_s']['min']:.2f} "
          f"| {s['place_s']['median']:.2f} |")
    print(f"| petals_greedy | {s['greedy_ratio']['min']:.3f} | {s['greedy_ratio']['median']:.3f} | - | - |")
    print(f"| brute_force (the optimum) | 1 | 1 | {s['exact_s']['min']:.2f} | {s['exact_s']['median']:.2f} |")
    out = {"machine": platform.node(), "when": _now(), "load": [load0, load1], "seconds": time.monotonic() - t0,
           "swarms": rows, "summary": summary}
    _write("spread_placement.json", out)
    return out


# -- part 3: re-covering a range ----------------------------------------------------------------------------------
def recover_once(tiny: Path, expected: list[int], tokens: int, work: Path) -> dict[str, Any]:
    from sangama_p2p.cli.local_fleet import READY_PREFIX, LocalFleet

    def generate(boot: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*CLI, "generate", "--model", str(tiny), "--bootstrap", boot, "--prompt-ids", PROMPT,
                               "--max-new-tokens", str(tokens), "--ignore-eos", "--json"], capture_output=True,
                              text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))

    with LocalFleet(tiny, [], work) as fleet:
        peers, ranges = [], []
        for i in range(4):
            child = fleet.join(f"auto{i}", "auto", "-v")
            ranges.append(child.wait_for(READY_PREFIX, 180).split()[3])
            peers.append(child)
        if ranges != ["0:3", "3:6", "6:8", "0:3"]:
            raise RuntimeError(f"the auto peers took {ranges}")
        b0 = time.monotonic()
        before = generate(fleet.bootstrap_addr)
        before_s = time.monotonic() - b0  # a whole fleet's generate, the process included: the resolution of (ii)
        if before.returncode != 0 or _last_json(before.stdout)["tokens"] != expected:
            raise RuntimeError(f"the whole fleet did not generate: {before.stderr[-2000:]}")
        time.sleep(2)
        os.killpg(peers[1].proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        peers[1].proc.wait(timeout=10)
        moved: dict[str, Any] = {}
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set() and not moved:
                for p in (peers[0], peers[2], peers[3]):
                    lines = [x for x in p.seen if x.startswith("moved ")]
                    if lines:
                        moved.update(s=time.monotonic() - killed, peer=p.name, line=lines[0])
                        break
                time.sleep(0.2)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        attempts = []
        ok_s = None
        while time.monotonic() - killed < 180:
            a0 = time.monotonic() - killed
            g = generate(fleet.bootstrap_addr)
            a1 = time.monotonic() - killed
            good = g.returncode == 0 and _last_json(g.stdout)["tokens"] == expected
            info = _last_json(g.stdout) if g.returncode == 0 else {}
            attempts.append({"started_s": a0, "ended_s": a1, "ok": good, "failovers": info.get("failovers"),
                             "error": None if g.returncode == 0 else g.stderr.strip().splitlines()[-1:]})
            if good:
                ok_s = a1
                break
        watcher.join(timeout=60)
        stop.set()
    return {"ranges": ranges, "moved_s": moved.get("s"), "mover": moved.get("peer"), "moved_line": moved.get("line"),
            "generate_ok_s": ok_s, "ok_attempt_started_s": attempts[-1]["started_s"] if ok_s else None,
            "whole_fleet_generate_s": before_s, "attempts": attempts}


def part_recover(runs: int, tokens: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="sangama-spread-rec-"))
    tiny, expected = make_tiny(tmp, tokens, "0:3,3:6,6:8")
    load0, t0 = _load(), time.monotonic()
    rows = []
    for i in range(runs):
        rows.append(recover_once(tiny, expected, tokens, tmp / f"run{i}"))
        r = rows[-1]
        print(f"  run {i + 1}: moved after {r['moved_s'] or -1:.1f} s, a generate equal to local after "
              f"{r['generate_ok_s'] or -1:.1f} s ({len(r['attempts'])} attempts)", flush=True)
    load1 = _load()
    print(f"\nre-covering 3:6 after kill -9 of its only peer: loopback, qwen3_5_moe/tiny, 4 `join --layers auto`, "
          f"default rebalance_every (20 s), {tokens}-token generate; load {load0} -> {load1}")
    print("| run | mover | kill -> moved s | kill -> generate = local s (that attempt started at) | generate "
          "attempts | a generate before the kill s |")
    print("|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        ms = f"{r['moved_s']:.1f}" if r["moved_s"] is not None else "never"
        gs = (f"{r['generate_ok_s']:.1f} ({r['ok_attempt_started_s']:.1f})" if r["generate_ok_s"] is not None
              else "never")
        mover = f"{r['mover']} -> {' '.join((r['moved_line'] or '').split()[3:])}" if r["mover"] else "-"
        print(f"| {i + 1} | {mover} | {ms} | {gs} | {len(r['attempts'])} | {r['whole_fleet_generate_s']:.1f} |")
    got = [r["moved_s"] for r in rows if r["moved_s"] is not None]
    gen = [r["generate_ok_s"] for r in rows if r["generate_ok_s"] is not None]
    if got and gen:
        print(f"median: moved {statistics.median(got):.1f} s, generate {statistics.median(gen):.1f} s")
    out = {"machine": platform.node(), "when": _now(), "load": [load0, load1], "seconds": time.monotonic() - t0,
           "tokens": tokens, "rebalance_every_s": 20.0, "runs": rows}
    _write("spread_recover.json", out)
    return out


# -- part 4: a leave and a join under running generations, across the delay lab ------------------------------------
CHURN_HOSTS = {"boot": "A", "client": "A", "p0": "A", "p1": "B", "p2": "C", "p3": "B", "p4": "C"}
CHURN_RTT = {("A", "A"): 2, ("B", "B"): 2, ("C", "C"): 2, ("A", "B"): 20, ("A", "C"): 40, ("B", "C"): 20}


def _churn(lab: Any, tiny: Path, expected: list[int], config: Path, tokens: int, t0: float,
           gens: list[dict[str, Any]], events: dict[str, Any], group: Path) -> dict[str, str]:
    """:func:`part_churn`'s run inside ``lab``: fills ``gens`` and ``events``, returns the ranges the peers joined."""
    tmp = config.parent

    _, boot = lab_bootstrap(lab, tmp / "boot.key", tmp / "boot.err")

    def join(host: str) -> tuple[_Lines, str, str]:
        p = lab_start(lab, host, "join", "--model", str(tiny), "--layers", "auto", "--config", str(config), "--bootstrap",
                  boot, "--listen", "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp / f"{host}.key"), "--no-lanes",
                  "--threads", "1", err=tmp / f"{host}.err")
        ready = p.wait("ready ", 240).split()
        return p, ready[1], ready[3]

    peers = {h: join(h) for h in ("p0", "p1", "p2", "p3")}  # one after the other: each sees the ones before
    ranges = {h: r for h, (_, _, r) in peers.items()}
    spare_range = ranges["p3"]
    victim = next(h for h in ("p0", "p1", "p2") if ranges[h] != spare_range)
    stop = threading.Event()

    streamed = [0]  # tokens the running generation has streamed so far

    def generations() -> None:
        while not stop.is_set():
            a = time.monotonic() - t0
            streamed[0] = 0
            g = subprocess.Popen(["ip", "netns", "exec", lab.ns["client"], *CLI, "generate", "--model", tiny.name,
                                  "--tokenizer", str(tiny), "--bootstrap", boot, "--prompt-ids", PROMPT,
                                  "--max-new-tokens", str(tokens), "--ignore-eos", "--guesses", "0", "--jsonl"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            lines = []
            for line in g.stdout:  # type: ignore[union-attr]
                lines.append(line)
                streamed[0] += line.startswith('{"token"')
            err = g.stderr.read()  # type: ignore[union-attr]
            g.wait(timeout=60)
            r = json.loads(lines[-1]) if g.returncode == 0 and lines else {}
            gens.append({"started_s": a, "ended_s": time.monotonic() - t0, "ok": g.returncode == 0,
                         "tokens_equal_local": r.get("tokens") == expected, "failovers": r.get("failovers"),
                         "route": r.get("route"), "error": err.strip().splitlines()[-1:] if g.returncode
                         else None})

    def wait_good(n: int, after: float, limit: float = 240) -> None:
        end = time.monotonic() + limit
        while sum(g["ok"] and g["started_s"] > after for g in gens) < n and time.monotonic() < end:
            time.sleep(0.2)

    runner = threading.Thread(target=generations, daemon=True)
    runner.start()
    wait_good(2, 0)
    while streamed[0] < tokens // 4:  # the victim dies a quarter into a generation's decode
        time.sleep(0.01)
    kill_s = time.monotonic() - t0
    os.kill(peers[victim][0].proc.pid, signal.SIGKILL)
    peers[victim][0].proc.wait(timeout=10)
    moved = None
    while moved is None and time.monotonic() - t0 < kill_s + 120:
        moved = next(((h, x) for h, (p, _, _) in peers.items() for x in p.seen if x.startswith("moved ")), None)
        time.sleep(0.2)
    events["leave"] = {"victim": victim, "range": ranges[victim], "kill_s": kill_s,
                       "moved_s": (time.monotonic() - t0 - kill_s) if moved else None,
                       "mover": moved[0] if moved else None, "moved_line": moved[1] if moved else None}
    after_move = time.monotonic() - t0
    wait_good(2, after_move)

    def served_by_range() -> dict[str, float]:
        status = subprocess.run(["ip", "netns", "exec", lab.ns["client"], *CLI, "status", "--bootstrap", boot,
                                 "--model", tiny.name, "--json", "--timeout", "10"], capture_output=True,
                                text=True, timeout=120)
        served: dict[str, float] = {}
        for peer in _last_json(status.stdout)["peers"] if status.returncode == 0 else []:
            for rec in peer.get("records") or []:
                key = f"{rec['start']}:{rec['end']}"
                served[key] = served.get(key, 0.0) + float(rec.get("throughput") or 0.0)
        return served

    # a bottleneck: the one peer of 6:8 (every range has one now) held to 5 % of a core, until its record says it
    # serves under a third of the others' steps/s (join counts speeds within 2x as equal: they are noisy)
    now = {h: r for h, r in ranges.items() if h != victim}
    if moved:
        now[moved[0]] = moved[1].split()[3]
    slow = next(h for h, r in now.items() if r == "6:8")
    group.mkdir()
    (group / "cpu.cfs_period_us").write_text("100000")
    (group / "cpu.cfs_quota_us").write_text("5000")
    (group / "cgroup.procs").write_text(str(peers[slow][0].proc.pid))
    slowed_s = time.monotonic() - t0
    served = served_by_range()
    while not (len(served) == 3 and 3 * served["6:8"] < min(v for k, v in served.items() if k != "6:8")):
        if time.monotonic() - t0 > slowed_s + 180:
            raise RuntimeError(f"the held 6:8 peer's record did not fall under a third of the others': {served}")
        time.sleep(2)
        served = served_by_range()
    join_s = time.monotonic() - t0
    p4 = join("p4")
    events["join"] = {"range": p4[2], "served_steps_per_s_before": served, "slowed": slow, "slowed_s": slowed_s,
                      "join_s": join_s, "ready_s": time.monotonic() - t0,
                      "bottleneck": min(served, key=served.__getitem__) if served else None}
    wait_good(3, time.monotonic() - t0)
    stop.set()
    runner.join(timeout=300)
    return ranges


def part_churn(tokens: int, every: float) -> dict[str, Any]:
    """Four ``--layers auto`` peers across three regions (they take 0:3, 3:6, 6:8 and a spare), a client generating
    back to back; ``kill -9`` of the only peer of a range that is not the spare's, mid-generation (a spare's twin must
    move into the gap); once two generations passed after the move, the one peer of 6:8 is held to 5 % of a core
    (cgroup v1 cpu quota) and, once its record announces under a third of the others' steps/s, a fifth ``--layers auto``
    peer joins (it should take 6:8, the bottleneck); three more generations. Every generation must succeed with the
    tokens of ``generate --local``."""
    from delaylab import DelayLab, delaylab_unavailable_reason

    if (reason := delaylab_unavailable_reason()) is not None:
        raise SystemExit(f"cannot run the delay lab: {reason}")
    tmp = Path(tempfile.mkdtemp(prefix="sangama-spread-churn-"))
    tiny, expected = make_tiny(tmp, tokens, "0:3,3:6,6:8")
    config = tmp / "peer.toml"
    config.write_text(f'[stage]\nmodel = "{tiny}"\nrebalance_every = {every}\nrebalance_drain_s = 10\n')
    load0, t0 = _load(), time.monotonic()
    gens: list[dict[str, Any]] = []
    events: dict[str, Any] = {}
    group = Path("/sys/fs/cgroup/cpu") / f"sangama-churn-{os.getpid()}"
    try:
        with DelayLab(CHURN_HOSTS, rtt_ms=CHURN_RTT) as lab:
            ranges = _churn(lab, tiny, expected, config, tokens, t0, gens, events, group)
    finally:
        if group.exists():
            group.rmdir()
    load1 = _load()

    across = [g for g in gens if g["started_s"] <= events["leave"]["kill_s"] <= g["ended_s"]]
    out = {"machine": platform.node(), "when": _now(), "load": [load0, load1], "seconds": time.monotonic() - t0,
           "tokens": tokens, "rebalance_every_s": every, "configured_rtt_ms": {f"{a}-{b}": v for (a, b), v in
                                                                              CHURN_RTT.items()},
           "regions": CHURN_HOSTS, "ranges": ranges, "events": events, "generations": gens,
           "failed": sum(not g["ok"] for g in gens), "wrong": sum(g["ok"] and not g["tokens_equal_local"] for g in gens),
           "across_the_leave": across}
    lv, jn = events["leave"], events["join"]
    print(f"\na leave and a join under running generations across the delay lab (regions A-B 20, B-C 20, A-C 40 ms), "
          f"{tokens}-token generates back to back, rebalance_every {every:g} s; load {load0} -> {load1}")
    print(f"  joined: {ranges}; killed {lv['victim']} ({lv['range']}) {lv['kill_s']:.1f} s in; "
          f"{lv['mover']} moved {lv['moved_s'] or -1:.1f} s later ({lv['moved_line']})")
    print(f"  then p4 joined with --layers auto: took {jn['range']} (served steps/s by range before: "
          f"{ {k: round(v, 1) for k, v in jn['served_steps_per_s_before'].items()} }, fewest: {jn['bottleneck']})")
    print(f"  generations: {len(gens)}, failed {out['failed']}, wrong tokens {out['wrong']}; the one across the "
          f"kill: {[(g['ok'], g['tokens_equal_local'], g['failovers'], round(g['ended_s'] - g['started_s'], 1)) for g in across]}")
    _write("spread_churn.json", out)
    return out


def _write(name: str, data: dict[str, Any]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {RESULTS / name}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lab", action="store_true", help="predicted vs measured tokens/s in the delay lab (root)")
    ap.add_argument("--placement", action="store_true", help="placement vs the exact optimum")
    ap.add_argument("--recover", action="store_true", help="time to re-cover a range after a kill -9")
    ap.add_argument("--churn", action="store_true", help="a leave and a join under running generations (root)")
    ap.add_argument("--best", action="store_true", help="the chosen chain against the best one alone (root)")
    ap.add_argument("--every", type=float, default=5.0, help="--churn: the peers' rebalance_every, s")
    ap.add_argument("--runs", type=int, default=3, help="generates per topology")
    ap.add_argument("--recover-runs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--topology", action="append", choices=list(TOPOLOGIES), help="only these (repeatable)")
    args = ap.parse_args()
    every = not (args.lab or args.placement or args.recover or args.churn or args.best)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.monotonic()
    if args.lab or every:
        part_lab(args.runs, args.tokens, args.topology)
    if args.best or every:
        part_best(args.runs, args.tokens)
    if args.placement or every:
        part_placement(args.seeds)
    if args.recover or every:
        part_recover(args.recover_runs, args.tokens)
    if args.churn or every:
        part_churn(max(args.tokens, 160), args.every)
    print(f"\n{time.monotonic() - t0:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
