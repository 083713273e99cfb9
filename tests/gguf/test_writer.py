"""The writer reproduces llama.cpp's converter, and GGUF stages equal safetensors stages of the same checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import LLAMA_F16, QWEN_F32, RoundedSource, chain_logits, greedy
from safetensors.torch import save_file

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.gguf import open_gguf, write_gguf
from sangama_p2p.model.gguf.quants import QuantTensor
from sangama_p2p.model.gguf.reader import GGUFFile
from sangama_p2p.model.make import make_model
from sangama_p2p.model.stage import StageModel
from sangama_p2p.model.weights import SafetensorsSource

PROMPT = "Hello world, this is a test of the GGUF writer."
fixtures = pytest.mark.skipif(not QWEN_F32.is_file(), reason="GGUF fixtures not found")


def _hf_dir_from_gguf(gguf_path: Path, out: Path, extra: tuple[str, ...]) -> Path:
    """An HF checkpoint directory holding exactly the tensors our reader gives back for ``gguf_path``."""
    out.mkdir()
    spec, src, _ = open_gguf(gguf_path)
    save_file({n: src.get(n, torch.float32).contiguous().clone() for n in src.names()}, str(out / "model.safetensors"))
    src.close()
    for name in ("config.json", *extra):
        shutil.copy(gguf_path.parent / name, out / name)
    return out


@fixtures
@pytest.mark.parametrize(
    "gguf_path,qtype,extra",
    [
        pytest.param(QWEN_F32, "F32", ("tokenizer.json", "tokenizer_config.json"), marks=pytest.mark.slow),
        (LLAMA_F16, "F16", ()),
    ],
    ids=["qwen-F32", "llama-F16"],
)
def test_writer_reproduces_llama_cpp_converter(tmp_path: Path, gguf_path: Path, qtype: str, extra) -> None:
    """read(fixture) -> write == fixture, tensor for tensor and bit for bit (so our transforms are exact inverses),
    with the same metadata apart from the model's name."""
    hf = _hf_dir_from_gguf(gguf_path, tmp_path / "hf", extra)
    (out,) = write_gguf(hf, tmp_path / "out.gguf", qtype)
    ref, ours = GGUFFile(gguf_path), GGUFFile(out)
    assert set(ours.tensors) == set(ref.tensors)
    for name, info in ref.tensors.items():
        assert ours.tensors[name].qtype == info.qtype, name
        assert torch.equal(ours.view(name), ref.view(name)), name
    def kept(key: str) -> bool:  # the name differs; the llama fixture dir ships no tokenizer to convert
        return key not in ("general.name", "general.size_label") and (bool(extra) or not key.startswith("tokenizer."))

    skip = {k for k in (*ours.metadata, *ref.metadata) if not kept(k)}
    assert {k: v for k, v in ours.metadata.items() if k not in skip} == {
        k: v for k, v in ref.metadata.items() if k not in skip
    }


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_model(root / arch, arch, "tiny") for arch in ("qwen3_5_moe", "llama")}


def _f16_pair(tmp_path: Path, hf: Path):
    ck = open_checkpoint(hf)
    (out,) = write_gguf(hf, tmp_path / "m.gguf", "F16")
    spec, src, tok = open_gguf(out)
    ids = tok.encode(PROMPT).ids
    assert ids == ck.tokenizer.encode(PROMPT)  # the tokenizer survives the trip through GGUF metadata
    return spec, src, ck.spec, RoundedSource(ck.source, src), ids


@pytest.mark.parametrize("arch", ["qwen3_5_moe", "llama"])
def test_f16_chain_equals_safetensors_chain(tmp_path: Path, tiny, arch: str) -> None:
    """Same weights (the safetensors ones rounded to fp16 where the GGUF is F16): logits within 1e-3 for whole and
    split chains, over a prefill and single-token steps, when the F16 weights are upcast per use. Fused, the stage
    multiplies in fp16 (activations rounded to fp16, as llama.cpp does for F16 weights; fp32 accumulation, the output
    rounded to fp16): |diff| / std(logits) measured mean / max 1.4e-3 / 1.6e-2 (qwen), 4.3e-4 / 2.6e-3 (llama)."""
    spec, src, ref_spec, ref_src, ids = _f16_pair(tmp_path, tiny[arch])
    assert spec == ref_spec
    n = spec.num_layers
    ref = chain_logits(ref_spec, ref_src, [(0, n)], ids, steps=3)
    for stages in ([(0, n)], [(0, 1), (1, 5), (5, n)]):
        got = chain_logits(spec, src, stages, ids, steps=3, fused=False)
        assert (got - ref).abs().max() < 1e-3, stages
        fused = chain_logits(spec, src, stages, ids, steps=3)
        rel = (fused - ref).abs() / ref.std()
        assert float(rel.mean()) < 3e-3 and float(rel.max()) < 3e-2, (stages, float(rel.mean()), float(rel.max()))
        assert torch.equal(fused.argmax(-1), ref.argmax(-1)), stages


@pytest.mark.parametrize("arch", [pytest.param("qwen3_5_moe", marks=pytest.mark.slow), "llama"])
def test_f16_greedy_32_tokens_identical(tmp_path: Path, tiny, arch: str) -> None:
    spec, src, ref_spec, ref_src, ids = _f16_pair(tmp_path, tiny[arch])
    n = spec.num_layers
    assert greedy(spec, src, [(0, 3), (3, n)], ids[:8], 32) == greedy(ref_spec, ref_src, [(0, n)], ids[:8], 32)


# |logit diff| / std(logits) against the float32 safetensors chain: (mean bound, max bound, min argmax agreement).
# Measured (deterministic: seeded model, deterministic quantizers): qwen Q8_0 0.027 / 0.284 / 18 of 21 (near-tied
# expert routing flips on some rows); llama Q8_0 0.010 / 0.050 / 22 of 22; llama Q4_K 0.133 / 0.726 / 16 of 22;
# llama Q6_K 0.033 / 0.175 / 21 of 22 (Q4_K/Q6_K re-measured with the ggml-exact quantizers).
QUANT_CASES = [
    ("qwen3_5_moe", "Q8_0", (0.06, 0.5, 16)),  # rows of 64: every matrix Q8_0
    ("llama", "Q8_0", (0.02, 0.1, 21)),
    ("llama", "Q4_K", (0.25, 1.2, 13)),  # hidden 256: every matrix Q4_K
    ("llama", "Q6_K", (0.07, 0.4, 18)),
]


@pytest.mark.parametrize("arch,qtype,bounds", QUANT_CASES, ids=[f"{a}-{q}" for a, q, _ in QUANT_CASES])
def test_quantized_chain_close_to_float_chain(tmp_path: Path, tiny, arch: str, qtype: str, bounds,
                                             torch_kernels) -> None:
    """(The bounds are the writer's quantization through torch's int4 kernels, bfloat16 activations; ggml's kernels
    quantize the activations too: test_fused_stage.py holds their agreement.)"""
    ck = open_checkpoint(tiny[arch])
    (out,) = write_gguf(tiny[arch], tmp_path / "m.gguf", qtype)
    spec, src, tok = open_gguf(out)
    assert any(isinstance(src.get(n, torch.float32), QuantTensor) for n in src.names() if ".layers.1." in n)
    ids = tok.encode(PROMPT).ids
    ref = chain_logits(ck.spec, ck.source, [(0, spec.num_layers)], ids, steps=4)
    got = chain_logits(spec, src, [(0, 3), (3, spec.num_layers)], ids, steps=4)
    diff = (got - ref).abs() / ref.std()
    agree = int((got.argmax(-1) == ref.argmax(-1)).sum())
    mean_bound, max_bound, min_agree = bounds
    assert float(diff.mean()) < mean_bound and float(diff.max()) < max_bound and agree >= min_agree, (
        float(diff.mean()), float(diff.max()), agree)


def test_split_files_equal_single_file(tmp_path: Path, tiny) -> None:
    (single,) = write_gguf(tiny["llama"], tmp_path / "one.gguf", "Q8_0")
    parts = write_gguf(tiny["llama"], tmp_path / "m.gguf", "Q8_0", split_max_tensors=20)
    assert [p.name for p in parts] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    spec1, src1, _ = open_gguf(single)
    spec2, src2, _ = open_gguf(parts[0])
    assert spec1 == spec2 and sorted(src1.names()) == sorted(src2.names())
    assert len({src2.file.tensors[m.gguf].file for m in src2._index.values()}) == 3
    ids = list(range(5, 25))
    assert torch.equal(chain_logits(spec1, src1, [(0, 6)], ids), chain_logits(spec2, src2, [(0, 2), (2, 6)], ids))
    # a later stage touches only its own tensors, wherever they sit
    src2.gguf_reads.clear()
    StageModel.load(spec2, src2, 4, 6)
    assert {n for n, _ in src2.gguf_reads} == {
        n for n in src2.file.tensors if n.startswith(("blk.4.", "blk.5.", "output"))
    }


def test_mtp_tensors_from_gguf_or_mtp_from(tmp_path: Path, tiny) -> None:
    st = SafetensorsSource(tiny["qwen3_5_moe"])
    assert st.has("mtp.fc.weight")
    (out,) = write_gguf(tiny["qwen3_5_moe"], tmp_path / "m.gguf", "F32")
    spec, src, _ = open_gguf(out)
    assert spec.mtp_num_layers == 1 and "blk.8.nextn.eh_proj.weight" in src.file.tensors
    mtp_names = [n for n in st.names() if n.startswith("mtp.")]
    assert mtp_names and sorted(n for n in src.names() if n.startswith("mtp.")) == sorted(
        n for n in _expand_experts(mtp_names, spec.num_experts)
    )
    for n in ("mtp.fc.weight", "mtp.norm.weight", "mtp.layers.0.self_attn.q_proj.weight",
              "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.mlp.experts.3.up_proj.weight"):
        # zero-centred norms are stored as 1 + w: (1 + w) - 1 is w to within half an ulp of 1
        tol = 1.2e-7 if "norm" in n else 0.0
        torch.testing.assert_close(src.get(n, torch.float32), st.get(n, torch.float32), atol=tol, rtol=0, msg=n)
    (q8,) = write_gguf(tiny["qwen3_5_moe"], tmp_path / "q.gguf", "Q8_0")
    spec, src, _ = open_gguf(q8, mtp_from=tiny["qwen3_5_moe"])
    w = src.get("mtp.layers.0.self_attn.q_proj.weight", torch.float32)
    assert isinstance(w, torch.Tensor) and torch.equal(w, st.get("mtp.layers.0.self_attn.q_proj.weight", torch.float32))
    assert isinstance(src.get("model.layers.3.self_attn.q_proj.weight", torch.float32), QuantTensor)


def _expand_experts(names: list[str], n_experts: int) -> list[str]:
    import re

    out = []
    for n in names:
        m = re.match(r"^(.*\.experts)\.(gate_up_proj|down_proj)$", n)
        if not m:
            out.append(n)
            continue
        projs = ("gate_proj", "up_proj") if m.group(2) == "gate_up_proj" else ("down_proj",)
        out += [f"{m.group(1)}.{e}.{p}.weight" for e in range(n_experts) for p in projs]
    return out


def test_qwen35moe_gets_rope_sections_without_mrope_section(tmp_path: Path, tiny) -> None:
    """llama.cpp refuses a qwen35moe file without ``rope.dimension_sections`` ("key not found"); a made text-only
    config has no ``mrope_section``, so the writer splits the rotary pairs as Qwen3.5 does (llama.cpp's converter
    wrote 3, 3, 2 of 8 pairs for the fixture, whose config has them)."""
    config = json.loads((tiny["qwen3_5_moe"] / "config.json").read_text())
    assert "mrope_section" not in (config.get("rope_parameters") or {})
    (out,) = write_gguf(tiny["qwen3_5_moe"], tmp_path / "m.gguf", "F32")
    spec, src, _ = open_gguf(out)
    src.close()
    half = spec.rotary_dim // 2
    sections = [int(v) for v in GGUFFile(out).metadata["qwen35moe.rope.dimension_sections"]]
    assert len(sections) == 4 and sum(sections) == half and sections[3] == 0
    assert sections[0] >= sections[1] >= sections[2]


def test_writer_rejects_unknown_type(tmp_path: Path, tiny) -> None:
    with pytest.raises(UnsupportedModelError, match="Q3_K"):
        write_gguf(tiny["llama"], tmp_path / "x.gguf", "Q3_K")


@fixtures
def test_mtp_from_must_match_the_gguf_model(tiny) -> None:
    from sangama_p2p.errors import CheckpointError
    from helpers import LLAMA_Q4KM, QWEN_Q4KM

    with pytest.raises(CheckpointError, match="does not match the GGUF model"):
        open_gguf(QWEN_Q4KM, mtp_from=tiny["qwen3_5_moe"])  # hidden 64 vs the fixture's 16
    with pytest.raises(CheckpointError, match="does not match the GGUF model"):
        open_gguf(LLAMA_Q4KM, mtp_from=tiny["qwen3_5_moe"])
