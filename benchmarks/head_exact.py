"""What the head's float32 second pass (model/head.py) costs a decode token, side by side with the kernel's head alone.

    python benchmarks/head_exact.py [--rounds 5] [--tokens 64] [--threads 1] [--files Q4_1,Q8_0,Q4_K_M,F16]

For each SmolLM2-135M-Instruct file (``.ci/fetch-models``; the F16/Q8_0/Q4_K_M copies are made by tests/real), one
stage of all 30 layers generates ``--tokens`` tokens after a fixed prompt, greedy and sampled (temperature 0.8,
top_p 0.95), alternating the shipped head (A) and the same stage with the second pass switched off (B: the kernel's
rounded logits) round by round. Reports decode tokens/s (median over rounds), the paired ratio A/B, and how many
tokens the two arms agree on, and (greedy) each arm's common prefix with the float32 dequantize-per-use path.
Writes benchmarks/results/head_exact.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.sampling import SamplingParams
from sangama_p2p.model.stage import StageModel

RESULTS = Path(__file__).resolve().parent / "results" / "head_exact.json"
CACHE = Path.home() / ".cache" / "sangama-test"
PROMPT = "The history of the city of Paris begins with a small settlement on an island in the river"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--files", default="Q4_1,Q8_0,Q4_K_M,F16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    print(f"{'file':>7} {'mode':>8} {'A tok/s':>8} {'B tok/s':>8} {'A/B':>6} {'pairs':>13} {'same tokens':>11}")
    for label in args.files.split(","):
        path = CACHE / f"SmolLM2-135M-Instruct.{label}.gguf"
        if not path.exists():
            print(f"{label}: {path} is absent (tests/real makes the copies)")
            continue
        ckpt = open_checkpoint(path)
        stage = StageModel.load(ckpt.spec, ckpt.source, 0, ckpt.spec.num_layers)
        exact = stage.exact_head
        chain = LocalChain([stage], ckpt.tokenizer)
        ids = ckpt.tokenizer.encode(PROMPT)
        for mode, sampling in (("greedy", SamplingParams()), ("sampled", SamplingParams(0.8, 0.95, seed=3))):
            speed: dict[str, list[float]] = {"A": [], "B": []}
            toks: dict[str, list[int]] = {}
            for _ in range(args.rounds + 1):  # the first round warms both arms up and is not counted
                for arm in ("A", "B"):
                    stage.exact_head = exact if arm == "A" else None
                    r = chain.generate(ids, args.tokens, sampling, stop_at_eos=False)
                    speed[arm].append(r.decode_tokens_per_s)
                    toks[arm] = r.tokens
            stage.exact_head = exact
            a, b = speed["A"][1:], speed["B"][1:]
            ratios = [x / y for x, y in zip(a, b)]
            same = next((i for i, (x, y) in enumerate(zip(toks["A"], toks["B"])) if x != y), len(toks["A"]))
            print(f"{label:>7} {mode:>8} {statistics.median(a):>8.1f} {statistics.median(b):>8.1f} "
                  f"{statistics.median(ratios):>6.3f} {min(ratios):>6.3f}-{max(ratios):<6.3f} "
                  f"{same:>5} of {len(toks['A'])}")
            row = {"file": label, "mode": mode, "a_tokens_per_s": a, "b_tokens_per_s": b,
                   "ratio_median": round(statistics.median(ratios), 4), "ratios": [round(x, 4) for x in ratios],
                   "same_prefix": same, "tokens": len(toks["A"])}
            if mode == "greedy":  # free greedy agreement with the float32 per-use path, for each arm
                ref = LocalChain([StageModel.load(ckpt.spec, ckpt.source, 0, ckpt.spec.num_layers, fused=False)],
                                 ckpt.tokenizer).generate(ids, args.tokens, sampling, stop_at_eos=False).tokens
                for arm in ("A", "B"):
                    row[f"{arm.lower()}_prefix_with_per_use"] = next(
                        (i for i, (x, y) in enumerate(zip(toks[arm], ref)) if x != y), len(ref))
                print(f"{'':>7} {'':>8} common prefix with --dequantize-per-use: A {row['a_prefix_with_per_use']}, "
                      f"B {row['b_prefix_with_per_use']} of {len(ref)}")
            rows.append(row)
    RESULTS.write_text(json.dumps({"threads": args.threads, "tokens": args.tokens, "machine": platform.machine(),
                                   "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
