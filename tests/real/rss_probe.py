"""Run as a script: load a whole-model stage of a GGUF file, run one prefill + one decode step, and print (JSON) how
long opening the file and loading the stage took and how much the process's memory grew over the load - anonymous memory plus the resident pages of the GGUF file's own
mapping, the memory the stage holds (library code pages faulted in by first use are not counted) - against the bytes
of the stage's tensors in the file, and the most the process's resident set grew at any time during the load
(``peak_load``: VmHWM after it minus VmRSS before it). Used by test_smollm2.py and benchmarks; argv: PATH fused(0|1)."""

import gc
import json
import sys
import time

import torch

from sangama_p2p.model.gguf import open_gguf
from sangama_p2p.model.stage import StageModel, StepInput


def resident(path: str) -> int:
    return sum(resident_parts(path))


def resident_parts(path: str) -> tuple[int, int]:
    """(anonymous memory, resident pages of the GGUF file's mappings) in bytes."""
    anon = file_rss = 0
    in_map = False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            in_map = len(head) >= 6 and head[5] == path
        elif in_map and line.startswith("Rss:"):
            file_rss += int(head[1]) * 1024
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            anon = int(line.split()[1]) * 1024
    return anon, file_rss


def status_mib(key: str) -> int:
    """A field of /proc/self/status in bytes (VmRSS, VmHWM: the process's peak resident set so far)."""
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def main() -> None:
    path, fused = sys.argv[1], sys.argv[2] == "1"
    torch.set_num_threads(1)
    torch.ones(8, dtype=torch.float16).float().sum()
    t0 = time.perf_counter()
    spec, src, _ = open_gguf(path, tokenizer=False)
    t_open = time.perf_counter() - t0
    gc.collect()
    before = resident_parts(path)
    rss_before = status_mib("VmRSS")
    t0 = time.perf_counter()
    stage = StageModel.load(spec, src, 0, spec.num_layers, fused=fused)
    t_load = time.perf_counter() - t0
    loaded = resident_parts(path)
    peak_load = status_mib("VmHWM") - rss_before  # the most the resident set grew at any time during the load
    state = stage.new_session(16)
    x = stage.forward([StepInput(state, 0, tokens=torch.tensor([1, 2, 3, 4]))])
    stage.logits(x[-1:])
    x = stage.forward([StepInput(state, 4, tokens=torch.tensor([5]))])
    stage.logits(x)
    del x, state
    gc.collect()
    stepped = resident(path)
    in_file = sum(src.nbytes_in_file(n) for n in stage.loaded_names)
    print(json.dumps({"in_file": in_file, "after_load": sum(loaded) - sum(before), "after_steps": stepped - sum(before),
                      "anon_load": loaded[0] - before[0], "file_load": loaded[1] - before[1],
                      "peak_load": peak_load,
                      "open_s": round(t_open, 3), "load_s": round(t_load, 3)}))


if __name__ == "__main__":
    main()
