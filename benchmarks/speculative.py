"""Guesses (MTP speculative decoding): tokens/s, tokens per step, acceptance by position, rollback cost.

    python benchmarks/speculative.py [--model DIR] [--preset tiny] [--threads 2] [--new 64] [--repeats 3]

For a code prompt and a prose prompt, on the whole model (1 stage) and a 3-stage split in one process, runs greedy
generation at guesses 0/2/4/6/auto (repeats interleaved: 0, 2, 4, ..., 0, 2, 4, ...) and reports the median decode
tokens/s (wall) and new tokens per CPU-second of this process (prefill included; steadier than wall time on a shared
machine), the speedups over no guesses, tokens per
step, acceptance per guess position, and whether the tokens equal the no-guess run (they must: greedy acceptance
keeps only guesses equal to the argmax). Rollback cost is measured two ways on the k=4 runs:

- ``roll_back``: wall time inside ``SessionState.roll_back`` (select ring snapshots, move the position), summed over
  all stages and steps, per step and as % of the decode step time;
- ring writes: the same (k+1)-token steps (the k=4 run's accepted token stream, cut into steps of k+1) replayed
  through every stage with a rollback ring of k+1 vs no ring; the difference is what keeping per-position
  snapshots costs (without a ring, a multi-token step takes the prefill path and writes only the final state).

``--model``: a trained checkpoint (``benchmarks/train_tiny.py``); trained first if missing. Writes
benchmarks/results/speculative.json. Goals: k=4 >= 2.5 tokens/step and >= 2x tokens/s; auto >= 1.0x on prose;
rollback <= 1% of step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.spec import LayerRange
from sangama_p2p.model.stage import StepInput
from sangama_p2p.model.state import SessionState

RESULTS = Path(__file__).parent / "results"
PROMPTS = {
    "code": 'def read_lines(path, encoding="utf-8"):\n    """Return the lines of the file at path."""\n    with open(',
    "prose": "This module provides a simple interface to the operating system. The functions described here are",
}


def ensure_model(path: Path, preset: str, threads: int) -> None:
    if (path / "config.json").is_file():
        return
    script = Path(__file__).parent / "train_tiny.py"
    print(f"{path} is missing: training it with {script.name} --preset {preset}")
    subprocess.run([sys.executable, str(script), "--preset", preset, "--out", str(path), "--threads", str(threads)],
                   check=True)


def split_ranges(n_layers: int, parts: int) -> list[LayerRange]:
    bounds = [round(i * n_layers / parts) for i in range(parts + 1)]
    return [LayerRange(a, b) for a, b in zip(bounds, bounds[1:])]


class RollbackTimer:
    """Wraps ``SessionState.roll_back`` for the duration of a run: total seconds and real rollbacks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rollbacks = 0
        self._orig = SessionState.roll_back

    def __enter__(self) -> "RollbackTimer":
        orig, timer = self._orig, self

        def timed(state: SessionState, pos: int) -> None:
            moved = pos != state.position
            t0 = time.perf_counter()
            orig(state, pos)
            timer.seconds += time.perf_counter() - t0
            timer.rollbacks += moved

        SessionState.roll_back = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        SessionState.roll_back = self._orig  # type: ignore[method-assign]


def ring_write_cost(chain: LocalChain, ids: list[int], step: int, repeats: int) -> tuple[float, float, int]:
    """Median CPU seconds to push ``ids`` through all stages in ``step``-token steps: (with ring, without, steps)."""
    n0 = len(ids) - (len(ids) - 1) // step * step  # first chunk (prefill) so the rest splits into whole steps
    prompt, rest = ids[:n0], ids[n0:]
    chunks = [rest[i:i + step] for i in range(0, len(rest), step)]
    out = []
    for ring in (step, 0):
        times = []
        for _ in range(repeats):
            sessions = [s.new_session(len(ids) + 1, ring=ring) for s in chain.stages]
            _through(chain, sessions, 0, prompt)
            t0 = time.process_time()  # CPU time: the machine is shared, wall time is mostly other processes
            pos = n0
            for c in chunks:
                _through(chain, sessions, pos, c)
                pos += len(c)
            times.append(time.process_time() - t0)
        out.append(statistics.median(times))
    return out[0], out[1], len(chunks)


def _through(chain: LocalChain, sessions, start: int, tokens: list[int]) -> None:
    x = None
    for st, sess in zip(chain.stages, sessions):
        if st.is_first:
            x = st.forward([StepInput(sess, start, tokens=torch.tensor(tokens))])
        else:
            x = st.forward([StepInput(sess, start, hidden=x)])


def bench_layout(chain: LocalChain, layout: str, prompts: dict[str, list[int]], args) -> list[dict]:
    rows = []
    for pname, ids in prompts.items():
        base_tokens, base_tps = None, None
        # repeats go round the settings (0, 2, 4, ..., 0, 2, 4, ...) so that a shared machine's changing load falls
        # on every setting alike rather than on whichever one ran in a busy minute
        by_k: dict = {k: [] for k in args.guesses}
        for _ in range(args.repeats):
            for k in args.guesses:
                c0 = time.process_time()
                with RollbackTimer() as rt:
                    res = chain.generate(ids, args.new, guesses=k, stop_at_eos=False)
                by_k[k].append((res, rt.seconds, rt.rollbacks, time.process_time() - c0))
        for k in args.guesses:
            runs = by_k[k]
            tps = statistics.median(r[0].decode_tokens_per_s for r in runs)
            cpu_tps = statistics.median(len(r[0].tokens) / r[3] for r in runs)
            res = runs[0][0]
            if k == 0:
                base_tokens, base_tps, base_cpu = res.tokens, tps, cpu_tps
            step_ms = statistics.median(r[0].decode_s / max(r[0].steps, 1) for r in runs) * 1e3
            rb_ms = statistics.median(r[1] / max(r[0].steps, 1) for r in runs) * 1e3
            rows.append({
                "layout": layout, "prompt": pname, "guesses": k, "tokens_per_s": round(tps, 2),
                "speedup": round(tps / base_tps, 3) if base_tps else None,
                "cpu_tokens_per_s": round(cpu_tps, 2), "cpu_speedup": round(cpu_tps / base_cpu, 3),
                "tokens_per_step": round(res.tokens_per_step, 3), "steps": res.steps,
                "acceptance_by_position": [round(a, 3) for a in res.accepted_at],
                "accepted_per_step": round(res.guesses_accepted / max(res.steps, 1), 3),
                "same_tokens_as_no_guess": res.tokens == base_tokens,
                "step_ms": round(step_ms, 3), "rollback_ms_per_step": round(rb_ms, 4),
                "rollback_pct_of_step": round(100 * rb_ms / step_ms, 3) if step_ms else None,
                "rollbacks": runs[0][2], "text": res.text,
            })
            r = rows[-1]
            print(f"{layout:<8} {pname:<6} {str(k):>5} {r['tokens_per_s']:>8.1f} {r['speedup']:>6.2f} "
                  f"{r['cpu_tokens_per_s']:>8.1f} {r['cpu_speedup']:>6.2f} "
                  f"{r['tokens_per_step']:>8.2f} {str(r['same_tokens_as_no_guess']):>6} {r['step_ms']:>8.2f} "
                  f"{r['rollback_ms_per_step']:>8.4f} {r['rollback_pct_of_step']:>6.3f}  "
                  f"{' '.join(f'{a:.2f}' for a in r['acceptance_by_position'])}", flush=True)
            if k == 4:
                stream = ids + res.tokens
                with_ring, without, n = ring_write_cost(chain, stream, 5, max(args.repeats, 5))
                r["ring_write_ms_per_step"] = round((with_ring - without) / n * 1e3, 4)
                r["ring_step_ms_with"] = round(with_ring / n * 1e3, 3)
                r["ring_step_ms_without"] = round(without / n * 1e3, 3)
                r["ring_write_pct_of_step"] = round(100 * (with_ring - without) / with_ring, 2)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="trained checkpoint (default /tmp/sangama-trained-<preset>)")
    ap.add_argument("--preset", default="tiny", choices=["tiny", "small"], help="what to train if --model is missing")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new", type=int, default=64, help="new tokens per generation")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--guesses", default="0,2,4,6,auto", help="comma-separated; must start with 0 (the baseline)")
    ap.add_argument("--layouts", default="whole,3-stage")
    ap.add_argument("--tag", default="", help="suffix of this run's key in the JSON (key: checkpoint dir name)")
    ap.add_argument("--json", default=str(RESULTS / "speculative.json"))
    args = ap.parse_args()
    args.guesses = [int(g) if g.isdigit() else g for g in args.guesses.split(",")]
    if args.guesses[0] != 0:
        ap.error("--guesses must start with 0: it is the baseline of speedups and token equality")
    torch.set_num_threads(args.threads)
    model = Path(args.model or f"/tmp/sangama-trained-{args.preset}")
    ensure_model(model, args.preset, args.threads)
    load0 = os.getloadavg()
    ck = open_checkpoint(model)
    prompts = {name: ck.tokenizer.encode(text) for name, text in PROMPTS.items()}
    n = ck.spec.num_layers
    print(f"{'layout':<8} {'prompt':<6} {'k':>5} {'tok/s':>8} {'x':>6} {'cpu t/s':>8} {'cpu x':>6} "
          f"{'tok/step':>8} {'same':>6} {'step ms':>8} "
          f"{'rb ms':>8} {'rb %':>6}  acceptance by position")
    rows = []
    layouts = {"whole": [LayerRange(0, n)], "3-stage": split_ranges(n, 3)}
    for layout in args.layouts.split(","):
        ranges = layouts[layout]
        chain = LocalChain.load(ck, ranges)
        chain.generate(prompts["code"], 8, guesses=2, stop_at_eos=False)  # warm-up
        rows += bench_layout(chain, layout, prompts, args)
    ring = [r for r in rows if "ring_write_ms_per_step" in r]
    print("\nring writes at k=4 (same 5-token steps, ring of 5 vs none):")
    for r in ring:
        print(f"  {r['layout']:<8} {r['prompt']:<6} with ring {r['ring_step_ms_with']:.3f} ms/step, without "
              f"{r['ring_step_ms_without']:.3f} ms/step: {r['ring_write_ms_per_step']:+.4f} ms "
              f"({r['ring_write_pct_of_step']:+.2f}%)")
    meta = {"model": str(model), "arch": ck.spec.arch, "layers": n, "threads": args.threads,
            "new_tokens": args.new, "repeats": args.repeats, "prompts": PROMPTS,
            "loadavg_start": [round(x, 2) for x in load0], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "torch": torch.__version__, "machine": platform.machine(), "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    path = Path(args.json)
    path.parent.mkdir(exist_ok=True)
    runs = json.loads(path.read_text()).get("runs", {}) if path.is_file() else {}
    runs[model.name + args.tag] = {"meta": meta, "rows": rows}  # one entry per checkpoint benchmarked
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"load average {meta['loadavg_start']} -> {meta['loadavg_end']}; wrote {args.json}")


if __name__ == "__main__":
    main()
