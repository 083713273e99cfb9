"""GGUF dequantization throughput (ours in torch vs gguf-py in numpy) and decode ms/token of Q4_K vs F16 stages.

    python benchmarks/gguf_dequant.py [--rows 2048] [--cols 4096] [--threads 1] [--arch llama] [--preset small]

Prints two tables and writes benchmarks/results/gguf.json. Throughput is reported as GB/s of float32 output and of
quantized input. Decode: one stage holding the whole model, one token per step, median over the steps.

Run with ``THP_MEM_ALLOC_ENABLE=1``: torch then backs large CPU allocations with transparent huge pages, as numpy
does by default; without it each fresh 32 MB output costs ~8k page faults, which dominate dequantization time.
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

import gguf
import numpy as np
import torch

from sangama_p2p.model.gguf import open_gguf, write_gguf
from sangama_p2p.model.gguf.quantizer import quantize
from sangama_p2p.model.gguf.quants import BLOCK_SIZES, QType, QuantTensor, type_name
from sangama_p2p.model.make import make_model
from sangama_p2p.model.stage import StageModel, StepInput

RESULTS = Path(__file__).parent / "results"
TYPES = (QType.Q4_0, QType.Q5_0, QType.Q8_0, QType.Q4_K, QType.Q5_K, QType.Q6_K)


def _blocks(qtype: int, rows: int, cols: int) -> np.ndarray:
    """Realistic blocks: quantize Gaussian weights where we can, else random bytes with sane fp16 scales."""
    rng = np.random.default_rng(0)
    if qtype != QType.Q5_K:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.02, qtype)
    bs, ts = BLOCK_SIZES[qtype]
    b = rng.integers(0, 256, size=(rows * cols // bs, ts), dtype=np.uint8)
    b[:, 0:4] = np.array([0.001, 0.001], np.float16).view(np.uint8)
    return b.reshape(rows, -1)


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def bench_dequant(rows: int, cols: int, repeats: int) -> list[dict]:
    out = []
    for qtype in TYPES:
        blocks = _blocks(qtype, rows, cols)
        qt = QuantTensor(qtype, torch.from_numpy(blocks), cols)
        qt.dequantize(torch.float32)
        ours = _best(lambda: qt.dequantize(torch.float32), repeats)
        ref = _best(lambda: gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)), max(1, repeats // 2))
        f32_gb = rows * cols * 4 / 1e9
        out.append({
            "type": type_name(qtype),
            "elements": rows * cols,
            "ours_ms": ours * 1e3,
            "gguf_py_ms": ref * 1e3,
            "ours_out_gbps": f32_gb / ours,
            "gguf_py_out_gbps": f32_gb / ref,
            "ours_in_gbps": blocks.nbytes / 1e9 / ours,
            "speedup": ref / ours,
        })
    return out


def _decode_ms(path: Path, steps: int) -> tuple[float, int]:
    spec, src, _ = open_gguf(path)
    stage = StageModel.load(spec, src, 0, spec.num_layers)
    prompt = torch.arange(1, 9)
    state = stage.new_session(len(prompt) + steps + 1)
    tok = stage.logits(stage.forward([StepInput(state, 0, tokens=prompt)])[-1:]).argmax(-1)
    times = []
    for i in range(steps):
        t0 = time.perf_counter()
        tok = stage.logits(stage.forward([StepInput(state, len(prompt) + i, tokens=tok)])).argmax(-1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, stage.resident_bytes


def bench_decode(arch: str, preset: str, steps: int) -> list[dict]:
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        hf = make_model(Path(tmp) / "hf", arch, preset)
        for qtype in ("F16", "Q8_0", "Q4_K"):
            (path,) = write_gguf(hf, Path(tmp) / f"m-{qtype}.gguf", qtype)
            ms, resident = _decode_ms(path, steps)
            out.append({"arch": arch, "preset": preset, "type": qtype, "decode_ms": ms, "resident_mb": resident / 1e6,
                        "file_mb": path.stat().st_size / 1e6})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--decode", type=int, default=16)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    deq = bench_dequant(args.rows, args.cols, args.repeats)
    print(f"dequantize {args.rows}x{args.cols}, {args.threads} thread(s), best of {args.repeats}")
    print(f"{'type':6} {'ours ms':>9} {'gguf-py ms':>11} {'ours GB/s out':>14} {'gguf-py GB/s':>13} {'speedup':>8}")
    for r in deq:
        print(f"{r['type']:6} {r['ours_ms']:9.1f} {r['gguf_py_ms']:11.1f} {r['ours_out_gbps']:14.2f} "
              f"{r['gguf_py_out_gbps']:13.2f} {r['speedup']:7.2f}x")
    dec = bench_decode(args.arch, args.preset, args.decode)
    print(f"\ndecode {args.arch}/{args.preset}, one stage, median of {args.decode} steps")
    print(f"{'type':6} {'ms/token':>9} {'resident MB':>12} {'file MB':>8}")
    for r in dec:
        print(f"{r['type']:6} {r['decode_ms']:9.2f} {r['resident_mb']:12.1f} {r['file_mb']:8.1f}")
    RESULTS.mkdir(exist_ok=True)
    result = {
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": args.threads,
                    "THP_MEM_ALLOC_ENABLE": os.environ.get("THP_MEM_ALLOC_ENABLE", ""),
                    "torch": torch.__version__, "gguf": getattr(gguf, "__version__", "0.19")},
        "dequantize": deq,
        "decode": dec,
    }
    (RESULTS / "gguf.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'gguf.json'}")


if __name__ == "__main__":
    main()
