"""Load time and memory of a whole-model stage of each real SmolLM2 file: the default kernels, ggml's on the file's
blocks for every type, torch's int4 ones on a repacking (``SANGAMA_KERNELS=ggml`` / ``torch``), dequantized per use.

    python benchmarks/real_load.py [--rounds 2] [--files LABEL=PATH ...]

Files: ${SANGAMA_TEST_MODELS:-~/.cache/sangama-test}/SmolLM2-135M-Instruct.{Q4_1,F16,Q8_0,Q4_K_M}.gguf (Q4_1 from
`.ci/fetch-models`; the others are made by `requantize_gguf`, as tests/real does). Each measurement is a fresh process
(`tests/real/rss_probe.py`): open (header, tensor index; no tokenizer) and `StageModel.load`, then the memory the stage
holds (anonymous + the GGUF mapping's resident pages, minus the same before the load) after the load and after a
prefill + one decode step, against the stage's tensors' bytes in the file. Medians over rounds, the two paths
alternating. Prints a table and writes benchmarks/results/real_load.json (real_load-files.json for ``--files``, e.g.
``moe-Q4_K_M=~/.cache/sangama-bench/qwen35moe-small/model-Q4_K_M.gguf``, a made Qwen3.5-MoE re-quantized with
``sangama-peer requantize ... Q4_K_M``, whose rows are whole 256-blocks, unlike SmolLM2's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROBE = Path(__file__).parent.parent / "tests" / "real" / "rss_probe.py"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--files", nargs="*", metavar="LABEL=PATH", help="these files instead of the SmolLM2 set")
    args = ap.parse_args()
    cache = Path(os.environ.get("SANGAMA_TEST_MODELS") or Path.home() / ".cache" / "sangama-test")
    if args.files:
        files = {a.split("=", 1)[0]: Path(a.split("=", 1)[1]).expanduser() for a in args.files}
    else:
        files = {label: cache / f"SmolLM2-135M-Instruct.{label}.gguf" for label in ("Q4_1", "F16", "Q8_0", "Q4_K_M")}
    files = {k: v for k, v in files.items() if v.exists()}
    # (path, fused, SANGAMA_KERNELS): the default (ggml for all but Q4_0/Q4_1), ggml for every type, torch's int4
    # repacking for every type, dequantized per use
    paths = [("auto", True, "auto"), ("ggml", True, "ggml"), ("int4", True, "torch"), ("per use", False, "torch")]
    runs: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for label, path in files.items():
            for name, fused, kernels in paths:
                out = subprocess.run([sys.executable, str(PROBE), str(path), "1" if fused else "0"], check=True,
                                     capture_output=True, text=True,
                                     env=dict(os.environ, OMP_NUM_THREADS="1", SANGAMA_KERNELS=kernels))
                runs.setdefault((label, name), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for (label, name), got in runs.items():
        in_file = got[0]["in_file"]
        rows.append({"file": label, "path": name, "file_mib": round(
            files[label].stat().st_size / 2**20, 1), "stage_tensors_mib": round(in_file / 2**20, 1),
            "open_s": statistics.median(g["open_s"] for g in got), "load_s": statistics.median(g["load_s"] for g in got),
            "held_after_load_x": round(statistics.median(g["after_load"] for g in got) / in_file, 3),
            "held_after_steps_x": round(statistics.median(g["after_steps"] for g in got) / in_file, 3)})
    w = max(8, *(len(k) for k in files))
    print(f"{'file':<{w}} {'path':<8} {'file MiB':>8} {'open s':>7} {'load s':>7} {'held/file after load':>21} "
          f"{'after steps':>12}")
    for r in rows:
        print(f"{r['file']:<{w}} {r['path']:<8} {r['file_mib']:>8.1f} {r['open_s']:>7.3f} {r['load_s']:>7.3f} "
              f"{r['held_after_load_x']:>21.2f} {r['held_after_steps_x']:>12.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / ("real_load-files.json" if args.files else "real_load.json")).write_text(json.dumps(
        {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg(),
         "rounds": args.rounds, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
