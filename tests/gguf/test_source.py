"""GGUF fixtures made by llama.cpp load through our source and reproduce the reference logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf
import pytest
import torch
from helpers import (
    LLAMA_DIR,
    LLAMA_F16,
    LLAMA_Q4KM,
    QWEN_DIR,
    QWEN_F32,
    QWEN_Q4KM,
    chain_logits,
    hf_state_dict,
    reference,
    top64_gap,
    transformers_logits,
)

from sangama_p2p.model.gguf import open_gguf
from sangama_p2p.model.gguf.quants import QuantTensor
from sangama_p2p.model.stage import StageModel

pytestmark = pytest.mark.skipif(not QWEN_F32.is_file(), reason="GGUF fixtures not found")


@pytest.fixture(scope="module")
def qwen_q4km():
    spec, src, _ = open_gguf(QWEN_Q4KM)
    yield spec, src
    src.close()


def _argmax_agree(logits: torch.Tensor, ref: dict) -> int:
    return sum(int(logits[j].argmax()) == ref["positions"][j]["top_ids"][0] for j in range(24))


def test_qwen_f32_chain_matches_transformers_reference() -> None:
    spec, src, _ = open_gguf(QWEN_F32)
    assert spec.arch == "qwen3_5_moe" and spec.num_layers == 8 and spec.mtp_num_layers == 1
    assert spec.linear_num_value_heads == 4 and spec.rotary_dim == 16 and spec.rms_norm_eps == 1e-6
    ref = reference(QWEN_DIR / "ref-tiny-qwen35moe.transformers.json")
    logits = chain_logits(spec, src, [(0, 3), (3, 8)], ref["input_ids"], steps=4)
    # measured 1.6e-05: the inverse transforms give back the HF weights
    assert top64_gap(logits, ref, range(24)) < 1e-3
    assert _argmax_agree(logits, ref) == 24


@pytest.mark.slow
def test_qwen_f32_tensors_drive_transformers() -> None:
    """Independent of our runtime: transformers with our loaded tensors reproduces its own reference."""
    spec, src, _ = open_gguf(QWEN_F32)
    state = hf_state_dict(src, [n for n in src.names() if not n.startswith("mtp.")])
    ref = reference(QWEN_DIR / "ref-tiny-qwen35moe.transformers.json")
    logits = transformers_logits(QWEN_DIR, state, ref["input_ids"])
    assert top64_gap(logits, ref, range(24)) < 1e-4  # measured 1.8e-05


def test_llama_f16_chain_matches_references() -> None:
    spec, src, _ = open_gguf(LLAMA_F16)
    assert spec.arch == "llama" and spec.num_layers == 4 and spec.rope_theta == 5e5 and spec.rms_norm_eps == 1e-5
    ref = reference(LLAMA_DIR / "ref-tiny-llama.transformers.json")
    logits = chain_logits(spec, src, [(0, 2), (2, 4)], ref["input_ids"], steps=4)
    assert top64_gap(logits, ref, range(24)) < 1e-2  # F16 weights vs fp32 reference: measured 0.0052
    ref_cpp = reference(LLAMA_DIR / "ref-tiny-llama-F16.llamacpp.json")
    assert top64_gap(logits, ref_cpp, range(24)) < 1e-2  # measured 0.0051


@pytest.mark.parametrize(
    "path,ref_name,tol,argmax",
    [
        (QWEN_Q4KM, "ref-tiny-qwen35moe-Q4_K_M.llamacpp.json", 0.45, 23),  # measured 0.378, 23/24
        # measured 0.155, 22/24 fused (dequantized per use: 0.152, 24/24); the misses are rows 5 and 18, where
        # llama.cpp's own top-2 margins are 0.060 and 0.037, under one bfloat16 step at 12 (0.0625: the int4
        # kernel's output dtype; row 18's two logits are equal in ours). With Q6_K as an fp16 copy (before the
        # two-code layout) row 18 agreed: 23/24
        (LLAMA_Q4KM, "ref-tiny-llama-Q4_K_M.llamacpp.json", 0.2, 22),
    ],
    ids=["qwen", "llama"],
)
def test_q4_k_m_chain_matches_llama_cpp(path, ref_name, tol, argmax) -> None:
    """Quantized weights kept quantized; llama.cpp also quantizes activations, hence the tolerance."""
    spec, src, _ = open_gguf(path)
    ref = reference(path.parent / ref_name)
    logits = chain_logits(spec, src, [(0, spec.num_layers)], ref["input_ids"], steps=2)
    assert top64_gap(logits, ref, range(24)) < tol
    assert _argmax_agree(logits, ref) >= argmax
    src.close()


def test_stage_reads_only_its_own_tensors(qwen_q4km) -> None:
    spec, src = qwen_q4km
    src.reads.clear(), src.gguf_reads.clear()
    stage = StageModel.load(spec, src, 3, 5)
    touched = {name for name, _ in src.gguf_reads}
    assert touched, "nothing was read"
    assert all(n.startswith(("blk.3.", "blk.4.")) for n in touched), sorted(touched)
    everything = {n for n in src.file.tensors if n.startswith(("blk.3.", "blk.4."))}
    assert touched == everything
    assert set(src.reads) == set(stage.loaded_names)
    assert all(n.startswith(("model.layers.3.", "model.layers.4.")) for n in src.reads)


def test_expert_is_a_view_of_its_slice(qwen_q4km) -> None:
    spec, src = qwen_q4km
    info = src.file.tensors["blk.1.ffn_down_exps.weight"]
    assert info.type_name == "Q4_K" and info.shape == (8, 16, 256)
    whole = src.file.view("blk.1.ffn_down_exps.weight")
    ref = gguf.quants.dequantize(whole.numpy(), gguf.GGMLQuantizationType.Q4_K)
    for e in (0, 5, 7):
        w = src.get(f"model.layers.1.mlp.experts.{e}.down_proj.weight", torch.float32)
        assert isinstance(w, QuantTensor)
        assert w.shape == (16, 256) and w.nbytes == info.nbytes // 8
        assert w.data.data_ptr() == whole.data_ptr() + e * (info.nbytes // 8)  # no copy, only its slice
        assert torch.equal(w.dequantize(torch.float32), torch.from_numpy(ref[e]))


def test_quantized_ssm_out_columns_are_reordered(qwen_q4km) -> None:
    spec, src = qwen_q4km
    w = src.get("model.layers.0.linear_attn.out_proj.weight", torch.float32)
    assert isinstance(w, QuantTensor) and w.col_perm is not None
    qtype = gguf.GGMLQuantizationType(src.file.tensors["blk.0.ssm_out.weight"].qtype)
    raw = gguf.quants.dequantize(src.file.view("blk.0.ssm_out.weight").numpy(), qtype)
    # HF column (k, j, d) of the grouped order [NK=2, r=2, hd=64] sits at tiled column (j, k, d)
    tiled = torch.from_numpy(raw).view(16, 2, 2, 64)
    assert torch.equal(w.dequantize(torch.float32).view(16, 2, 2, 64), tiled.transpose(1, 2))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("path,stage", [(QWEN_Q4KM, (0, 8)), (QWEN_F32, (4, 8)), (LLAMA_Q4KM, (1, 4))])
def test_resident_weights_within_bound_of_file_bytes(path, stage, fused) -> None:
    spec, src, _ = open_gguf(path)
    model = StageModel.load(spec, src, *stage, fused=fused)
    in_file = sum(src.nbytes_in_file(n) for n in model.loaded_names)
    # repacked (model/gguf/packed.py): int4 planes with bfloat16 scales take 1.11x a Q4 block's bytes, 1.18x Q8_0's
    # and 1.82x Q5_0's; the llama Q4_K_M stage (Q5_0 layers, Q8_0 head) measured 1.19x
    assert 0.95 * in_file <= model.resident_bytes <= (1.25 if fused else 1.15) * in_file
    src.close()


_RSS_SCRIPT = textwrap.dedent(
    """
    import gc, json, sys, torch
    from sangama_p2p.model.gguf import open_gguf
    from sangama_p2p.model.stage import StageModel

    def resident():
        # anonymous memory of the process + resident pages of the GGUF file's mapping; other file-backed pages
        # (library code faulted in by first use of a kernel) are not ours to count
        anon = file_rss = 0
        in_map = False
        for line in open("/proc/self/smaps"):
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:
                in_map = len(head) >= 6 and head[5] == sys.argv[1]
            elif in_map and line.startswith("Rss:"):
                file_rss += int(head[1]) * 1024
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                anon = int(line.split()[1]) * 1024
        return anon + file_rss

    spec, src, tok = open_gguf(sys.argv[1])
    del tok
    gc.collect()
    torch.ones(8, dtype=torch.float16).float().sum()
    before = resident()
    stage = StageModel.load(spec, src, 0, spec.num_layers, fused=False)  # the dequantize-per-use path's memory
    for w in stage.weights():  # touch every page the stage holds
        t = w if isinstance(w, torch.Tensor) else w.data
        t.view(-1)[:: max(1, 4096 // t.element_size())].float().sum()
    after = resident()
    in_file = sum(src.nbytes_in_file(n) for n in stage.loaded_names)
    print(json.dumps({"delta": after - before, "in_file": in_file}))
    """
)


@pytest.mark.slow
def test_process_rss_delta_within_bound() -> None:
    """A whole-model stage of the Q4_K_M file: RSS grows by about its tensors' bytes, not by dequantized copies."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(QWEN_Q4KM)], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # measured 17.63 MB for 17.54 MB of tensors; 1 MiB of slack covers page granularity and allocator noise, while a
    # float32 copy of the two F16 vocabulary tables alone would add 16 MB
    assert got["delta"] <= 1.15 * got["in_file"] + 2**20, got
