"""Size and decode cost of the models ``make_model`` writes: parameters, active parameters per token, and
transformers' decode step (a rough upper bound for an efficient implementation of the same model).

    python benchmarks/bench_presets.py [--presets tiny,small] [--threads 1] [--steps 20]

Prints a table and writes benchmarks/results/presets.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from sangama_p2p.model.make import make_model, tensor_plan
from sangama_p2p.model.presets import PRESETS, QwenMoePreset


def active_params(p) -> tuple[int, int]:
    """(total, active per token) parameters; embeddings count as one row, experts by top-k share."""
    total = active = 0
    for name, shape in tensor_plan(p):
        n = torch.Size(shape).numel()
        total += n
        if name.startswith("mtp."):
            continue
        if name == "model.embed_tokens.weight":
            active += shape[1]
        elif ".mlp.experts." in name and isinstance(p, QwenMoePreset):
            active += n * p.num_experts_per_tok / p.num_experts
        else:
            active += n
    return total, int(active)


def gemv_floor_ms(p, reps: int = 7) -> float:
    """One token through every active 2-D weight (x @ W.T, fp32): the matmul floor of an efficient decode step.

    Only the routed experts' share counts: the first ``top_k`` experts of each layer stand in for the chosen ones.
    """
    weights = []
    for name, shape in tensor_plan(p):
        if len(shape) != 2 or name.startswith("mtp.") or name == "model.embed_tokens.weight":
            continue
        if ".mlp.experts." in name and int(name.split(".mlp.experts.")[1].split(".")[0]) >= p.num_experts_per_tok:
            continue
        weights.append(torch.randn(shape))
    times = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            for w in weights:
                x = torch.randn(1, w.shape[1])
                x @ w.T
            times.append((time.perf_counter() - t0) * 1e3)
    return min(times)


def decode_ms(path: Path, steps: int, prompt: int) -> tuple[float, float, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.arange(3, 3 + prompt).unsqueeze(0)
    times = []
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        prefill = (time.perf_counter() - t0) * 1e3
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            t0 = time.perf_counter()
            out = model(tok, past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - t0) * 1e3)
            cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return prefill, statistics.median(times[2:] or times), min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for arch, presets in PRESETS.items():
        for name in args.presets.split(","):
            p = presets[name]
            total, active = active_params(p)
            with tempfile.TemporaryDirectory() as tmp:
                t0 = time.perf_counter()
                path = make_model(Path(tmp) / "m", arch, name, seed=0)
                make_s = time.perf_counter() - t0
                size_mb = (path / "model.safetensors").stat().st_size / 2**20
                prefill, step, step_min = decode_ms(path, args.steps, args.prompt)
            floor = gemv_floor_ms(p)
            rows.append(
                dict(arch=arch, preset=name, params=total, active_params=active, gflop_per_token=2 * active / 1e9,
                     active_mb_fp32=active * 4 / 2**20, file_mb=size_mb, make_s=make_s,
                     hf_prefill_ms=prefill, hf_decode_ms=step, hf_decode_min_ms=step_min, gemv_floor_ms=floor,
                     threads=args.threads,
                     load_avg_1m=os.getloadavg()[0])
            )
            r = rows[-1]  # the load average says how busy the machine was (other processes inflate the times)
            print(f"{arch:12} {name:6} params {total/1e6:8.2f}M active {active/1e6:6.2f}M "
                  f"{r['gflop_per_token']:.3f} GFLOP/tok  file {size_mb:7.1f} MB  make {make_s:5.1f}s  "
                  f"HF prefill({args.prompt}) {prefill:7.1f} ms  HF decode med {step:6.1f} / min {step_min:6.1f} ms  "
                  f"GEMV floor {floor:5.1f} ms  (load {r['load_avg_1m']:.1f})", flush=True)
    out = Path(__file__).parent / "results" / "presets.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
