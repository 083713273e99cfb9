"""Why a pipeline stage computes slower than the same layers in one process: a step that follows idle time.

    python benchmarks/cold_step.py [--steps 200] [--repeats 3] [--model PATH --layers A:B]

A pipeline stage is idle between its steps (the other stages and the network take their turn); a one-process run
computes back to back. This measures one 1-token step of the anchor's first stage (tiny Llama, layers 0:3, fp32, one
torch thread) run back to back, after sleeping for a gap (the thread gives its CPU back, as a stage waiting for its
next frame does), and after busy-waiting for the same gap (the CPU stays ours but nothing of the model is touched).
On the 2-core development VM the step after a sleep took about twice as long as back to back; the JSON records what
this machine does. ``--model PATH --layers A:B``: that stage of a checkpoint (a directory or a .gguf file) instead,
e.g. the middle stage of the made Qwen3.5-MoE Q4_K of ``vs_llamacpp.py`` (``--layers 4:8``), whose fleet waits about
8 ms between a stage's steps. Writes benchmarks/results/cold_step.json (cold_step-LABEL.json for a given model).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.model.stage import StageModel, StepInput

RESULTS = Path(__file__).parent / "results"
GAPS_MS = (0.0, 0.5, 2.0, 4.0, 8.0)


def step_ms(model: StageModel, steps: int, gap_s: float, spin: bool) -> float:
    """Median ms of a one-token step that follows ``gap_s`` of sleep (or busy-wait)."""
    state = model.new_session(steps + 8)
    seed = torch.Generator().manual_seed(0)
    hidden = None if model.is_first else torch.randn(1, model.spec.hidden_size, generator=seed) * 0.5
    times = []
    for i in range(steps):
        if gap_s:
            if spin:
                end = time.perf_counter() + gap_s
                while time.perf_counter() < end:
                    pass
            else:
                time.sleep(gap_s)
        t0 = time.perf_counter()
        model.forward([StepInput(state, i, tokens=torch.tensor([5])) if hidden is None
                       else StepInput(state, i, hidden=hidden)])
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--model", type=Path, default=None, help="a checkpoint (default: a made tiny Llama)")
    p.add_argument("--layers", default="0:3", help="the stage's layers A:B (default 0:3)")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    path = args.model or make_model(Path(tempfile.mkdtemp(prefix="sangama-cold-")) / "llama", "llama", "tiny")
    ckpt = open_checkpoint(path, tokenizer=False)
    start, end = (int(v) for v in args.layers.split(":"))
    model = StageModel.load(ckpt.spec, ckpt.source, start, end)
    label = f"layers {start}:{end} ({path.name if args.model else 'tiny Llama'})"
    step_ms(model, 20, 0.0, False)  # warm-up
    load0 = os.getloadavg()
    rows: dict[str, list[float]] = {}
    for _ in range(args.repeats):  # the settings take turns, so a drift of the host falls on all of them
        for gap in GAPS_MS:
            for spin in ((False,) if gap == 0 else (False, True)):
                key = "back to back" if gap == 0 else f"after {gap:g} ms {'busy-wait' if spin else 'sleep'}"
                rows.setdefault(key, []).append(step_ms(model, args.steps, gap / 1e3, spin))
    base = statistics.median(rows["back to back"])
    print(f"{'one-token step of ' + label:<34} {'median ms':>10} {'x back to back':>15}")
    out = []
    for key, vals in rows.items():
        ms = statistics.median(vals)
        print(f"{key:<34} {ms:>10.3f} {ms / base:>15.2f}")
        out.append({"setting": key, "step_ms": round(ms, 4), "runs_ms": [round(v, 4) for v in vals],
                    "vs_back_to_back": round(ms / base, 3)})
    RESULTS.mkdir(exist_ok=True)
    meta = {"machine": platform.platform(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "load_avg_before": load0, "load_avg_after": os.getloadavg(), "steps": args.steps,
            "repeats": args.repeats, "stage": label, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    name = "cold_step.json" if args.model is None else f"cold_step-{args.model.stem}-{start}-{end}.json"
    (RESULTS / name).write_text(json.dumps({"meta": meta, "rows": out}, indent=2) + "\n")
    print(f"load average {load0} -> {os.getloadavg()}; wrote {RESULTS / name}")


if __name__ == "__main__":
    main()
