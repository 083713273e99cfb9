"""Decode ms/token and prefill tokens/s: our runtime vs transformers on the same checkpoint, process and threads.

    python benchmarks/runtime.py [--presets tiny,small] [--archs qwen3_5_moe,llama] [--threads 1] [--decode 32]

Prints a table and writes benchmarks/results/runtime.json. Goals: our decode step <= 0.5x transformers' time on
qwen3_5_moe and <= 1.0x on llama.
"""

from __future__ import annotations

import argparse
import json
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


def _ours(path: Path, prompt: torch.Tensor, decode: int, repeats: int) -> tuple[float, float]:
    ck = open_checkpoint(path)
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    prefill_s, step_s = [], []
    for _ in range(repeats):
        state = stage.new_session(len(prompt) + decode + 1)
        t0 = time.perf_counter()
        logits = stage.logits(stage.forward([StepInput(state, 0, tokens=prompt)])[-1:])
        prefill_s.append(time.perf_counter() - t0)
        tok = logits.argmax(-1)
        for i in range(decode):
            t0 = time.perf_counter()
            logits = stage.logits(stage.forward([StepInput(state, len(prompt) + i, tokens=tok)]))
            tok = logits.argmax(-1)
            step_s.append(time.perf_counter() - t0)
    return statistics.median(prefill_s), statistics.median(step_s)


def _transformers(path: Path, prompt: torch.Tensor, decode: int, repeats: int) -> tuple[float, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prefill_s, step_s = [], []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = model(prompt[None], use_cache=True, logits_to_keep=1)
            prefill_s.append(time.perf_counter() - t0)
            cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
            for _ in range(decode):
                t0 = time.perf_counter()
                out = model(tok, cache=cache, use_cache=True)
                cache, tok = out.cache, out.logits[:, -1:].argmax(-1)
                step_s.append(time.perf_counter() - t0)
    return statistics.median(prefill_s), statistics.median(step_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,small")
    ap.add_argument("--archs", default="qwen3_5_moe,llama")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=64, help="prefill length in tokens")
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            for preset in args.presets.split(","):
                path = make_model(Path(tmp) / f"{arch}-{preset}", arch, preset, seed=0)
                vocab = open_checkpoint(path).spec.vocab_size
                prompt = torch.randint(0, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0))
                ours = _ours(path, prompt, args.decode, args.repeats)
                ref = _transformers(path, prompt, args.decode, args.repeats)
                rows.append({
                    "arch": arch, "preset": preset,
                    "ours_decode_ms": ours[1] * 1e3, "hf_decode_ms": ref[1] * 1e3,
                    "decode_ratio": ours[1] / ref[1],
                    "ours_prefill_tps": args.prompt / ours[0], "hf_prefill_tps": args.prompt / ref[0],
                })
    print(f"{'arch':<12} {'preset':<6} {'ours ms/tok':>11} {'hf ms/tok':>10} {'ratio':>6} "
          f"{'ours prefill tok/s':>18} {'hf prefill tok/s':>16}")
    for r in rows:
        print(f"{r['arch']:<12} {r['preset']:<6} {r['ours_decode_ms']:>11.2f} {r['hf_decode_ms']:>10.2f} "
              f"{r['decode_ratio']:>6.2f} {r['ours_prefill_tps']:>18.0f} {r['hf_prefill_tps']:>16.0f}")
    RESULTS.mkdir(exist_ok=True)
    meta = {"threads": args.threads, "prompt": args.prompt, "decode": args.decode, "repeats": args.repeats,
            "torch": torch.__version__, "machine": platform.machine(), "cpus": torch.get_num_threads()}
    (RESULTS / "runtime.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {RESULTS / 'runtime.json'}")


if __name__ == "__main__":
    main()
