"""Decode ms/token and resident memory of a GGUF stage: fused kernels (repacked at load) vs dequantize-per-use.

    python benchmarks/gguf_fused.py [--arch llama] [--preset small] [--types F16,Q8_0,Q4_K] [--rounds 3] [--steps 16]
                                    [--cpu 0] [--dir DIR]

Every measurement runs in a fresh process pinned to one core (``taskset -c CPU``, one torch thread) and the two paths
alternate (A/B, B/A, ...), so that load on a shared machine hits both alike; the table gives the median over rounds.
"RSS" is the process's VmRSS after loading minus VmRSS just before (after imports and opening the file), "data" the
same for anonymous memory and mapped files only (no shared-library code pages), "after steps" VmRSS after the decode
steps minus the same baseline; "file MB" is the bytes of the stage's own tensors in the file. Writes
benchmarks/results/gguf_fused.json (gguf_fused_files.json with --files, gguf_kernels.json with --kernels).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _data_rss_kb() -> int:
    """Resident kB of the process's data: anonymous memory (heap, torch's tensors) and mapped GGUF files, leaving
    out shared-library code pages (torch pulls in a few MB of kernel code the first time it runs a kernel)."""
    total, keep = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if head and "-" in head[0] and ":" not in head[0]:
            name = head[5] if len(head) > 5 else ""
            keep = not name.endswith(".so") and ".so." not in name
        elif keep and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def child(path: str, fused: bool, steps: int) -> dict:
    import torch

    from sangama_p2p.model.gguf.config import spec_from_gguf
    from sangama_p2p.model.gguf.reader import GGUFFile
    from sangama_p2p.model.gguf.source import GGUFSource
    from sangama_p2p.model.stage import StageModel, StepInput

    torch.set_num_threads(1)
    f = GGUFFile(path)  # no tokenizer needed (and files whose pre-tokenizer we do not read yet still open)
    spec = spec_from_gguf(f)
    src = GGUFSource(f, spec)
    before, data_before = _rss_kb(), _data_rss_kb()
    t0 = time.perf_counter()
    stage = StageModel.load(spec, src, 0, spec.num_layers, fused=fused)
    load_s = time.perf_counter() - t0
    after, data_after = _rss_kb(), _data_rss_kb()
    file_bytes = sum(src.nbytes_in_file(n) for n in set(stage.loaded_names))
    prompt = torch.arange(1, 9)
    state = stage.new_session(len(prompt) + steps + 1)
    tok = stage.logits(stage.forward([StepInput(state, 0, tokens=prompt)])[-1:]).argmax(-1)
    times, layers, head = [], [], []
    for i in range(steps):
        t0 = time.perf_counter()
        h = stage.forward([StepInput(state, len(prompt) + i, tokens=tok)])
        t1 = time.perf_counter()
        tok = stage.logits(h).argmax(-1)
        t2 = time.perf_counter()
        times.append(t2 - t0)
        layers.append(t1 - t0)
        head.append(t2 - t1)
    return {"decode_ms": statistics.median(times) * 1e3, "layers_ms": statistics.median(layers) * 1e3,
            "head_ms": statistics.median(head) * 1e3, "load_s": load_s, "rss_mb": (after - before) / 1024,
            "data_rss_mb": (data_after - data_before) / 1024, "rss_after_steps_mb": (_rss_kb() - before) / 1024,
            "file_mb": file_bytes / 2**20}


def _best_ms(fn, repeats: int = 30) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e3


def bench_kernels(shapes: list[tuple[int, int]]) -> list[dict]:
    """One-row products (decode) of each layout a weight type could take: ms per product and bytes held per weight.
    Blocks are our quantizer's (Q4_K, Q6_K) or gguf-py's (Q8_0, Q5_0, Q4_0) of Gaussian weights."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from sangama_p2p.model.gguf.packed import repack
    from sangama_p2p.model.gguf.quantizer import quantize
    from sangama_p2p.model.gguf.quants import QType, QuantTensor, type_name

    torch.set_num_threads(1)
    rows = []
    rng = np.random.default_rng(0)
    for n, k in shapes:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.02
        x = torch.randn(1, k)
        dense = torch.from_numpy(w)
        layouts = {
            "fp32 copy": (lambda: F.linear(x, dense), 4.0),
            "bf16 copy": ((lambda wb=dense.bfloat16(): F.linear(x.bfloat16(), wb).float()), 2.0),
            "fp16 (x in fp16)": ((lambda wh=dense.half(): F.linear(x.half(), wh).float()), 2.0),
            "fp16 upcast per use": ((lambda wh=dense.half(): F.linear(x, wh.float())), 2.0),
            "int8 per-row scale": ((lambda w8=torch.randint(-127, 127, (n, k), dtype=torch.int8),
                                    sc=torch.rand(n).bfloat16(): torch.ops.aten._weight_int8pack_mm(
                                        x.bfloat16(), w8, sc).float()), 1.0 + 2 / k),
        }
        for name, (fn, per) in layouts.items():
            rows.append({"shape": f"{n}x{k}", "type": "-", "layout": name, "ms": _best_ms(fn), "bytes_per_weight": per})
        for qtype in (QType.Q4_0, QType.Q4_K, QType.Q5_0, QType.Q8_0, QType.Q6_K):
            if k % (256 if qtype in (QType.Q4_K, QType.Q6_K) else 32):
                continue
            qt = QuantTensor(qtype, torch.from_numpy(quantize(w, qtype)), k)
            fused = repack(qt, torch.float32)
            per_use = _best_ms(lambda: F.linear(x, qt.dequantize(torch.float32)), repeats=3)
            rows.append({"shape": f"{n}x{k}", "type": type_name(qtype), "layout": "dequantize per use",
                         "ms": per_use, "bytes_per_weight": qt.nbytes / (n * k)})
            rows.append({"shape": f"{n}x{k}", "type": type_name(qtype), "layout": getattr(fused, "type_name", "bf16"),
                         "ms": _best_ms(lambda: fused.linear(x)), "bytes_per_weight": fused.nbytes / (n * k)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="llama")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--types", default="F16,Q8_0,Q4_K")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--cpu", default="0")
    ap.add_argument("--dir", type=Path, default=None, help="reuse (or make) the checkpoint and GGUFs here")
    ap.add_argument("--files", nargs="+", type=Path, default=None, help="measure these GGUF files instead")
    ap.add_argument("--kernels", action="store_true", help="only time one-row products of each layout")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "FUSED", "STEPS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1] == "1", int(args.child[2]))))
        return

    if args.kernels:
        krows = bench_kernels([(2048, 2048), (1536, 576), (49152, 576)])
        print("one-row products, 1 thread (best of 5 x 30)")
        print(f"{'shape':10} {'type':5} {'layout':22} {'ms':>8} {'bytes/weight':>12}")
        for r in krows:
            print(f"{r['shape']:10} {r['type']:5} {r['layout']:22} {r['ms']:8.3f} {r['bytes_per_weight']:12.3f}")
        RESULTS.mkdir(exist_ok=True)
        (RESULTS / "gguf_kernels.json").write_text(json.dumps(krows, indent=2) + "\n")
        return

    from sangama_p2p.model.gguf import write_gguf
    from sangama_p2p.model.make import make_model

    tmp = None
    paths = {}
    if args.files:
        paths = {p.stem: p for p in args.files}
    else:
        root = args.dir
        if root is None:
            tmp = tempfile.TemporaryDirectory()
            root = Path(tmp.name)
        hf = root / f"{args.arch}-{args.preset}"
        if not (hf / "config.json").is_file():
            make_model(hf, args.arch, args.preset)
        for t in args.types.split(","):
            p = root / f"{args.arch}-{args.preset}-{t}.gguf"
            if not p.is_file():
                write_gguf(hf, p, t)
            paths[t] = p
    runs: dict[tuple[str, bool], list[dict]] = {}
    for r in range(args.rounds):
        for t, p in paths.items():
            for fused in ((False, True) if r % 2 == 0 else (True, False)):
                cmd = ["taskset", "-c", args.cpu, sys.executable, __file__, "--child", str(p), str(int(fused)),
                       str(args.steps)]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
                runs.setdefault((t, fused), []).append(json.loads(out.strip().splitlines()[-1]))
    rows = []
    for (t, fused), rs in runs.items():
        row = {"type": t, "path": "fused" if fused else "dequantize per use"}
        for key in rs[0]:
            row[key] = statistics.median(x[key] for x in rs)
        row["rss_over_file"] = row["rss_mb"] / row["file_mb"]
        row["data_rss_over_file"] = row["data_rss_mb"] / row["file_mb"]
        rows.append(row)
    rows.sort(key=lambda r: (list(paths).index(r["type"]), r["path"] == "fused"))
    what = "files" if args.files else f"{args.arch}/{args.preset}"
    print(f"decode {what}, one stage, 1 thread on cpu {args.cpu}, median of {args.rounds} rounds "
          f"x {args.steps} steps")
    w = max(6, *(len(t) for t in paths))
    print(f"{'type':{w}} {'path':20} {'ms/token':>9} {'layers':>7} {'head':>6} {'file MB':>8} {'RSS MB':>7} "
          f"{'/file':>6}"
          f" {'data MB':>8} {'/file':>6} {'after steps':>11} {'load s':>7}")
    for r in rows:
        print(f"{r['type']:{w}} {r['path']:20} {r['decode_ms']:9.2f} {r['layers_ms']:7.2f} {r['head_ms']:6.2f} "
              f"{r['file_mb']:8.1f} {r['rss_mb']:7.1f} {r['rss_over_file']:6.2f} {r['data_rss_mb']:8.1f} "
              f"{r['data_rss_over_file']:6.2f} {r['rss_after_steps_mb']:11.1f} {r['load_s']:7.2f}")
    RESULTS.mkdir(exist_ok=True)
    name = "gguf_fused_files.json" if args.files else "gguf_fused.json"
    what = {"files": [str(p) for p in paths.values()]} if args.files else {"arch": args.arch, "preset": args.preset}
    (RESULTS / name).write_text(json.dumps({**what, "rows": rows}, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
