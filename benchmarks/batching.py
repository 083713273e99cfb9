"""Batching: aggregate and per-request tokens/s at 1/4/16/48 concurrent sessions, with and without guesses.

    python benchmarks/batching.py [--model DIR] [--preset tiny] [--threads 2] [--new 32] [--repeats 3]

Each run is one ``LocalChain.generate_many`` over N different prompts (the opening lines of N stdlib modules, sorted
by path): every trip runs all unfinished requests as one batched step per stage. Reported per N, guesses (0 or 4)
and batch invariance (off: the fast kernels; on: ``batch_invariant=True`` chains, whose results must not depend on
the batch): aggregate new tokens/s over the wall time of the whole call (prefill included), median per-request
decode tokens/s, and the aggregate speedup over N=1; also new tokens per CPU-second of this process (steadier than
wall time on a shared machine). Medians over ``--repeats``; each repeat runs every N in turn, so that the load of a
shared machine changing during the run hits all N alike rather than one row. Every request's tokens are compared with its solo run on a
batch-invariant chain (greedy): invariant batched runs must match exactly; the count of matches of the default chain
is reported as information. Writes benchmarks/results/batching.json. Goal: aggregate tokens/s at 16 >= 6x one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.spec import LayerRange

RESULTS = Path(__file__).parent / "results"


def stdlib_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """The first ``length`` tokens of the first ``n`` top-level stdlib modules (sorted) that are long enough."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for p in sorted(root.glob("*.py")):
        try:
            ids = tokenizer.encode(p.read_text(encoding="utf-8")[:4000])
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == n:
            return out
    raise SystemExit(f"found only {len(out)} stdlib modules for {n} prompts")


def run(chain: LocalChain, prompt_sets, new: int, guesses, repeats: int) -> list[tuple[list, float, float, float]]:
    """Per prompt set: (first repeat's results, median wall s, median CPU s, median of the per-request median decode
    tokens/s). Each repeat runs every set in turn, so that a change in the machine's load hits all sizes alike."""
    walls, cpus, per, first = ([[] for _ in prompt_sets] for _ in range(4))
    for _ in range(repeats):
        for i, prompts in enumerate(prompt_sets):
            t0, c0 = time.perf_counter(), time.process_time()
            res = chain.generate_many(prompts, new, guesses=guesses, stop_at_eos=False)
            walls[i].append(time.perf_counter() - t0)
            cpus[i].append(time.process_time() - c0)
            per[i].append(statistics.median(r.decode_tokens_per_s for r in res))
            first[i] = first[i] or res
    return [(first[i], statistics.median(walls[i]), statistics.median(cpus[i]), statistics.median(per[i]))
            for i in range(len(prompt_sets))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint (default /tmp/sangama-trained-<preset>)")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sessions", default="1,4,16,48")
    ap.add_argument("--guesses", default="0,4")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tag", default="", help="suffix of this run's key in the JSON (key: checkpoint dir name)")
    ap.add_argument("--json", default=str(RESULTS / "batching.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = Path(args.model or f"/tmp/sangama-trained-{args.preset}")
    if not (model / "config.json").is_file():
        from speculative import ensure_model  # same directory: trains the model the same way

        ensure_model(model, args.preset, args.threads)
    load0 = os.getloadavg()
    ck = open_checkpoint(model)
    whole = [LayerRange(0, ck.spec.num_layers)]
    chains = {False: LocalChain.load(ck, whole), True: LocalChain.load(ck, whole, batch_invariant=True)}
    sizes = [int(x) for x in args.sessions.split(",")]
    guess_list = [int(g) if g.isdigit() else g for g in args.guesses.split(",")]
    prompts = stdlib_prompts(ck.tokenizer, max(sizes), args.prompt_tokens)
    solo: dict = {}
    for g in guess_list:  # reference: each prompt alone on the batch-invariant chain
        solo[g] = [chains[True].generate(p, args.new, guesses=g, stop_at_eos=False).tokens for p in prompts]
    rows = []
    print(f"{'sessions':>8} {'k':>3} {'invariant':>9} {'agg tok/s':>10} {'x vs 1':>7} {'agg t/cpu':>10} "
          f"{'cpu x':>7} {'per-req tok/s':>13} "
          f"{'= solo':>8}")
    for g in guess_list:
        for inv in (False, True):
            base = base_cpu = None
            measured = run(chains[inv], [prompts[:n] for n in sizes], args.new, g, args.repeats)
            for n, (res, wall, cpu, per) in zip(sizes, measured):
                agg = sum(len(r.tokens) for r in res) / wall
                agg_cpu = sum(len(r.tokens) for r in res) / cpu
                base, base_cpu = base or agg, base_cpu or agg_cpu
                same = sum(r.tokens == s for r, s in zip(res, solo[g][:n]))
                rows.append({"sessions": n, "guesses": g, "batch_invariant": inv, "aggregate_tokens_per_s":
                             round(agg, 2), "speedup_vs_1": round(agg / base, 3),
                             "aggregate_tokens_per_cpu_s": round(agg_cpu, 2),
                             "cpu_speedup_vs_1": round(agg_cpu / base_cpu, 3), "per_request_tokens_per_s":
                             round(per, 2), "wall_s": round(wall, 4), "equal_to_solo": same, "requests": n,
                             "tokens_per_step": round(statistics.mean(r.tokens_per_step for r in res), 3)})
                r = rows[-1]
                print(f"{n:>8} {g:>3} {str(inv):>9} {agg:>10.1f} {r['speedup_vs_1']:>7.2f} {agg_cpu:>10.1f} "
                      f"{r['cpu_speedup_vs_1']:>7.2f} {per:>13.1f} "
                      f"{same:>4}/{n:<3}", flush=True)
    bad = [r for r in rows if r["batch_invariant"] and r["equal_to_solo"] != r["requests"]]
    meta = {"model": str(model), "arch": ck.spec.arch, "threads": args.threads, "new_tokens": args.new,
            "prompt_tokens": args.prompt_tokens, "repeats": args.repeats,
            "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "invariant_runs_all_equal_to_solo": not bad}
    path = Path(args.json)
    path.parent.mkdir(exist_ok=True)
    runs = json.loads(path.read_text()).get("runs", {}) if path.is_file() else {}
    runs[model.name + args.tag] = {"meta": meta, "rows": rows}  # one entry per checkpoint benchmarked
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"batch-invariant runs equal to solo: {'all' if not bad else 'NOT ALL'}; load average "
          f"{meta['loadavg_start']} -> {meta['loadavg_end']}; wrote {args.json}")


if __name__ == "__main__":
    main()
