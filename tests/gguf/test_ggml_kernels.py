"""GGUF blocks multiplied as stored by ggml's kernels (model/gguf/ggml_kernels.py)."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from test_packed import _CASES, _blocks, _reference

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.gguf import ggml_kernels, open_gguf, write_gguf
from sangama_p2p.model.gguf.ggml_kernels import GgmlExperts, GgmlWeight, binding, ggml_weight
from sangama_p2p.model.gguf.packed import Int4Weight, pack_int4, repack
from sangama_p2p.model.gguf.quantizer import quantize
from sangama_p2p.model.gguf.quants import QType, QuantTensor
from sangama_p2p.model.linear import pad_rows
from sangama_p2p.model.make import make_model
from sangama_p2p.model.stage import StageModel
from sangama_p2p.model.weights import weight_nbytes

pytestmark = pytest.mark.skipif(binding() is None, reason="ggml-python is not installed or failed its probe")


@pytest.fixture(autouse=True)
def _every_type(monkeypatch) -> None:
    """ggml for every type (``auto`` leaves Q4_0/Q4_1 to torch's int4 kernel: its own test below)."""
    monkeypatch.setenv(ggml_kernels.KERNELS_ENV, "ggml")

# max |ggml - x @ dequantize(w).T| / max |x @ dequantize(w).T| (test_packed.py's measure, 7 rows of N(0, 1)). ggml
# quantizes the activations per block to the weight's dot-product type (Q8_K for the K-quants, Q8_0/Q8_1 for the
# 32-blocks) as llama.cpp does: more error than torch's bfloat16 activations. Measured (seeded, worst over the
# shapes): Q4_0 9.2e-3, Q4_1 1.25e-2, Q5_0 8.9e-3, Q5_1 7.3e-3, Q8_0 9.1e-3, Q4_K 9.7e-3, Q5_K 1.1e-2, Q6_K 9.7e-3
# (Q4_1, Q5_1 and Q5_K of random bytes). Bound: 1.5e-2 (torch's int4 layouts: 1e-2).
TOL = 1.5e-2


def _within_rounding(got: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> bool:
    """The bound that cannot flake: ggml rounds each activation to a step of at most ``amax(block) / 127`` (Q8_0,
    Q8_1, Q8_K), so an output moves by at most ``sum_j |w_ij| * amax(row) / 254`` (2% slack for the float16 scale and
    float32 sums) from the exact product."""
    bound = (x.abs().amax(dim=1, keepdim=True) / 254) @ dense.abs().sum(dim=1, keepdim=True).t()
    return bool(((got - x @ dense.t()).abs() <= bound * 1.02 + 1e-5).all())


@pytest.mark.parametrize("qtype,rows,cols", _CASES, ids=[f"{gguf.GGMLQuantizationType(q).name}-{r}x{c}"
                                                          for q, r, c in _CASES])
def test_ggml_product_equals_dequantized_product(qtype: int, rows: int, cols: int) -> None:
    blocks = _blocks(qtype, rows, cols)
    w = ggml_weight(QuantTensor(qtype, torch.from_numpy(blocks), cols))
    assert isinstance(w, GgmlWeight) and w.shape == (rows, cols) and w.nbytes == blocks.nbytes
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(1))
    ref = x @ _reference(qtype, blocks, cols).t()
    got = w.linear(x)
    assert got.dtype == torch.float32 and got.shape == (7, rows)
    assert float((got - ref).abs().max() / ref.abs().max()) < TOL
    assert _within_rounding(got, x, _reference(qtype, blocks, cols))
    # bfloat16 in, bfloat16 out; a leading batch dimension and a bias
    bias = torch.randn(rows)
    assert torch.allclose(w.linear(x[None], bias)[0], got + bias)
    assert w.linear(x.bfloat16()).dtype == torch.bfloat16
    assert torch.equal(w.dequantize(), _reference(qtype, blocks, cols))


def test_the_blocks_are_the_files_not_a_copy() -> None:
    blocks = torch.from_numpy(_blocks(QType.Q4_K, 64, 256))
    w = repack(QuantTensor(QType.Q4_K, blocks, 256), torch.float32)
    assert isinstance(w, GgmlWeight) and w.blocks.data_ptr() == blocks.data_ptr()


@pytest.mark.parametrize("qtype", [QType.Q4_0, QType.Q8_0, QType.Q4_K, QType.Q6_K],
                         ids=lambda q: gguf.GGMLQuantizationType(q).name)
def test_a_rows_product_does_not_depend_on_its_batch(qtype: int) -> None:
    """In the batch-invariant mode's row counts (multiples of 16) each row is its own dot products, whatever the
    batch - repacked weights included, whose kernels take rows four at a time (one row alone, outside that mode, goes
    through their GEMV: equal to rounding) - and graphs kept for small batches give what graphs built per call for
    big ones give."""
    cols = 512
    w = ggml_weight(QuantTensor(qtype, torch.from_numpy(_blocks(qtype, 96, cols)), cols))
    x = torch.randn(112, cols, generator=torch.Generator().manual_seed(2))
    alone = torch.cat([w.product(pad_rows(x[i : i + 1], 16))[:1] for i in range(0, 112, 9)])
    for m in (16, 64, 112):  # 64: the largest graph kept; 112: built per call
        assert torch.equal(w.product(x[:m])[::9], alone[: len(range(0, m, 9))])
    one = torch.cat([w.product(x[i : i + 1]) for i in range(0, 112, 9)])
    assert float((one - alone).abs().max()) <= 1e-5 * float(alone.abs().max())


def test_joined_projections_equal_the_parts() -> None:
    cols = 256
    parts = [ggml_weight(QuantTensor(QType.Q4_K, torch.from_numpy(_blocks(QType.Q4_K, r, cols, seed=r)), cols))
             for r in (32, 8, 40)]
    assert GgmlWeight.joinable(parts)
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(4))
    want = torch.cat([p.product(x) for p in parts], dim=1)  # (before the join: each part's own layout)
    one = GgmlWeight.concat(parts)
    assert torch.equal(one.product(x), want)
    other = ggml_weight(QuantTensor(QType.Q8_0, torch.from_numpy(_blocks(QType.Q8_0, 32, cols)), cols))
    assert not GgmlWeight.joinable([parts[0], other]) and GgmlWeight.concat([parts[0], other]) is None


def test_column_permuted_blocks() -> None:
    """llama.cpp reorders the columns of ``ssm_out``: the activations are reordered instead of the blocks."""
    cols = 256
    blocks = _blocks(QType.Q4_K, 32, cols)
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(3))
    w = ggml_weight(QuantTensor(QType.Q4_K, torch.from_numpy(blocks), cols, perm))
    dense = _reference(QType.Q4_K, blocks, cols)[:, perm]  # what the per-use path gives
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(5))
    ref = x @ dense.t()
    assert float((w.product(x) - ref).abs().max() / ref.abs().max()) < TOL
    assert _within_rounding(w.product(x), x, dense)
    assert torch.equal(w.dequantize(), dense)


def test_malformed_blocks_are_refused() -> None:
    with pytest.raises(UnsupportedModelError):
        GgmlWeight(torch.zeros(4, 100, dtype=torch.uint8), QType.Q4_K, 256)  # a Q4_K row of 256 is 144 bytes
    assert ggml_weight(QuantTensor(QType.Q4_K, torch.zeros(8, 288, dtype=torch.uint8)[:, ::2], 256)) is None
    with pytest.raises(UnsupportedModelError):
        GgmlWeight(torch.zeros(4, 144, dtype=torch.uint8), QType.Q4_K, 256).to("meta")


def _stacked(qtype: int, experts: int, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, list[GgmlWeight]]:
    """A stacked ``[E, rows, row_bytes]`` tensor of blocks and its experts as views (as GGUFSource gives them)."""
    rng = np.random.default_rng(seed)
    full = torch.from_numpy(np.stack([quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
                                      for _ in range(experts)]))
    return full, [ggml_weight(QuantTensor(qtype, full[e], cols)) for e in range(experts)]


@pytest.mark.parametrize("fused_halves", [False, True], ids=["gate-up-apart", "gate-up-one-tensor"])
def test_grouped_experts_equal_each_experts_products(fused_halves: bool) -> None:
    """The routed experts as ggml_mul_mat_id products over the stacked blocks (gate and up apart, or the two halves
    of one ``gate_up`` tensor) give each row's experts' SwiGLU, weighted and summed."""
    e_num, hidden, inter, k = 8, 256, 64, 3
    if fused_halves:
        full, _ = _stacked(QType.Q4_K, e_num, 2 * inter, hidden, 0)
        gates = [ggml_weight(QuantTensor(QType.Q4_K, full[e, :inter], hidden)) for e in range(e_num)]
        ups = [ggml_weight(QuantTensor(QType.Q4_K, full[e, inter:], hidden)) for e in range(e_num)]
    else:
        _, gates = _stacked(QType.Q4_K, e_num, inter, hidden, 0)
        _, ups = _stacked(QType.Q4_K, e_num, inter, hidden, 1)
    _, downs = _stacked(QType.Q8_0, e_num, hidden, inter, 2)
    grouped = GgmlWeight.group_experts(gates, ups, downs)
    assert isinstance(grouped, GgmlExperts) and len(grouped.weights()) == 3 * e_num
    gen = torch.Generator().manual_seed(4)
    for n in (1, 5):
        x = torch.randn(n, hidden, generator=gen)
        top_i = torch.stack([torch.randperm(e_num, generator=gen)[:k] for _ in range(n)])
        top_w = torch.rand(n, k, generator=gen)
        want = torch.zeros(n, hidden)
        for r in range(n):
            for slot in range(k):
                e = int(top_i[r, slot])
                h = torch.nn.functional.silu(gates[e].product(x[r : r + 1])) * ups[e].product(x[r : r + 1])
                want[r] += top_w[r, slot] * downs[e].product(h)[0]
        torch.testing.assert_close(grouped(x, top_i, top_w), want, rtol=1e-4, atol=1e-5)


def test_experts_that_are_not_one_stride_apart_are_not_grouped() -> None:
    _, gates = _stacked(QType.Q4_K, 4, 64, 256, 0)
    _, ups = _stacked(QType.Q4_K, 4, 64, 256, 1)
    _, downs = _stacked(QType.Q8_0, 4, 256, 64, 2)
    assert GgmlWeight.group_experts(gates, ups, downs) is not None
    assert GgmlWeight.group_experts(gates[::-1], ups, downs) is None  # not ascending at one stride
    size = gates[0].blocks.numel()  # copies at uneven gaps (clones of equal size may land one stride apart)
    buf = torch.empty(4 * size + 6 * 64, dtype=torch.uint8)
    offs = [e * size + e * (e + 1) // 2 * 64 for e in range(4)]
    apart = [ggml_weight(QuantTensor(QType.Q4_K, buf[o:o + size].view_as(g.blocks).copy_(g.blocks), 256))
             for o, g in zip(offs, gates)]
    assert GgmlWeight.group_experts(apart, ups, downs) is None
    int4 = [pack_int4(QuantTensor(QType.Q4_K, g.blocks, 256)) for g in gates]  # torch's kernels: not grouped
    assert GgmlWeight.group_experts(int4, ups, downs) is None
    assert GgmlWeight.group_experts(gates, ups, downs[:3] + downs[:1]) is None


def test_a_moe_stage_holds_the_files_blocks_and_groups_its_experts(tmp_path: Path) -> None:
    hf = make_model(tmp_path / "hf", "qwen3_5_moe", "tiny")
    (path,) = write_gguf(hf, tmp_path / "m.gguf", "Q4_K")
    spec, src, _ = open_gguf(path)
    stage = StageModel.load(spec, src, 0, spec.num_layers)
    moe = stage.layers[0].ffn
    assert isinstance(moe.grouped, GgmlExperts) and moe.experts == []
    quantized = [w for layer in stage.layers.values() for w in layer.weights() if isinstance(w, GgmlWeight)]
    assert quantized and not any(isinstance(w, Int4Weight) for la in stage.layers.values() for w in la.weights())
    in_file = sum(src.nbytes_in_file(n) for n in set(stage.loaded_names) if n.startswith("model.layers.")
                  and src.file.tensors[src._index[n].gguf].is_quantized)
    held = sum(weight_nbytes(w) for w in quantized)
    assert held == in_file, (held, in_file)


def test_the_kernels_of_each_mode(monkeypatch) -> None:
    """``auto`` takes ggml for Q4_K and the types torch's int4 layout holds as two codes a weight or not at all, and
    leaves Q4_0/Q4_1 to torch's kernel (measured faster there); ``ggml`` takes every type, ``torch`` none."""
    def kind(qtype: int) -> str:
        rows, cols = 32, 256
        w = repack(QuantTensor(qtype, torch.from_numpy(_blocks(qtype, rows, cols)), cols), torch.float32)
        return "ggml" if isinstance(w, GgmlWeight) else "int4" if isinstance(w, Int4Weight) else type(w).__name__

    types = [QType.Q4_0, QType.Q4_1, QType.Q4_K, QType.Q5_0, QType.Q5_K, QType.Q6_K, QType.Q8_0]
    monkeypatch.delenv(ggml_kernels.KERNELS_ENV)
    assert [kind(q) for q in types] == ["int4"] * 2 + ["ggml"] * 5
    monkeypatch.setenv(ggml_kernels.KERNELS_ENV, "auto")
    assert [kind(q) for q in types] == ["int4"] * 2 + ["ggml"] * 5
    monkeypatch.setenv(ggml_kernels.KERNELS_ENV, "ggml")
    assert [kind(q) for q in types] == ["ggml"] * 7
    monkeypatch.setenv(ggml_kernels.KERNELS_ENV, "torch")
    assert [kind(q) for q in types] == ["int4"] * 7
    monkeypatch.setenv(ggml_kernels.KERNELS_ENV, "fastest")
    with pytest.raises(UnsupportedModelError):
        kind(QType.Q8_0)


def test_a_binding_that_fails_its_probe_is_not_used(monkeypatch, caplog) -> None:
    try:
        binding.cache_clear()
        monkeypatch.setattr(ggml_kernels, "_probe_passes", lambda: False)
        with caplog.at_level(logging.WARNING):
            assert binding() is None
        assert "failed their probe" in caplog.text
        assert ggml_weight(QuantTensor(QType.Q8_0, torch.zeros(16, 34 * 8, dtype=torch.uint8), 256)) is None
    finally:
        monkeypatch.undo()
        binding.cache_clear()
    assert binding() is not None


def test_the_probe_runs_in_a_child_process(tmp_path: Path, monkeypatch) -> None:
    """The probe's pass is remembered on disk; without the mark a child process runs it (and passes here)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ggml_kernels._probe_passes()
    marks = list((tmp_path / "sangama").glob("ggml-probe-*"))
    assert len(marks) == 1
    assert ggml_kernels._probe_passes()  # from the mark


@pytest.mark.parametrize("qtype", [QType.Q2_K, QType.Q3_K, QType.IQ4_NL, QType.IQ4_XS],
                         ids=lambda q: gguf.GGMLQuantizationType(q).name)
def test_types_torchs_kernels_dequantize_per_use(qtype: int) -> None:
    """The types torch's int4 layouts do not take are multiplied as stored too (blocks from ggml's own quantizer),
    and our dequantization of them is ggml's."""
    import ctypes

    lib = binding()
    rows, cols = 32, 512
    src = np.random.default_rng(5).standard_normal((rows, cols)).astype(np.float32) * 0.05
    blocks = np.zeros((rows, lib.ggml_row_size(qtype, cols)), dtype=np.uint8)
    lib.ggml_quantize_chunk(qtype, src.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), blocks.ctypes.data, 0, rows,
                            cols, None)
    qt = QuantTensor(qtype, torch.from_numpy(blocks), cols)
    w = repack(qt, torch.float32)
    assert isinstance(w, GgmlWeight)
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(6))
    ref = x @ qt.dequantize(torch.float32).t()
    assert float((w.product(x) - ref).abs().max() / ref.abs().max()) < TOL
    back = qt.dequantize(torch.float32)  # our reading of ggml's blocks is near what was quantized (2 bits: coarse)
    assert float((back - torch.from_numpy(src)).norm() / torch.from_numpy(src).norm()) < 0.5
