"""ggml's kernels (repacked where ggml repacks the type, and as stored) against torch's int4 kernels per GGUF type:
products of weights streamed from memory (as a decode step reads them) and of one weight repeated (in the cache), one
row and many.

    python benchmarks/kernels_streamed.py [--types Q4_0,Q4_1,Q4_K,Q5_0,Q6_K,Q8_0] [--rounds 3] [--threads 1]

Streamed: 30 "layers" of SmolLM2's four layer products (960x576, 576x576, 3072x576, 576x1536; for the K-quants, whose
rows are 256-blocks, 1024 and 1536 wide), each weight once per pass, the two kernels' passes alternating; "hot": the
third product repeated. Blocks come from ggml's own
quantizer. Prints ms per pass (medians over rounds) and writes benchmarks/results/kernels_streamed.json.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from sangama_p2p.model.gguf.ggml_kernels import KERNELS_ENV, binding, ggml_weight
from sangama_p2p.model.gguf.ggml_repack import REPACK_ENV
from sangama_p2p.model.gguf.packed import pack_int4
from sangama_p2p.model.gguf.quants import QType, QuantTensor

RESULTS = Path(__file__).parent / "results"
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
SHAPES_K = [(1024, 1024), (512, 1024), (3072, 1024), (1024, 1536)]  # rows of whole 256-blocks (K-quants)


def blocks(lib, qtype: int, n: int, k: int, rng: np.random.Generator) -> QuantTensor:
    src = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    dst = np.zeros((n, lib.ggml_row_size(qtype, k)), dtype=np.uint8)
    lib.ggml_quantize_chunk(qtype, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), dst.ctypes.data, 0, n, k,
                            None)
    return QuantTensor(qtype, torch.from_numpy(dst), k)


def timed(fn, repeats: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - t0) / repeats * 1e3


def ggml_weights(layers: list[list[QuantTensor]], repack: bool) -> list[list[Any]]:
    """ggml's weights of every type (``SANGAMA_KERNELS=ggml``), repacked where ggml repacks the type or as stored."""
    saved = {k: os.environ.get(k) for k in (KERNELS_ENV, REPACK_ENV)}
    os.environ.update({KERNELS_ENV: "ggml", REPACK_ENV: "1" if repack else "0"})
    try:
        ws = [[ggml_weight(w) for w in layer] for layer in layers]
        for layer in ws:
            for w in layer:
                w.settle()
        return ws
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", default="Q4_0,Q4_1,Q4_K,Q5_0,Q6_K,Q8_0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    lib = binding()
    if lib is None:
        raise SystemExit("ggml-python is not available (SANGAMA_KERNELS=torch?)")
    rng = np.random.default_rng(0)
    rows = []
    for name in args.types.split(","):
        qtype = getattr(QType, name)
        shapes = SHAPES_K if name.endswith("_K") else SHAPES
        layers = [[blocks(lib, qtype, n, k, rng) for n, k in shapes] for _ in range(30)]
        kinds = {"ggml": ggml_weights(layers, repack=True), "ggml stored": ggml_weights(layers, repack=False),
                 "torch": [[pack_int4(w) for w in layer] for layer in layers]}
        xs = {(m, k): torch.randn(m, k) for m in (1, 512) for k in {k for _, k in shapes}}
        got: dict[tuple[str, str], list[float]] = {}
        for _ in range(args.rounds):
            for kind, ws in kinds.items():
                def stream(m: int, ws=ws) -> None:
                    for layer in ws:
                        for w in layer:
                            w.product(xs[(m, w.shape[1])])
                big = ws[0][2]
                got.setdefault((kind, "streamed 1 row"), []).append(timed(lambda: stream(1), 10))
                k = big.shape[1]
                got.setdefault((kind, "hot 1 row"), []).append(timed(lambda: big.product(xs[(1, k)]), 200))
                got.setdefault((kind, "hot 512 rows"), []).append(timed(lambda: big.product(xs[(512, k)]), 5))
        held = {kind: sum(w.nbytes for layer in ws for w in layer) for kind, ws in kinds.items()}
        in_file = sum(int(w.data.numel()) for layer in layers for w in layer)
        for what in ("streamed 1 row", "hot 1 row", "hot 512 rows"):
            g, t = statistics.median(got[("ggml", what)]), statistics.median(got[("torch", what)])
            st = statistics.median(got[("ggml stored", what)])
            rows.append({"type": name, "what": what, "ggml_ms": round(g, 4), "ggml_stored_ms": round(st, 4),
                         "torch_ms": round(t, 4), "torch_over_ggml": round(t / g, 3),
                         "stored_over_repacked": round(st / g, 3),
                         "held_over_file_ggml": round(held["ggml"] / in_file, 3),
                         "held_over_file_torch": round(held["torch"] / in_file, 3)})
        del kinds, layers
    print(f"{'type':<6} {'products':<15} {'ggml ms':>9} {'stored':>9} {'torch ms':>9} {'torch/ggml':>10} "
          f"{'held/file ggml':>15} {'torch':>6}")
    for r in rows:
        print(f"{r['type']:<6} {r['what']:<15} {r['ggml_ms']:>9.3f} {r['ggml_stored_ms']:>9.3f} {r['torch_ms']:>9.3f} "
              f"{r['torch_over_ggml']:>10.2f} "
              f"{r['held_over_file_ggml']:>15.2f} {r['held_over_file_torch']:>6.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kernels_streamed.json").write_text(json.dumps(
        {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg(),
         "threads": args.threads, "rounds": args.rounds, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
