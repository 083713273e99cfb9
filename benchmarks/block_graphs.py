"""A decode step with its layers as ggml graphs (a Gated DeltaNet layer whole, an attention layer's MoE half), against
the same step through the torch path between ggml's products (issue 30; model/gguf/ggml_layer.py).

    python benchmarks/block_graphs.py FILE.gguf [FILE.gguf ...] [--threads 1] [--steps 24] [--rounds 3]

One process per file: the stage loads once, then rounds alternate graphs on / off (every layer's, token mixer's
and MoE's ``step`` set or cleared), each a fresh session, a 16-token prefill and ``--steps`` one-token decode steps
(``forward`` and ``logits``, what ``generate --local`` runs per token), timed after 2 warm-up steps. Prints ms per
step (median of the rounds) and the ratio, and writes benchmarks/results/block_graphs.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel, StepInput

RESULTS = Path(__file__).parent / "results"


def decode_ms(stage: StageModel, steps: int) -> float:
    spec = stage.spec
    state = stage.new_session(16 + steps + 4)
    tok = stage.logits(stage.forward([StepInput(state, 0, tokens=torch.arange(1, 17) % spec.vocab_size)])[-1:])
    tok = tok.argmax(-1)
    for i in range(steps + 2):
        if i == 2:
            t0 = time.perf_counter()
        tok = stage.logits(stage.forward([StepInput(state, 16 + i, tokens=tok)])).argmax(-1)
    return 1e3 * (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", type=Path, default=RESULTS / "block_graphs.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{args.threads} thread(s), {args.steps} decode steps, {args.rounds} rounds alternating")
    print("| file | blocks as graphs | ms/step graphs / torch path (median) | speed-up | rounds graphs / torch |")
    print("|---|---|---|---|---|")
    for path in args.files:
        ck = open_checkpoint(path, need_tokenizer=False)
        stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
        blocks = [(part, part.step) for layer in stage.layers.values() for part in (layer, layer.mixer, layer.ffn)
                  if getattr(part, "step", None) is not None]
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for on in (True, False):
                for part, step in blocks:
                    part.step = step if on else None
                times[on].append(decode_ms(stage, args.steps))
        g, t = statistics.median(times[True]), statistics.median(times[False])
        row = {"file": str(path), "blocks": len(blocks), "graphs_ms": round(g, 2), "torch_ms": round(t, 2),
               "speedup": round(t / g, 3), "rounds_graphs": [round(v, 2) for v in times[True]],
               "rounds_torch": [round(v, 2) for v in times[False]]}
        rows.append(row)
        print(f"| {path.name} | {len(blocks)} | {g:.1f} / {t:.1f} | {t / g:.2f}x | "
              f"{', '.join(f'{v:.0f}' for v in times[True])} / {', '.join(f'{v:.0f}' for v in times[False])} |")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"machine": platform.node(), "threads": args.threads, "steps": args.steps,
                                     "rounds": args.rounds, "rows": rows,
                                     "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}, indent=1) + "\n")


if __name__ == "__main__":
    main()
