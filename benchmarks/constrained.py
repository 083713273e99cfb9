"""What holding output to a JSON schema costs the last stage: per-token mask time of llguidance (the dependency)
against xgrammar (when installed), and a constrained greedy decode against a free one on SmolLM2-135M-Instruct.

    python benchmarks/constrained.py [--model FILE.gguf] [--reps 5] [--tokens 48]

Engines: both are given SmolLM2's tokenizer (49,152 tokens) and the schema below, then walk the same valid reply
token by token: each step computes the next-token bitmask and consumes the token. xgrammar is optional (it is not
a dependency: it pulls triton); to measure it, ``pip install --no-deps xgrammar apache-tvm-ffi``. Engines alternate
within each repetition (A, B, A, B...) on this noisy machine; the table gives medians.

Decode: one stage of all 30 layers, greedy, the chat prompt below, ``--tokens`` new tokens (or to the end of the
object), alternately free and held to the schema (``Decoder(constraint=...)``); ms per token for each and the ratio.
Prints a table and writes benchmarks/results/constrained.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"enum": ["Paris", "London", "Rome", "Berlin"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
REPLY = '{"name":"Ann Marie","age":31,"city":"Paris","tags":["teacher","runner","reader"]}'
PROMPT = "Describe Ann Marie, 31, a teacher from Paris who runs and reads, as a JSON object."


def _llguidance(tok, spec):
    from sangama_p2p.model.constraint import GrammarTokenizer, TokenConstraint, json_grammar

    t0 = time.perf_counter()
    gt = GrammarTokenizer(tok.backend.to_str(), spec.vocab_size, spec.eos_token_ids)
    tokenizer_s = time.perf_counter() - t0

    def walk(ids):
        t0 = time.perf_counter()
        c = TokenConstraint(gt, json_grammar(SCHEMA), 0)
        compile_s = time.perf_counter() - t0
        masks = []
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            allowed = c.allowed(spec.vocab_size)
            masks.append(time.perf_counter() - t0)
            assert allowed[t], (i, t)
            c.follow(i, [t])
        return compile_s, masks

    return tokenizer_s, walk


def _xgrammar(tok, spec):
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    t0 = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=spec.vocab_size, stop_token_ids=list(spec.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tokenizer_s = time.perf_counter() - t0
    shifts = torch.arange(32, dtype=torch.int32)

    def walk(ids):
        t0 = time.perf_counter()
        matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                       separators=(",", ":")))
        compile_s = time.perf_counter() - t0
        bitmask = xgr.allocate_token_bitmask(1, spec.vocab_size)
        masks = []
        for i, t in enumerate(ids):
            t0 = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            allowed = ((bitmask[0].unsqueeze(-1) >> shifts) & 1).flatten().bool()[: spec.vocab_size]
            masks.append(time.perf_counter() - t0)
            assert allowed[t], (i, t)
            assert matcher.accept_token(t)
        return compile_s, masks

    return tokenizer_s, walk


def _decode(stage, ids, new, constraint_of):
    from sangama_p2p.model.decode import Decoder, LastStep, finish_steps
    from sangama_p2p.model.sampling import SamplingParams
    from sangama_p2p.model.speculative import GuessPolicy
    from sangama_p2p.model.stage import StepInput

    state = stage.new_session(len(ids) + new + 1)
    dec = Decoder(state, SamplingParams(), GuessPolicy(0), constraint=constraint_of(len(ids)))
    start, step, out, times = 0, list(ids), [], []
    for _ in range(new):
        t0 = time.perf_counter()
        x = stage.forward([StepInput(state, start, tokens=torch.tensor(step))])
        (res,) = finish_steps(stage, [LastStep(dec, start, step, 0)], x)
        if start:
            times.append(time.perf_counter() - t0)  # decode steps only (not the prefill)
        out.extend(res.tokens)
        if res.tokens[-1] in stage.spec.eos_token_ids:
            break
        start, step = start + len(step), [res.tokens[-1]]
    return out, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path.home() / ".cache/sangama-test/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from sangama_p2p.model.chat import load_chat_template, render_chat
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.constraint import GrammarTokenizer, TokenConstraint, json_grammar
    from sangama_p2p.model.stage import StageModel

    ck = open_checkpoint(args.model)
    tok, spec = ck.tokenizer, ck.spec
    reply = tok.encode(REPLY)
    engines = {"llguidance": _llguidance(tok, spec)}
    xg = _xgrammar(tok, spec)
    if xg is not None:
        engines["xgrammar"] = xg
    else:
        print("xgrammar is not installed: only llguidance is measured", file=sys.stderr)
    runs: dict[str, dict[str, list[float]]] = {name: {"compile": [], "mask": []} for name in engines}
    for _ in range(args.reps):
        for name, (_, walk) in engines.items():
            compile_s, masks = walk(reply)
            runs[name]["compile"].append(compile_s)
            runs[name]["mask"].extend(masks)

    stage = StageModel.load(spec, ck.source, 0, spec.num_layers)
    ids = list(render_chat(load_chat_template(ck.path), tok, [{"role": "user", "content": PROMPT}]).ids)
    gt = GrammarTokenizer(tok.backend.to_str(), spec.vocab_size, spec.eos_token_ids)
    grammar = json_grammar(SCHEMA)
    free_ms, held_ms, held_out = [], [], []
    for _ in range(args.reps):
        _, t = _decode(stage, ids, args.tokens, lambda n: None)
        free_ms.extend(x * 1e3 for x in t)
        held_out, t = _decode(stage, ids, args.tokens, lambda n: TokenConstraint(gt, grammar, n))
        held_ms.extend(x * 1e3 for x in t)
    text = tok.decode([t for t in held_out if t not in spec.eos_token_ids])

    result = {"model": args.model.name, "vocab": spec.vocab_size, "reply_tokens": len(reply), "reps": args.reps,
              "threads": args.threads, "engines": {}, "decode": {
                  "free_ms_per_token": statistics.median(free_ms), "held_ms_per_token": statistics.median(held_ms),
                  "ratio": statistics.median(held_ms) / statistics.median(free_ms), "held_reply": text,
                  "held_reply_valid_json": _valid(text)}}
    print(f"{'engine':<12} {'tokenizer s':>12} {'compile ms':>11} {'mask ms p50':>12} {'mask ms p90':>12} {'max':>8}")
    for name, (tokenizer_s, _) in engines.items():
        masks = sorted(m * 1e3 for m in runs[name]["mask"])
        row = {"tokenizer_s": tokenizer_s, "compile_ms": statistics.median(runs[name]["compile"]) * 1e3,
               "mask_ms_p50": statistics.median(masks), "mask_ms_p90": masks[int(0.9 * (len(masks) - 1))],
               "mask_ms_max": masks[-1]}
        result["engines"][name] = row
        print(f"{name:<12} {tokenizer_s:>12.2f} {row['compile_ms']:>11.2f} {row['mask_ms_p50']:>12.3f} "
              f"{row['mask_ms_p90']:>12.3f} {row['mask_ms_max']:>8.2f}")
    d = result["decode"]
    print(f"\ndecode, greedy, 1 stage: free {d['free_ms_per_token']:.2f} ms/token, held to the schema "
          f"{d['held_ms_per_token']:.2f} ms/token ({d['ratio']:.2f}x); reply {text!r}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "constrained.json").write_text(json.dumps(result, indent=2) + "\n")


def _valid(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


if __name__ == "__main__":
    main()
