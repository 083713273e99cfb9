"""Our decode and prefill against llama.cpp's, on the same GGUF files with the same thread counts, alternating.

    python benchmarks/vs_llamacpp.py [--llama-cpp DIR] [--threads 1,2] [--rounds 3] [--files LABEL=PATH ...]

llama.cpp: DIR is a llama.cpp source tree with a CPU build in DIR/build/bin (or set LLAMA_CPP_DIR). Without one,
the script builds it from the `llama-cpp-python` sdist on PyPI, which vendors llama.cpp (~6 min on 2 cores) into
~/.cache/sangama-bench/. Files: by default the SmolLM2-135M-Instruct set in ${SANGAMA_TEST_MODELS:-~/.cache/
sangama-test} (Q4_1 as shipped; F16, Q8_0 and Q4_K_M re-quantized from it by our writer when present) and a made
Qwen3.5-MoE Q4_K_M.

Each round runs, per file and thread count, llama-bench then ours, each in a fresh process: decode tokens/s (64
tokens after a 4-token prompt; llama-bench `-p 0 -n 64`), prefill tokens/s (512 tokens; `-p 512 -n 0`) and the
process's peak RSS (ru_maxrss of the child). Ours is what `sangama-peer generate --local FILE --threads T` runs (one
stage holding every layer), the request made twice in the process and the second one timed, as llama-bench times
its runs after a warm-up.
Medians over the rounds; prints a table and writes benchmarks/results/vs_llamacpp.json. ``--cpu-time``: instead,
CPU milliseconds per decode token of both at one thread (256 minus 16 generated tokens, so start-up cancels; the
steadier figure on a shared machine), written to benchmarks/results/vs_llamacpp_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
SDIST = "llama-cpp-python==0.3.36"
CMAKE_FLAGS = ["-DGGML_NATIVE=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DCMAKE_BUILD_TYPE=Release"]


def run_measured(cmd: list[str], env: dict | None = None) -> tuple[str, float, float]:
    """(stdout, peak RSS in MiB, CPU seconds: user + system) of one child process."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {err.read().decode()[-2000:]}")
        return out.read().decode(), usage.ru_maxrss / 1024, usage.ru_utime + usage.ru_stime


def find_or_build_llama_cpp(given: str | None, targets: tuple[str, ...] = ("llama-bench",)) -> Path:
    """A llama.cpp tree whose build/bin holds ``targets`` (DIR, $LLAMA_CPP_DIR, or built from the sdist into
    ~/.cache/sangama-bench; a cached build that lacks a target builds just that one)."""
    def has(tree: Path) -> bool:
        return all((tree / "build" / "bin" / t).exists() for t in targets)

    for cand in (given, os.environ.get("LLAMA_CPP_DIR")):
        if cand and has(Path(cand)):
            return Path(cand)
    root = Path.home() / ".cache" / "sangama-bench"
    tree = root / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    if not has(tree):
        if not tree.exists():
            root.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", SDIST,
                            "-d", str(root)], check=True)
            with tarfile.open(next(root.glob("llama_cpp_python-*.tar.gz"))) as t:
                t.extractall(root, filter="data")
        if not (tree / "build" / "CMakeCache.txt").exists():
            subprocess.run(["cmake", "-B", "build", *CMAKE_FLAGS], cwd=tree, check=True)
        subprocess.run(["cmake", "--build", "build", f"-j{os.cpu_count()}", "--target", *targets], cwd=tree,
                       check=True)
    return tree


def default_files() -> dict[str, Path]:
    cache = Path(os.environ.get("SANGAMA_TEST_MODELS") or Path.home() / ".cache" / "sangama-test")
    files = {"SmolLM2 Q4_1": cache / "SmolLM2-135M-Instruct.Q4_1.gguf"}
    for label in ("F16", "Q8_0", "Q4_K_M"):
        files[f"SmolLM2 {label}"] = cache / f"SmolLM2-135M-Instruct.{label}.gguf"
    return {k: v for k, v in files.items() if v.exists()}


def made_qwen_moe(out_dir: Path) -> dict[str, Path]:
    """A made Qwen3.5-MoE (make-model's `small` preset) - the reference deployment's architecture - in GGUF Q4_K (the
    converter's one type) and Q4_K_M (llama-quantize's per-tensor mix, re-quantized from an F16 file: Q4_K with
    Q6_K for attn_v/ffn_down on the layers llama.cpp picks, and the head)."""
    path = out_dir / "qwen35moe-small"
    q4k, f16, q4km = path / "model-Q4_K.gguf", path / "model-F16.gguf", path / "model-Q4_K_M.gguf"
    cli = [sys.executable, "-m", "sangama_p2p.cli.main"]
    if not q4k.exists():
        subprocess.run([*cli, "make-model", str(path), "--arch", "qwen3_5_moe", "--preset", "small", "--gguf", "Q4_K"],
                       check=True, stdout=subprocess.DEVNULL)
    if not q4km.exists():
        if not f16.exists():
            from sangama_p2p.model.gguf import write_gguf

            write_gguf(path, f16, "F16")
        subprocess.run([*cli, "requantize", str(f16), str(q4km), "Q4_K_M"], check=True, stdout=subprocess.DEVNULL)
    return {"made Qwen3.5-MoE Q4_K": q4k, "made Qwen3.5-MoE Q4_K_M": q4km}


def llama_bench_cmd(tree: Path, path: Path, threads: int, *, prompt: int, gen: int) -> list[str]:
    return [str(tree / "build" / "bin" / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", str(prompt),
            "-n", str(gen), "-r", "1", "-o", "json"]


def llama_bench(tree: Path, path: Path, threads: int, *, prompt: int, gen: int) -> tuple[float, float]:
    out, rss, _ = run_measured(llama_bench_cmd(tree, path, threads, prompt=prompt, gen=gen))
    return float(json.loads(out)[0]["avg_ts"]), rss


def ours(path: Path, threads: int, *, prompt: int, gen: int) -> tuple[float, float]:
    """Our runtime in a fresh process (this script's ``--ours`` mode), warmed up by one run of the same request
    first, as llama-bench warms up before it times: a fresh process's first prefill pays for growing the heap
    (page faults of new memory: SmolLM2 F16's 512-token prefill took 1.47 s first and 0.99 s after, 2 threads)."""
    cmd = [sys.executable, __file__, "--ours", str(path), str(threads), str(prompt), str(gen)]
    out, rss, _ = run_measured(cmd, env=dict(os.environ, THP_MEM_ALLOC_ENABLE="1"))
    doc = json.loads(out)
    if gen > 1:
        return float(doc["decode_tokens_per_s"]), rss
    return prompt / (doc["prefill_ms"] / 1e3), rss


def run_ours(path: str, threads: int, prompt: int, gen: int) -> None:
    """What `sangama-peer generate --local FILE --prompt-ids ... --ignore-eos --threads T --json` runs (one stage
    holding every layer, fused kernels), the request made twice in one process; prints the second one's result."""
    from sangama_p2p.cli.threads import set_threads
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    set_threads(threads)
    ckpt = open_checkpoint(path, need_tokenizer=False)
    chain = LocalChain.load(ckpt, [LayerRange(0, ckpt.spec.num_layers)])
    ids = [1 + (i * 7919) % 1000 for i in range(prompt)]
    chain.generate(ids, gen, stop_at_eos=False)  # the warm-up
    print(json.dumps(chain.generate(ids, gen, stop_at_eos=False).as_dict()))


def baseline_rss() -> float:
    """Peak RSS of Python + torch + the package imported, nothing loaded (what our column carries beyond weights)."""
    _, rss, _ = run_measured([sys.executable, "-c", "import torch, sangama_p2p.model.chain, sangama_p2p.model.gguf"])
    return rss


def cpu_per_token(tree: Path, files: dict[str, Path], rounds: int) -> list[dict]:
    """CPU ms per decode token of both programs at one thread, from whole processes in turn (ours, llama.cpp, ...):
    (median CPU seconds at 256 generated tokens - at 16) / 240, which cancels start-up, loading and prefill; steadier
    than tokens/s on a shared machine, where a process's CPU time counts only the time it ran."""
    long, short = 256, 16
    ids = "1,2,3,4"

    def ours_cpu(path: Path, n: int) -> float:
        cmd = [sys.executable, "-m", "sangama_p2p.cli.main", "generate", "--local", str(path), "--prompt-ids", ids,
               "--max-new-tokens", str(n), "--ignore-eos", "--threads", "1", "--json"]
        return run_measured(cmd, env=dict(os.environ, THP_MEM_ALLOC_ENABLE="1"))[2]

    def llama_cpu(path: Path, n: int) -> float:
        return run_measured(llama_bench_cmd(tree, path, 1, prompt=0, gen=n))[2]

    rows = []
    for label, path in files.items():
        ours_cpu(path, short)  # warm the page cache and the interpreter's caches once
        cpu: dict[tuple[str, int], list[float]] = {}
        for _ in range(rounds):
            for n in (long, short):
                cpu.setdefault(("ours", n), []).append(ours_cpu(path, n))
                cpu.setdefault(("llama.cpp", n), []).append(llama_cpu(path, n))
        med = {key: statistics.median(v) for key, v in cpu.items()}
        ours_ms = (med[("ours", long)] - med[("ours", short)]) / (long - short) * 1e3
        llama_ms = (med[("llama.cpp", long)] - med[("llama.cpp", short)]) / (long - short) * 1e3
        rows.append({"file": label, "ours_cpu_ms_per_token": round(ours_ms, 2),
                     "llama_cpp_cpu_ms_per_token": round(llama_ms, 2), "ratio": round(llama_ms / ours_ms, 3),
                     "cpu_s": {f"{who} {n}": [round(x, 3) for x in v] for (who, n), v in cpu.items()}})
    return rows


def main() -> None:
    if len(sys.argv) == 6 and sys.argv[1] == "--ours":  # the child that runs our side (see ours())
        run_ours(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", default=None)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--files", nargs="*", default=None, metavar="LABEL=PATH")
    ap.add_argument("--cpu-time", action="store_true",
                    help="instead: CPU ms per decode token of both programs at one thread (cpu_per_token)")
    args = ap.parse_args()
    tree = find_or_build_llama_cpp(args.llama_cpp)
    files = dict(f.split("=", 1) for f in args.files) if args.files else default_files()
    files = {k: Path(v) for k, v in files.items()}
    if not args.files:
        files.update(made_qwen_moe(Path.home() / ".cache" / "sangama-bench"))
    if args.cpu_time:
        rows = cpu_per_token(tree, files, args.rounds)
        print(f"{'file':<24} {'ours CPU ms/token':>18} {'llama.cpp CPU ms/token':>23} {'ratio':>6}")
        for row in rows:
            print(f"{row['file']:<24} {row['ours_cpu_ms_per_token']:>18.2f} {row['llama_cpp_cpu_ms_per_token']:>23.2f} "
                  f"{row['ratio']:>6.2f}")
        RESULTS.mkdir(exist_ok=True)
        doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg(),
               "rounds": args.rounds, "llama_cpp": str(tree), "rows": rows}
        (RESULTS / "vs_llamacpp_cpu.json").write_text(json.dumps(doc, indent=1) + "\n")
        return
    threads = [int(t) for t in args.threads.split(",")]
    kinds = [("decode", 4, 64)] + ([] if args.no_prefill else [("prefill", 512, 1)])
    samples: dict[tuple, list] = {}
    for r in range(args.rounds):
        for label, path in files.items():
            for t in threads:
                for kind, prompt, gen in kinds:
                    a = llama_bench(tree, path, t, prompt=prompt if kind == "prefill" else 0,
                                    gen=gen if kind == "decode" else 0)
                    b = ours(path, t, prompt=prompt, gen=gen)
                    samples.setdefault((label, t, kind), []).append((a, b))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    base = baseline_rss()
    rows = []
    for (label, t, kind), pairs in samples.items():
        ratios = [b[0] / a[0] for a, b in pairs]
        rows.append({"file": label, "threads": t, "kind": kind,
                     "llama_cpp_tps": round(statistics.median(a[0] for a, _ in pairs), 2),
                     "ours_tps": round(statistics.median(b[0] for _, b in pairs), 2),
                     "ratio_median": round(statistics.median(ratios), 3),
                     "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                     "llama_cpp_peak_rss_mib": round(max(a[1] for a, _ in pairs), 1),
                     "ours_peak_rss_mib": round(max(b[1] for _, b in pairs), 1),
                     "file_mib": round(files[label].stat().st_size / 2**20, 1)})
    print(f"\nours vs llama.cpp (medians of {args.rounds} alternating rounds; baseline RSS of python+torch+package "
          f"{base:.0f} MiB is in our column)")
    print(f"{'file':<24} {'thr':>3} {'kind':<8} {'llama.cpp t/s':>13} {'ours t/s':>9} {'ratio':>6} {'range':>13} "
          f"{'RSS MiB llama.cpp / ours':>25} {'file MiB':>8}")
    for row in rows:
        print(f"{row['file']:<24} {row['threads']:>3} {row['kind']:<8} {row['llama_cpp_tps']:>13.1f} "
              f"{row['ours_tps']:>9.1f} {row['ratio_median']:>6.2f} {row['ratio_min']:>6.2f}-{row['ratio_max']:<6.2f} "
              f"{row['llama_cpp_peak_rss_mib']:>12.0f} / {row['ours_peak_rss_mib']:<10.0f} {row['file_mib']:>8.1f}")
    RESULTS.mkdir(exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rounds": args.rounds,
           "baseline_rss_mib": round(base, 1), "llama_cpp": str(tree), "rows": rows}
    (RESULTS / "vs_llamacpp.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
