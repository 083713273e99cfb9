"""Dump llama.cpp's own greedy tokens and logits on real GGUF files, as compact test data.

Not run by the tests: it needs a CPU build of llama.cpp (see docs/benchmarks.md, "llama.cpp for references") and the
small client ``simple_ids`` built from the team's shared tool ``simple_ids.cpp`` (llama.cpp's examples/simple with
the ids printed and ``DUMP_LOGITS``). For each file and prompt it records the prompt's token ids as llama.cpp
tokenizes them (``llama_tokenize(add_special=true, parse_special=true)``), llama.cpp's own free-running greedy
continuation (``IGNORE_EOS=1``), and for every generated position the top-k logits (descending; ties by id) plus the
logsumexp over the vocabulary. Row j holds the next-token logits after ``prompt + gen[:j]``, so a runtime fed
``prompt + gen`` in one prefill is compared teacher-forced on llama.cpp's own sequence.

    python tests/real/make_llamacpp_refs.py --simple-ids /path/to/simple_ids --out tests/real/data/smollm2.llamacpp.json \
        Q4_1=~/.cache/sangama-test/SmolLM2-135M-Instruct.Q4_1.gguf F16=... Q8_0=... Q4_K_M=...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import numpy as np

PROMPTS = [
    "The capital of France is",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWrite a Python function that reverses a string.<|im_end|>\n<|im_start|>assistant\n",
    "Q: If I have 12 apples and buy  35 more, how many do I have?\nA:",
]
N_GEN = 32
TOP_K = 16


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_one(simple_ids: str, model: Path, prompt: str, threads_env: dict) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        dump = Path(tmp) / "logits.bin"
        env = dict(os.environ, IGNORE_EOS="1", DUMP_LOGITS=str(dump), **threads_env)
        out = subprocess.run([simple_ids, "-m", str(model), "-n", str(N_GEN), prompt], env=env,
                             capture_output=True, text=True, check=True)
        lines = {ln.split(":", 1)[0]: ln.split(":", 1)[1] for ln in out.stderr.splitlines()
                 if ln.startswith(("PROMPT_IDS:", "GEN_IDS:"))}
        prompt_ids = [int(t) for t in lines["PROMPT_IDS"].split()]
        gen_ids = [int(t) for t in lines["GEN_IDS"].split()]
        logits = np.fromfile(dump, dtype=np.float32).reshape(len(gen_ids), -1).astype(np.float64)
    rows = []
    for row in logits:
        order = np.lexsort((np.arange(row.size), -row))[:TOP_K]
        m = row.max()
        rows.append({"top_ids": order.tolist(), "top_logits": [round(float(v), 5) for v in row[order]],
                     "logsumexp": round(float(m + np.log(np.exp(row - m).sum())), 5)})
    return {"prompt": prompt, "prompt_ids": prompt_ids, "gen_ids": gen_ids, "positions": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simple-ids", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--llama-cpp-commit", default="0c1e57098bba43ac29e6e3b677cdceebdd22334f")
    ap.add_argument("files", nargs="+", help="LABEL=PATH")
    args = ap.parse_args()
    out = {"llama_cpp_commit": args.llama_cpp_commit, "n_gen": N_GEN, "top_k": TOP_K,
           "settings": "simple_ids: n_threads 2, n_batch = prompt length, greedy sampler, IGNORE_EOS=1", "files": {}}
    for item in args.files:
        label, path = item.split("=", 1)
        path = Path(path).expanduser()
        out["files"][label] = {"name": path.name, "sha256": sha256(path),
                               "runs": [run_one(args.simple_ids, path, p, {}) for p in PROMPTS]}
        print(label, path.name, [r["gen_ids"][:8] for r in out["files"][label]["runs"]])
    Path(args.out).write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
