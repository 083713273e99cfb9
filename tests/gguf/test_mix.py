"""llama.cpp's per-tensor type choice (``plan_types``) against files llama-quantize made, and its rules one by one."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import LLAMA_F16, LLAMA_Q4KM, QWEN_F32, QWEN_Q4KM

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.gguf.mix import TensorPlan, plan_types
from sangama_p2p.model.gguf.quants import QType, type_name
from sangama_p2p.model.gguf.reader import GGUFFile
from sangama_p2p.model.gguf.requantize import plan_file

LQ_REF = Path(__file__).parent / "data" / "smollm2-llama-quantize.json"


def _plan(f: GGUFFile, preset: str) -> dict[str, str]:
    return {n: type_name(t) for n, t in plan_file(f, preset).items()}


@pytest.mark.parametrize("src,made", [(LLAMA_F16, LLAMA_Q4KM), (QWEN_F32, QWEN_Q4KM)], ids=["llama", "qwen35moe"])
def test_q4_k_m_mix_equals_llama_quantize_on_the_fixtures(src: Path, made: Path) -> None:
    """The fixtures' Q4_K_M files were made by llama-quantize (from F16): every tensor's type must match."""
    f, ref = GGUFFile(src), GGUFFile(made)
    ours = _plan(f, "Q4_K_M")
    theirs = {n: i.type_name for n, i in ref.tensors.items()}
    assert ours == theirs


def _smol_like(cols: int = 576, layers: int = 30, tied: bool = True) -> list[TensorPlan]:
    t = [TensorPlan("token_embd.weight", (49152, cols), QType.Q8_0), TensorPlan("output_norm.weight", (cols,), 0)]
    if not tied:
        t.append(TensorPlan("output.weight", (49152, cols), QType.F16))
    for i in range(layers):
        t += [
            TensorPlan(f"blk.{i}.attn_norm.weight", (cols,), QType.F32),
            TensorPlan(f"blk.{i}.attn_q.weight", (cols, cols), QType.Q4_1),
            TensorPlan(f"blk.{i}.attn_k.weight", (192, cols), QType.Q4_1),
            TensorPlan(f"blk.{i}.attn_v.weight", (192, cols), QType.Q4_1),
            TensorPlan(f"blk.{i}.attn_output.weight", (cols, cols), QType.Q4_1),
            TensorPlan(f"blk.{i}.ffn_gate.weight", (1536, cols), QType.Q4_1),
            TensorPlan(f"blk.{i}.ffn_up.weight", (1536, cols), QType.Q4_1),
            TensorPlan(f"blk.{i}.ffn_down.weight", (cols, 1536), QType.Q4_1),
        ]
    return t


MORE_BITS_30 = {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29}  # use_more_bits(i, 30)


def test_q4_k_m_rules_for_a_576_wide_model() -> None:
    """Rows of 576 are not whole Q4_K blocks: Q4_K -> Q5_0, Q6_K -> Q8_0; only ffn_down (rows of 1536) is K-quant;
    the tied embedding is the output (576 % 256 != 0 -> Q8_0)."""
    types = plan_types(_smol_like(), "Q4_K_M", arch="llama", n_layer=30)
    for i in range(30):
        more = i in MORE_BITS_30
        assert types[f"blk.{i}.attn_v.weight"] == (QType.Q8_0 if more else QType.Q5_0)
        assert types[f"blk.{i}.ffn_down.weight"] == (QType.Q6_K if more else QType.Q4_K)
        assert types[f"blk.{i}.attn_q.weight"] == QType.Q5_0
        assert types[f"blk.{i}.attn_norm.weight"] == QType.F32
    assert types["token_embd.weight"] == QType.Q8_0
    counts = Counter(type_name(t) for t in types.values())
    assert counts == {"F32": 31, "Q5_0": 166, "Q8_0": 15, "Q6_K": 14, "Q4_K": 16}


def test_q4_k_m_rules_for_a_512_wide_model() -> None:
    types = plan_types(_smol_like(512, tied=False), "Q4_K_M", arch="llama", n_layer=30)
    assert types["output.weight"] == QType.Q6_K and types["token_embd.weight"] == QType.Q4_K
    assert types["blk.5.attn_v.weight"] == QType.Q6_K and types["blk.4.attn_v.weight"] == QType.Q4_K
    tied = plan_types(_smol_like(512), "Q4_K_M", arch="llama", n_layer=30)
    assert tied["token_embd.weight"] == QType.Q6_K  # a tied embedding is quantized like the output


def test_other_presets() -> None:
    f16 = plan_types(_smol_like(), "F16", arch="llama", n_layer=30)
    assert f16["blk.0.attn_q.weight"] == QType.F16 and f16["token_embd.weight"] == QType.F16
    assert f16["blk.0.attn_norm.weight"] == QType.F32
    q8 = plan_types(_smol_like(), "Q8_0", arch="llama", n_layer=30)
    assert set(q8.values()) == {QType.Q8_0, QType.F32}
    q40 = plan_types(_smol_like(512, tied=False), "Q4_0", arch="llama", n_layer=30)
    assert q40["output.weight"] == QType.Q6_K and q40["blk.0.ffn_down.weight"] == QType.Q4_0
    odd = plan_types([TensorPlan("blk.0.ffn_up.weight", (8, 48), QType.F32)], "Q4_K_M", arch="llama", n_layer=1)
    assert odd["blk.0.ffn_up.weight"] == QType.F16  # rows of 48: neither Q4_K nor Q5_0 fits


def test_bad_presets_and_arches() -> None:
    with pytest.raises(UnsupportedModelError, match="preset 'Q3_K_S'"):
        plan_types(_smol_like(), "Q3_K_S", arch="llama", n_layer=30)
    with pytest.raises(UnsupportedModelError, match="falcon"):
        plan_types(_smol_like(), "Q4_K_M", arch="falcon", n_layer=30)


def test_llama_quantize_reference_is_consistent_with_the_rules() -> None:
    """The stored llama-quantize run on the real SmolLM2 file has the types plan_types gives for its shapes."""
    ref = json.loads(LQ_REF.read_text())["presets"]["Q4_K_M"]
    src = {t.name: t for t in _smol_like()}
    types = plan_types(list(src.values()), "Q4_K_M", arch="llama", n_layer=30)
    assert set(ref) == set(src) | {"blk.%d.ffn_norm.weight" % i for i in range(30)}
    assert all(ref[n][0] == type_name(types[n]) for n in src)
