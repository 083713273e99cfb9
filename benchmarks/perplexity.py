"""Our perplexity against llama.cpp's `llama-perplexity`, on the same text, files, context and chunks.

    python benchmarks/perplexity.py [--llama-cpp DIR] [--text FILE] [--ctx 256] [--chunks K] [--threads 1]
                                    [--files LABEL=PATH ...]

The text: src/sangama_p2p/model/corpus.txt by default (the package's own short stories, 9,262 bytes: 2,514 SmolLM2
tokens, 9 chunks of 256), in the repository and fixed, so the figures can be made again; both programs read the file
itself (each drops one trailing newline, as `-f` does). Files: the SmolLM2-135M-
Instruct set of vs_llamacpp.py (F16, Q8_0, Q4_K_M, Q4_1). llama.cpp: built as vs_llamacpp.py builds it, with the
`llama-perplexity` and `llama-tokenize` targets.

Per file: ours (`sangama-peer perplexity FILE -f TEXT --ctx N --chunks K --json`, a fresh process), then
`llama-perplexity -m FILE -f TEXT -c N --chunks K -t T` (its `[i]x` running figures and `Final estimate`), and the
text's ids from `llama-tokenize --ids --no-parse-special --no-escape` against ours (the first difference, if any:
a tokenization difference would move the figures for reasons other than numerics). Prints a table and writes
benchmarks/results/perplexity.json. ``--ours-only J`` runs our side alone into J (while llama.cpp builds, say) and
``--ours-from J`` takes it from there.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from vs_llamacpp import RESULTS, default_files, find_or_build_llama_cpp  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "src" / "sangama_p2p" / "model" / "corpus.txt"
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")
_CHUNK = re.compile(r"\[(\d+)\]([0-9.]+),")


def ours(path: Path, text: Path, ctx: int, chunks: int | None, threads: int) -> dict:
    cmd = [sys.executable, "-m", "sangama_p2p.cli.main", "perplexity", str(path), "--text-file", str(text),
           "--ctx", str(ctx), "--threads", str(threads), "--json"] + (["--chunks", str(chunks)] if chunks else [])
    return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)


def llama_perplexity(bin_dir: Path, path: Path, text: Path, ctx: int, chunks: int | None, threads: int) -> dict:
    cmd = [str(bin_dir / "llama-perplexity"), "-m", str(path), "-f", str(text), "-c", str(ctx),
           "-t", str(threads)] + (["--chunks", str(chunks)] if chunks else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    final = _FINAL.search(out)
    if proc.returncode != 0 or final is None:
        raise RuntimeError(f"llama-perplexity failed ({proc.returncode}): {out[-2000:]}")
    return {"ppl": float(final.group(1)), "ppl_error": float(final.group(2)),
            "chunk_ppl": [float(v) for _, v in _CHUNK.findall(out)], "seconds": round(time.perf_counter() - t0, 1)}


def llama_ids(bin_dir: Path, path: Path, text: str) -> list[int]:
    """``text``'s ids from llama-tokenize: it reads a file verbatim (no newline dropped) and, unless told
    ``--no-escape``, turns ``\\"`` and the like into the characters (llama-perplexity does neither: it sets
    ``params.escape = false``), so it is given exactly the text llama-perplexity tokenizes, unescaped."""
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as f:
        f.write(text.encode())
        f.flush()
        cmd = [str(bin_dir / "llama-tokenize"), "-m", str(path), "-f", f.name, "--ids",
               "--no-parse-special", "--no-escape", "--log-disable"]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return list(ast.literal_eval(out.strip().splitlines()[-1]))


def our_ids(path: Path, text: str) -> list[int]:
    from sangama_p2p.cli.perplexity_cmds import encode_like_llamacpp
    from sangama_p2p.model.checkpoint import open_checkpoint

    return encode_like_llamacpp(open_checkpoint(path).tokenizer, text)[0]


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", default=None)
    ap.add_argument("--text", default=str(CORPUS))
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--files", nargs="*", default=None, metavar="LABEL=PATH")
    ap.add_argument("--ours-only", metavar="JSON", default=None,
                    help="run only our side and write its figures to JSON (e.g. while llama.cpp builds)")
    ap.add_argument("--ours-from", metavar="JSON", default=None,
                    help="take our figures from what --ours-only wrote (same text, ctx, chunks, threads, files)")
    args = ap.parse_args()
    from sangama_p2p.model.perplexity import read_text

    files = {k: Path(v) for k, v in (dict(f.split("=", 1) for f in args.files) if args.files
                                     else default_files()).items()}
    text_file = Path(args.text)
    text = read_text(text_file.read_bytes())
    settings = {"text": str(text_file.resolve()), "ctx": args.ctx, "chunks": args.chunks, "threads": args.threads,
                "files": {k: str(v) for k, v in files.items()}}
    if args.ours_from:
        saved = json.loads(Path(args.ours_from).read_text())
        if saved["settings"] != settings:
            raise SystemExit(f"{args.ours_from} was made with other settings: {saved['settings']}")
        mine_all = saved["ours"]
    else:
        mine_all = {}
        for label, path in files.items():
            mine_all[label] = ours(path, text_file, args.ctx, args.chunks, args.threads)
            print(f"{label}: ours {mine_all[label]['ppl']:.4f}", file=sys.stderr, flush=True)
    if args.ours_only:
        Path(args.ours_only).write_text(json.dumps({"settings": settings, "ours": mine_all}, indent=1) + "\n")
        return
    bin_dir = find_or_build_llama_cpp(args.llama_cpp, ("llama-perplexity", "llama-tokenize"))
    rows = []
    for label, path in files.items():
        mine = mine_all[label]
        theirs = llama_perplexity(bin_dir, path, text_file, args.ctx, args.chunks, args.threads)
        a, b = our_ids(path, text), llama_ids(bin_dir, path, text)
        diff = first_difference(a, b)
        rows.append({"file": label, "ours": round(mine["ppl"], 4), "llama_cpp": theirs["ppl"],
                     "rel_diff": round(mine["ppl"] / theirs["ppl"] - 1, 5),
                     "ours_error": round(mine["ppl_error"], 4), "llama_cpp_error": theirs["ppl_error"],
                     "ours_chunks": [round(v, 4) for v in mine["chunk_ppl"]], "llama_cpp_chunks": theirs["chunk_ppl"],
                     "chunks": mine["chunks"], "scored_tokens": mine["scored_tokens"], "tokens": mine["tokens"],
                     "llama_cpp_tokens": len(b), "first_token_difference": diff,
                     "ours_seconds": mine["seconds"], "llama_cpp_seconds": theirs["seconds"]})
        print(f"{label}: ours {mine['ppl']:.4f}, llama.cpp {theirs['ppl']:.4f}", file=sys.stderr, flush=True)
    print(f"\nperplexity of {Path(args.text).name} ({rows[0]['tokens']} tokens), ctx {args.ctx}, "
          f"{rows[0]['chunks']} chunks ({rows[0]['scored_tokens']} tokens scored)")
    print(f"{'file':<16} {'ours':>9} {'llama.cpp':>10} {'rel. diff':>10} {'ids equal':>10}")
    for r in rows:
        same = "yes" if r["first_token_difference"] is None else f"no @{r['first_token_difference']}"
        print(f"{r['file']:<16} {r['ours']:>9.4f} {r['llama_cpp']:>10.4f} {100 * r['rel_diff']:>9.2f}% {same:>10}")
    RESULTS.mkdir(exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg(),
           "text": os.path.relpath(args.text, Path(__file__).resolve().parents[1]), "ctx": args.ctx,
           "chunks": args.chunks, "threads": args.threads, "llama_cpp": str(bin_dir), "rows": rows}
    (RESULTS / "perplexity.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
