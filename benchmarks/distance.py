"""Speed at a distance (issues 24 and 29): one request's tokens/s with 0, 2, 4 and 6 guesses across an 8-peer fleet in
three regions of the delay lab, at 0, 20, 40 and 80 ms between regions - the reference report's table, at a distance.

    sudo python benchmarks/distance.py --model DIR [--rtt 0 20 40 80] [--guesses 0 2 4 6] [--repeats 2] [--tokens 64]
        [--ring off on w2] [--client-apart] [--single] [--out distance.json]

``--model``: a trained checkpoint with an MTP layer that guesses well (guesses of a random model are all rejected):
the trained tiny model and its drafter (docs/operations.md; ``benchmarks/train_tiny.py`` then
``benchmarks/train_drafter.py``). Every process runs through the CLI in its own namespace of the delay lab
(``tests/net/delaylab.py``):

* region A: the bootstrap node, the client, three peers of layers 0:3;
* region B: three peers of 3:6;
* region C: two peers of 6:8.

Round trips: ``--rtt`` between every two regions, 2 ms inside one (0 when ``--rtt`` is 0: no delay anywhere). So every
chain crosses A -> B -> C -> A, and a trip is 1.5 x the round trip of wire plus 1 ms, whatever the client picks.
Stages: ``join --no-lanes --threads 1``. Once every 0:3 and 3:6 peer's record names its measured links to the next
range, each (repeat, prompt, guesses) runs one ``generate --json --ignore-eos`` (interleaved: all guesses of a prompt
one after the other, then again); the table gives the median ``decode_tokens_per_s`` and the ratio to no guesses, the
tokens per trip, and whether the tokens equal ``generate --local``'s (greedy: they must, in every run). Results in
``benchmarks/results/distance.json`` (``--out``).

Issue 29's comparison: ``--ring off on w2`` runs every (prompt, guesses) through the client (``generate
--no-ring``), with the ring closed at the first stage (``--ring``, the default since 2026-12-08) and with up to 2
guess windows in flight (``--windows 2``), one
right after the other; ``--client-apart`` puts the client
in a fourth region D, ``--rtt`` from every other (the issue's "20 ms between every pair, three stages and the client":
through the client a trip then crosses four such links, closed at the first stage three); ``--single`` keeps one peer
per range (a0, b0, c0), so every run takes the same chain and no run pays for opening a link.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[0] / "tests" / "net"))

from speculative import PROMPTS  # the code and prose prompts of the guesses benchmark
from spread import CLI, _Lines, _last_json, _load, _now, _write, lab_bootstrap, lab_cli, lab_start

REGIONS = {"boot": "A", "client": "A", "a0": "A", "a1": "A", "a2": "A", "b0": "B", "b1": "B", "b2": "B", "c0": "C",
           "c1": "C"}
LAYERS = {"a": "0:3", "b": "3:6", "c": "6:8"}
STAGES = [h for h in REGIONS if h not in ("boot", "client")]


def rtts(between: float, regions: str = "ABC") -> dict[tuple[str, str], float]:
    inside = 2.0 if between > 0 else 0.0
    out = {(r, r): inside for r in regions}
    out.update({(a, b): between for i, a in enumerate(regions) for b in regions[i + 1:]})
    return out


def _ring_args(mode: str) -> list[str]:
    """``generate``'s flags for a ``--ring`` mode: off (every trip through the client), on (the ring, one window),
    wN (the ring, up to N guess windows in flight)."""
    if mode == "off":
        return ["--no-ring"]
    return ["--ring", "--windows", mode[1:]] if mode.startswith("w") else ["--ring"]


def local_tokens(model: Path, prompt: str, tokens: int) -> list[int]:
    out = subprocess.run([*CLI, "generate", "--local", str(model), "--prompt", prompt, "--max-new-tokens",
                          str(tokens), "--ignore-eos", "--guesses", "0", "--json", "--threads", "1"], check=True,
                         capture_output=True, text=True, timeout=300)
    return _last_json(out.stdout)["tokens"]


def one_distance(between: float, model: Path, expected: dict[str, list[int]], guesses: list[int], repeats: int,
                 tokens: int, tmp: Path, rings: list[str], apart: bool, single: bool = False) -> dict[str, Any]:
    from delaylab import DelayLab

    regions = {**REGIONS, "client": "D"} if apart else dict(REGIONS)
    if single:  # one peer per range: every run takes the same chain, whose links the warm-up opened
        regions = {h: r for h, r in regions.items() if h in ("boot", "client") or h.endswith("0")}
    with DelayLab(regions, rtt_ms=rtts(between, "ABCD" if apart else "ABC")) as lab:
        def start(host: str, *args: str) -> _Lines:
            return lab_start(lab, host, *args, err=tmp / f"{host}-{between:g}.err")

        def cli(*args: str) -> dict[str, Any]:
            return lab_cli(lab, "client", *args, timeout=300)

        t0 = time.monotonic()
        _, boot = lab_bootstrap(lab, tmp / "boot.key", tmp / f"boot-{between:g}.err")
        peers = {h: start(h, "join", "--model", str(model), "--layers", LAYERS[h[0]], "--bootstrap", boot, "--listen",
                          "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp / f"{h}.key"), "--no-lanes", "--threads", "1")
                 for h in STAGES if h in regions}
        try:
            ids = {h: p.wait("ready ", 240).split()[1] for h, p in peers.items()}
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; the peers' stderr is in {tmp}") from exc
        host_of = {v: k for k, v in ids.items()}
        ready_s = time.monotonic() - t0
        nxt = {"a": "b", "b": "c"}
        deadline = time.monotonic() + 180
        while True:  # the 0:3 and 3:6 peers have measured (and published) their links to the next range
            got = {p["peer_id"]: (p.get("records") or [{}])[0] for p in
                   cli("status", "--bootstrap", boot, "--model", model.name, "--json", "--timeout", "10")["peers"]}
            missing = {h for h in ids if h[0] in nxt and not {ids[g] for g in ids if g[0] == nxt[h[0]]}
                       <= {k for k, _ in got.get(ids[h], {}).get("links") or []}}
            if not missing:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"links not measured within 180 s by {sorted(missing)}")
            time.sleep(1)
        links_s = time.monotonic() - t0
        for ring in rings:  # warm-up: streams (the ring's too), first steps
            cli("generate", "--model", model.name, "--tokenizer", str(model), "--bootstrap", boot, "--prompt",
                PROMPTS["code"], "--max-new-tokens", "8", "--guesses", "2", "--json", *_ring_args(ring))
        runs = []
        for rep in range(repeats):
            for name, text in PROMPTS.items():
                for k, ring in [(k, ring) for k in guesses for ring in rings]:
                    r = cli("generate", "--model", model.name, "--tokenizer", str(model), "--bootstrap", boot,
                            "--prompt", text, "--max-new-tokens", str(tokens), "--ignore-eos", "--guesses", str(k),
                            "--json", *_ring_args(ring))
                    runs.append({
                        "repeat": rep, "prompt": name, "guesses": k, "ring": ring, "tps": r["decode_tokens_per_s"],
                        "steps": r["steps"], "tokens_per_trip": len(r["tokens"]) / max(1, r["steps"]),
                        "route": [host_of.get(p, p) for p in r["route"]], "failovers": r["failovers"],
                        "tokens_equal_local": r["tokens"] == expected[name],
                        "hops": [{"from": host_of.get(h["from"], "client"), "to": host_of.get(h["to"], "client"),
                                  "ms": h["ms"], "measured": h["measured"]} for h in r["hops"]],
                        "where_the_time_goes": r.get("where_the_time_goes"),
                    })
                    print(f"  rtt {between:g} ms, {name}, {k} guesses, ring {ring}: "
                          f"{r['decode_tokens_per_s']:.1f} tok/s, "
                          f"{runs[-1]['tokens_per_trip']:.2f} tokens/trip, route {' -> '.join(runs[-1]['route'])}, "
                          f"equal to local: {runs[-1]['tokens_equal_local']}", flush=True)
    return {"rtt_ms": between, "configured": {f"{a}-{b}": v for (a, b), v in rtts(between, "ABCD" if apart else
                                                                                   "ABC").items()},
            "start_to_ready_s": ready_s, "start_to_links_s": links_s, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="a trained checkpoint directory with an MTP layer")
    ap.add_argument("--rtt", type=float, nargs="+", default=[0, 20, 40, 80], help="round trips between regions, ms")
    ap.add_argument("--guesses", type=int, nargs="+", default=[0, 2, 4, 6])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ring", nargs="+", choices=["on", "off", "w2", "w3", "w4"], default=["on"],
                    help="the ring closed at the first stage (on), every trip through the client (off), the ring with "
                    "up to N guess windows in flight (wN); default: on")
    ap.add_argument("--client-apart", action="store_true", help="the client in a region of its own (D)")
    ap.add_argument("--single", action="store_true", help="one peer per range (a0, b0, c0): three stages")
    ap.add_argument("--out", default="distance.json", help="results file under benchmarks/results")
    args = ap.parse_args()
    from delaylab import delaylab_unavailable_reason

    if (reason := delaylab_unavailable_reason()) is not None:
        raise SystemExit(f"cannot run the delay lab: {reason}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model = args.model.resolve()
    tmp = Path(tempfile.mkdtemp(prefix="sangama-distance-"))
    expected = {name: local_tokens(model, text, args.tokens) for name, text in PROMPTS.items()}
    load0, t0 = _load(), time.monotonic()
    rows = [one_distance(d, model, expected, args.guesses, args.repeats, args.tokens, tmp, args.ring,
                         args.client_apart, args.single) for d in args.rtt]
    load1 = _load()
    where = "in D, apart" if args.client_apart else "in A with 0:3"
    fleet = "3 peers (0:3 in A, 3:6 in B, 6:8 in C" if args.single else "8 peers (0:3 x3 in A, 3:6 x3 in B, 6:8 x2 in C"
    print(f"\none request across {fleet}, the client {where}), "
          f"{model.name}, {args.tokens} tokens, median of {args.repeats}; load {load0} -> {load1}")
    heads = " | ".join(f"{k} guesses" for k in args.guesses)
    print(f"| RTT between regions ms | prompt | ring | {heads} | tokens/trip at {max(args.guesses)} | tokens = local |")
    print("|---|---|---|" + "---|" * len(args.guesses) + "---|---|")
    base_of: dict[tuple[float, str], float] = {}  # the first ring setting's tokens/s without guesses: the baseline
    for row in rows:
        for name in PROMPTS:
            for ring in args.ring:
                mine = [r for r in row["runs"] if r["prompt"] == name and r.get("ring", "on") == ring]
                med = {k: statistics.median(r["tps"] for r in mine if r["guesses"] == k) for k in args.guesses}
                base = base_of.setdefault((row["rtt_ms"], name), med.get(0) or 0.0)
                cells = [f"{med[k]:.1f}" + (f" ({med[k] / base:.2f}x)" if base and (k or ring != args.ring[0])
                                            else "") for k in args.guesses]
                tpt = statistics.median(r["tokens_per_trip"] for r in mine if r["guesses"] == max(args.guesses))
                same = all(r["tokens_equal_local"] for r in mine)
                print(f"| {row['rtt_ms']:g} | {name} | {ring} | {' | '.join(cells)} | {tpt:.2f} | {same} |")
    out = {"machine": platform.node(), "when": _now(), "load": [load0, load1], "seconds": time.monotonic() - t0,
           "model": str(model), "tokens": args.tokens, "repeats": args.repeats, "guesses": args.guesses,
           "rings": args.ring, "client_apart": args.client_apart, "single": args.single, "prompts": PROMPTS,
           "distances": rows}
    _write(args.out, out)
    return 0 if all(r["tokens_equal_local"] for row in rows for r in row["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
