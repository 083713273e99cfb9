"""Our decode and prefill against llama.cpp's, on the same GGUF files with the same thread counts, alternating.

    python benchmarks/vs_llamacpp.py [--llama-cpp DIR] [--build native|portable] [--mid] [--threads 1,2]
                                     [--rounds 3] [--files LABEL=PATH ...] [--json OUT]

llama.cpp: DIR is a llama.cpp source tree with a CPU build in DIR/build/bin (or set LLAMA_CPP_DIR). Without one,
the script builds it from the `llama-cpp-python` sdist on PyPI, which vendors llama.cpp (~6 min on 2 cores) into
~/.cache/sangama-bench/: natively by default (``-DGGML_NATIVE=ON``, what a user's own build is; AMX off where the
CPU reports it, :func:`build_flags`), or ``--build portable`` (``-DGGML_NATIVE=OFF``). The build compared with is
printed and kept in the JSON (``llama_cpp_build``, ``llama_cpp_flags``). Files: by default the SmolLM2-135M-Instruct
set in ${SANGAMA_TEST_MODELS:-~/.cache/sangama-test} (Q4_1 as shipped; F16, Q8_0 and Q4_K_M re-quantized from it by
our writer when present) and a made Qwen3.5-MoE (small) in Q4_K and Q4_K_M; ``--mid`` adds the mid-size made
Qwen3.5-MoE (``make-model --preset mid``, 2.4-2.7 GB) in both.

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
CMAKE_FLAGS = ["-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DCMAKE_BUILD_TYPE=Release"]
AMX_OFF = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def build_flags(kind: str) -> list[str]:
    """CMake flags of a ``native`` build (what a user's own build is: ``-DGGML_NATIVE=ON``, i.e. ``-march=native``)
    or a ``portable`` one (``-DGGML_NATIVE=OFF``: AVX2 at most, ~1.2x slower decode here). Where the CPU reports AMX,
    the native build switches it off (:data:`AMX_OFF`; GCC's explicit ``-mno-*`` flags win over ``-march=native``
    whatever their order, and ggml's own AMX code is off too): a VM may report AMX that it does not let programs use,
    and such a build died with ``Illegal instruction`` in batched quantized products (prefill, perplexity)."""
    if kind == "portable":
        return ["-DGGML_NATIVE=OFF", *CMAKE_FLAGS]
    flags = ["-DGGML_NATIVE=ON", *CMAKE_FLAGS]
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists() and " amx_" in cpuinfo.read_text():
        flags += [f"-DCMAKE_C_FLAGS={AMX_OFF}", f"-DCMAKE_CXX_FLAGS={AMX_OFF}", "-DGGML_AMX_TILE=OFF",
                  "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return flags


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


def find_or_build_llama_cpp(given: str | None, targets: tuple[str, ...] = ("llama-bench",),
                            kind: str = "native") -> Path:
    """The ``bin`` folder of a llama.cpp build that holds ``targets``: DIR/build/bin of a tree given (DIR or
    $LLAMA_CPP_DIR, built as its owner chose), else the sdist's tree in ~/.cache/sangama-bench built into
    ``build-native`` or ``build`` (portable) with :func:`build_flags` (a cached build that lacks a target builds
    just that one)."""
    for cand in (given, os.environ.get("LLAMA_CPP_DIR")):
        if cand and all((Path(cand) / "build" / "bin" / t).exists() for t in targets):
            return Path(cand) / "build" / "bin"
    root = Path.home() / ".cache" / "sangama-bench"
    tree = root / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    build = "build-native" if kind == "native" else "build"
    if not all((tree / build / "bin" / t).exists() for t in targets):
        if not tree.exists():
            root.mkdir(parents=True, exist_ok=True)
            subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary=:all:", SDIST,
                            "-d", str(root)], check=True)
            with tarfile.open(next(root.glob("llama_cpp_python-*.tar.gz"))) as t:
                t.extractall(root, filter="data")
        if not (tree / build / "CMakeCache.txt").exists():
            subprocess.run(["cmake", "-B", build, *build_flags(kind)], cwd=tree, check=True)
        subprocess.run(["cmake", "--build", build, f"-j{os.cpu_count()}", "--target", *targets], cwd=tree,
                       check=True)
    return tree / build / "bin"


def default_files() -> dict[str, Path]:
    cache = Path(os.environ.get("SANGAMA_TEST_MODELS") or Path.home() / ".cache" / "sangama-test")
    files = {"SmolLM2 Q4_1": cache / "SmolLM2-135M-Instruct.Q4_1.gguf"}
    for label in ("F16", "Q8_0", "Q4_K_M"):
        files[f"SmolLM2 {label}"] = cache / f"SmolLM2-135M-Instruct.{label}.gguf"
    return {k: v for k, v in files.items() if v.exists()}


def made_qwen_moe(out_dir: Path, preset: str = "small") -> dict[str, Path]:
    """A made Qwen3.5-MoE (make-model's ``preset``: ``small``, or ``mid`` - the routing shape of Qwen3.5-35B-A3B, 4e9
    parameters) - the reference deployment's architecture - in GGUF Q4_K (the converter's one type) and Q4_K_M
    (llama-quantize's per-tensor mix, re-quantized from an F16 file: Q4_K with Q6_K for attn_v/ffn_down on the layers
    llama.cpp picks, and the head). The mid F16 file (8 GB) is deleted once the Q4_K_M one is written."""
    path = out_dir / f"qwen35moe-{preset}"
    q4k, f16, q4km = path / "model-Q4_K.gguf", path / "model-F16.gguf", path / "model-Q4_K_M.gguf"
    cli = [sys.executable, "-m", "sangama_p2p.cli.main"]
    if not q4k.exists():
        subprocess.run([*cli, "make-model", str(path), "--arch", "qwen3_5_moe", "--preset", preset, "--gguf", "Q4_K"],
                       check=True, stdout=subprocess.DEVNULL)
    if not q4km.exists():
        if not f16.exists():
            from sangama_p2p.model.gguf import write_gguf

            write_gguf(path, f16, "F16")
        subprocess.run([*cli, "requantize", str(f16), str(q4km), "Q4_K_M"], check=True, stdout=subprocess.DEVNULL)
        if preset != "small":
            f16.unlink()
    name = "made Qwen3.5-MoE" if preset == "small" else f"made Qwen3.5-MoE {preset}"
    return {f"{name} Q4_K": q4k, f"{name} Q4_K_M": q4km}


LLAMA_REPACK = 1  # llama-bench --repack: 1 (its default, what users run) repacks Q4_0/Q4_K/... weights at load


def llama_bench_cmd(bin_dir: Path, path: Path, threads: int, *, prompt: int, gen: int) -> list[str]:
    return [str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", str(prompt),
            "-n", str(gen), "-r", "1", "-o", "json", "--repack", str(LLAMA_REPACK)]


def llama_bench(bin_dir: Path, path: Path, threads: int, *, prompt: int, gen: int) -> tuple[float, float]:
    out, rss, _ = run_measured(llama_bench_cmd(bin_dir, path, threads, prompt=prompt, gen=gen))
    return float(json.loads(out)[0]["avg_ts"]), rss


def ours(path: Path, threads: int, *, prompt: int, gen: int, kernels: str = "auto") -> tuple[float, float]:
    """Our runtime in a fresh process (this script's ``--ours`` mode), warmed up by one run of the same request
    first, as llama-bench warms up before it times: a fresh process's first prefill pays for growing the heap
    (page faults of new memory: SmolLM2 F16's 512-token prefill took 1.47 s first and 0.99 s after, 2 threads).
    ``kernels``: ``SANGAMA_KERNELS`` of the child (ggml's kernels, torch's int4 ones, or auto)."""
    cmd = [sys.executable, __file__, "--ours", str(path), str(threads), str(prompt), str(gen)]
    out, rss, _ = run_measured(cmd, env=dict(os.environ, THP_MEM_ALLOC_ENABLE="1", SANGAMA_KERNELS=kernels))
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
    from sangama_p2p.model.ops import flush_denormals_in_process
    from sangama_p2p.model.spec import LayerRange

    flush_denormals_in_process()  # as the console script's process does
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


def cpu_per_token(bin_dir: Path, files: dict[str, Path], rounds: int) -> list[dict]:
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
        return run_measured(llama_bench_cmd(bin_dir, path, 1, prompt=0, gen=n))[2]

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
    ap.add_argument("--build", choices=("native", "portable"), default="native",
                    help="the llama.cpp build made from the sdist (default native: -march=native, AMX off)")
    ap.add_argument("--mid", action="store_true", help="also the mid-size made Qwen3.5-MoE (2.7 GB, slow to make)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--kernels", default="ggml,torch",
                    help="our kernels to measure, each against the same llama.cpp run (SANGAMA_KERNELS values)")
    ap.add_argument("--files", nargs="*", default=None, metavar="LABEL=PATH")
    ap.add_argument("--llama-repack", type=int, choices=(0, 1), default=1,
                    help="llama-bench --repack: 1 (default) repacks weights at load as llama.cpp does; 0 multiplies "
                         "them as the file stores them, as ours does")
    ap.add_argument("--json", type=Path, default=None, help="where to write the results (default: results/vs_llamacpp.json)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="instead: CPU ms per decode token of both programs at one thread (cpu_per_token)")
    args = ap.parse_args()
    global LLAMA_REPACK
    LLAMA_REPACK = args.llama_repack
    bin_dir = find_or_build_llama_cpp(args.llama_cpp, kind=args.build)
    build = ("given" if args.llama_cpp or os.environ.get("LLAMA_CPP_DIR") else args.build,
             (bin_dir.parent / "CMakeCache.txt").read_text() if (bin_dir.parent / "CMakeCache.txt").exists() else "")
    flags = [line for line in build[1].splitlines() if line.split(":")[0] in
             ("GGML_NATIVE", "CMAKE_C_FLAGS", "GGML_AMX_TILE", "GGML_AVX512")]
    print(f"llama.cpp: {bin_dir} ({build[0]} build: {', '.join(flags) or 'flags unknown'})", file=sys.stderr)
    files = dict(f.split("=", 1) for f in args.files) if args.files else default_files()
    files = {k: Path(v) for k, v in files.items()}
    if not args.files:
        files.update(made_qwen_moe(Path.home() / ".cache" / "sangama-bench"))
        if args.mid:
            files.update(made_qwen_moe(Path.home() / ".cache" / "sangama-bench", "mid"))
    if args.cpu_time:
        rows = cpu_per_token(bin_dir, files, args.rounds)
        print(f"{'file':<24} {'ours CPU ms/token':>18} {'llama.cpp CPU ms/token':>23} {'ratio':>6}")
        for row in rows:
            print(f"{row['file']:<24} {row['ours_cpu_ms_per_token']:>18.2f} {row['llama_cpp_cpu_ms_per_token']:>23.2f} "
                  f"{row['ratio']:>6.2f}")
        RESULTS.mkdir(exist_ok=True)
        doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "load_avg": os.getloadavg(),
               "rounds": args.rounds, "llama_cpp": str(bin_dir), "llama_cpp_build": build[0], "llama_cpp_flags": flags,
               "llama_cpp_repack": LLAMA_REPACK, "rows": rows}
        (RESULTS / "vs_llamacpp_cpu.json").write_text(json.dumps(doc, indent=1) + "\n")
        return
    threads = [int(t) for t in args.threads.split(",")]
    kinds = [("decode", 4, 64)] + ([] if args.no_prefill else [("prefill", 512, 1)])
    samples: dict[tuple, list] = {}
    for r in range(args.rounds):
        for label, path in files.items():
            for t in threads:
                for kind, prompt, gen in kinds:
                    a = llama_bench(bin_dir, path, t, prompt=prompt if kind == "prefill" else 0,
                                    gen=gen if kind == "decode" else 0)
                    for kern in args.kernels.split(","):
                        b = ours(path, t, prompt=prompt, gen=gen, kernels=kern)
                        samples.setdefault((label, t, kind, kern), []).append((a, b))
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr)
    base = baseline_rss()
    rows = []
    for (label, t, kind, kern), pairs in samples.items():
        ratios = [b[0] / a[0] for a, b in pairs]
        rows.append({"file": label, "threads": t, "kind": kind, "kernels": kern,
                     "llama_cpp_tps": round(statistics.median(a[0] for a, _ in pairs), 2),
                     "ours_tps": round(statistics.median(b[0] for _, b in pairs), 2),
                     "ratio_median": round(statistics.median(ratios), 3),
                     "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3),
                     "llama_cpp_peak_rss_mib": round(max(a[1] for a, _ in pairs), 1),
                     "ours_peak_rss_mib": round(max(b[1] for _, b in pairs), 1),
                     "file_mib": round(files[label].stat().st_size / 2**20, 1)})
    print(f"\nours vs llama.cpp (medians of {args.rounds} alternating rounds; baseline RSS of python+torch+package "
          f"{base:.0f} MiB is in our column)")
    print(f"{'file':<24} {'thr':>3} {'kind':<8} {'ours':<6} {'llama.cpp t/s':>13} {'ours t/s':>9} {'ratio':>6} "
          f"{'range':>13} "
          f"{'RSS MiB llama.cpp / ours':>25} {'file MiB':>8}")
    for row in rows:
        print(f"{row['file']:<24} {row['threads']:>3} {row['kind']:<8} {row['kernels']:<6} "
              f"{row['llama_cpp_tps']:>13.1f} "
              f"{row['ours_tps']:>9.1f} {row['ratio_median']:>6.2f} {row['ratio_min']:>6.2f}-{row['ratio_max']:<6.2f} "
              f"{row['llama_cpp_peak_rss_mib']:>12.0f} / {row['ours_peak_rss_mib']:<10.0f} {row['file_mib']:>8.1f}")
    RESULTS.mkdir(exist_ok=True)
    doc = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.processor() or
           platform.machine(), "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "rounds": args.rounds,
           "baseline_rss_mib": round(base, 1), "llama_cpp": str(bin_dir), "llama_cpp_build": build[0],
           "llama_cpp_flags": flags, "llama_cpp_repack": LLAMA_REPACK, "rows": rows}
    (args.json or RESULTS / "vs_llamacpp.json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
