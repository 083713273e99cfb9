"""Where a decode step's time goes (issue 30): torch's profiler over one-token steps of a whole model in this process.

    python benchmarks/profile_step.py FILE.gguf|DIR [--threads 1] [--steps 32] [--top 15] [--json OUT]

Runs a 16-token prefill, a warm-up of 4 steps, then ``--steps`` one-token decode steps (``StageModel.forward`` +
``logits``, what ``generate --local`` runs per token) under ``torch.profiler`` (CPU). Prints the wall time per step,
the time per step inside torch operators (self CPU time summed over every operator: the kernels and torch's own
per-call work), the remainder (Python: our code between operators), the number of operator calls per step, and the
operators that take the most self time. Writes ``benchmarks/results/profile_step.json`` (``--json``).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel, StepInput

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--json", type=Path, default=RESULTS / "profile_step.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ck = open_checkpoint(args.model, need_tokenizer=False)
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    prompt = torch.arange(1, 17) % ck.spec.vocab_size
    state = stage.new_session(len(prompt) + args.steps + 8)
    tok = stage.logits(stage.forward([StepInput(state, 0, tokens=prompt)])[-1:]).argmax(-1)
    pos = len(prompt)
    for _ in range(4):  # warm-up
        tok = stage.logits(stage.forward([StepInput(state, pos, tokens=tok)])).argmax(-1)
        pos += 1
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(args.steps):
            tok = stage.logits(stage.forward([StepInput(state, pos, tokens=tok)])).argmax(-1)
            pos += 1
        wall = (time.perf_counter() - t0) / args.steps
    events = prof.key_averages()
    ops = sum(e.self_cpu_time_total for e in events) / 1e6 / args.steps
    calls = sum(e.count for e in events) / args.steps
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]
    print(f"{args.model.name}, {args.threads} thread(s), {args.steps} decode steps; profiled (the profiler adds its "
          "own cost per call)")
    print(f"wall {1e3 * wall:.2f} ms/step; inside torch operators {1e3 * ops:.2f} ms ({ops / wall:.0%}); the rest "
          f"(Python between them) {1e3 * (wall - ops):.2f} ms; {calls:.0f} operator calls per step")
    print("| operator | self ms/step | calls/step | us/call |")
    print("|---|---|---|---|")
    rows = []
    for e in top:
        ms, n = e.self_cpu_time_total / 1e3 / args.steps, e.count / args.steps
        rows.append({"op": e.key, "self_ms_per_step": round(ms, 4), "calls_per_step": n})
        print(f"| {e.key} | {ms:.3f} | {n:.1f} | {1e3 * ms / max(n, 1e-9):.1f} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({
        "model": str(args.model), "machine": platform.node(), "threads": args.threads, "steps": args.steps,
        "wall_ms_per_step": round(1e3 * wall, 3), "ops_ms_per_step": round(1e3 * ops, 3),
        "op_share": round(ops / wall, 3), "calls_per_step": calls, "top": rows,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1) + "\n")


if __name__ == "__main__":
    main()
