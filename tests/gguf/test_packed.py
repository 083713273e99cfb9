"""Weights repacked for fused kernels (model/gguf/packed.py) multiply like their dequantized blocks."""

from __future__ import annotations

import os

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.gguf.packed import (Q4_1, Q5_1, FloatLinear, Int4Weight, inner_k_tiles, int4_codes, layout,
                                           repack)
from sangama_p2p.model.gguf.quantizer import quantize
from sangama_p2p.model.gguf.quants import QType, QuantTensor
from sangama_p2p.model.linear import FusedLinear

# max |fused - x @ dequantize(w).T| / max |x @ dequantize(w).T| over 7 rows of N(0, 1) activations. The error comes
# from bfloat16: activations, scales and zeros, and the kernel's output are rounded to it (2^-9 relative); two-plane
# types (two codes a weight, side by side in one group) sum both inside the kernel, in fp32, and round once.
# Measured (seeded, worst over the shapes below): Q4_0 5.5e-3, Q4_1 5.5e-3, Q4_K 4.0e-3, Q5_0 6.2e-3, Q5_1 4.0e-3,
# Q5_K 4.5e-3, Q8_0 4.4e-3, Q6_K 5.3e-3 (it was 4.4e-4 as an fp16 copy). Bound: 1e-2 for every type.
TOL = 1e-2
_SHAPES = {  # (rows, cols): 576 columns are not a multiple of 256; 100 and 40 rows are not multiples of 16
    32: [(576, 576), (100, 512), (40, 64), (16, 32)],
    256: [(576, 512), (100, 256), (16, 256)],
}
_BLOCK = {QType.Q4_0: 32, Q4_1: 32, QType.Q5_0: 32, Q5_1: 32, QType.Q8_0: 32, QType.Q4_K: 256, QType.Q5_K: 256,
          QType.Q6_K: 256}
_TYPE_SIZE = {Q4_1: 20, Q5_1: 24, QType.Q5_K: 176}


@pytest.fixture(autouse=True)
def _int4(torch_kernels) -> None:
    """These are the tests of torch's int4 layouts: ggml's kernels (tests/gguf/test_ggml_kernels.py) stay out."""


def _blocks(qtype: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, row_bytes]: our quantizer's blocks of Gaussian weights where it has one, else random bytes with
    sane fp16 scales (Q4_1, Q5_1, Q5_K)."""
    rng = np.random.default_rng(seed)
    if qtype not in _TYPE_SIZE:
        return quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype)
    bs, ts = _BLOCK[qtype], _TYPE_SIZE[qtype]
    b = rng.integers(0, 256, size=(rows * cols // bs, ts), dtype=np.uint8)
    heads = (rng.standard_normal((b.shape[0], 2)) * 0.003).astype(np.float16)
    if qtype == QType.Q5_K:
        heads = np.abs(heads)
    b[:, 0:4] = heads.view(np.uint8)
    return b.reshape(rows, -1)


def _reference(qtype: int, blocks: np.ndarray, cols: int) -> torch.Tensor:
    """gguf-py's dequantization (the reference for types our quants.py may not read)."""
    w = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).reshape(blocks.shape[0], cols)


_CASES = [(q, r, c) for q in _BLOCK for r, c in _SHAPES[_BLOCK[q]]]


@pytest.mark.parametrize("qtype,rows,cols", _CASES, ids=[f"{gguf.GGMLQuantizationType(q).name}-{r}x{c}"
                                                          for q, r, c in _CASES])
def test_fused_product_equals_dequantized_product(qtype: int, rows: int, cols: int) -> None:
    blocks = _blocks(qtype, rows, cols)
    qt = QuantTensor(qtype, torch.from_numpy(blocks), cols)
    w = _reference(qtype, blocks, cols)
    fused = repack(qt, torch.float32)
    assert isinstance(fused, Int4Weight)
    assert fused.shape == (rows, cols)
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(1))
    ref = x @ w.t()
    got = fused.linear(x)
    assert got.dtype == torch.float32 and got.shape == (7, rows)
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < TOL, err
    # a leading batch dimension and a bias go through too
    bias = torch.randn(rows)
    assert torch.allclose(fused.linear(x[None], bias)[0], got + bias)


@pytest.mark.parametrize("qtype", sorted(_BLOCK), ids=[gguf.GGMLQuantizationType(q).name for q in sorted(_BLOCK)])
def test_int4_codes_are_exact(qtype: int) -> None:
    """In fp32, (code - 8) * scale + zero, summed over a weight's codes weighted as the activations are (1 and 16 for
    the two-code types), is the dequantized weight: the layout loses nothing; only the bfloat16 rounding of the
    scales and zeros (and of the activations) remains."""
    cols, rows = 512, 48
    blocks = _blocks(qtype, rows, cols)
    codes, scale, zero = int4_codes(qtype, torch.from_numpy(blocks), cols)
    per, group = layout(qtype)
    assert codes.shape == (rows, per * cols) and scale.shape == zero.shape == (rows, per * cols // group)
    assert int(codes.max()) <= 15 and int(codes.min()) >= 0
    value = (codes.float() - 8) * scale.repeat_interleave(group, -1) + zero.repeat_interleave(group, -1)
    if per == 2:  # each group: G low codes, then G high codes taken 16 times
        g = group // 2
        halves = value.view(rows, cols // g, 2, g)
        value = (halves[:, :, 0] + 16 * halves[:, :, 1]).reshape(rows, cols)
    ref = _reference(qtype, blocks, cols)
    assert float((value - ref).abs().max()) <= 1e-6 * float(ref.abs().max())


def test_int4_kernel_convention() -> None:
    """torch's CPU int4 kernel computes w = (q - 8) * scale + zero from scales_and_zeros [K/32, N, 2]."""
    g = torch.Generator().manual_seed(0)
    n, k = 32, 64
    q = torch.randint(0, 16, (n, k), dtype=torch.int32, generator=g)
    s, z = torch.rand(k // 32, n, generator=g) + 0.5, torch.randn(k // 32, n, generator=g)
    sz = torch.stack((s, z), dim=-1).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz).float()
    sf, zf = sz[..., 0].float().t().repeat_interleave(32, 1), sz[..., 1].float().t().repeat_interleave(32, 1)
    ref = x.float() @ ((q - 8) * sf + zf).t()
    assert float((y - ref).abs().max()) < 1e-2 * float(ref.abs().max())
    wrong = x.float() @ (q * sf + zf).t()  # (and not w = q * scale + zero)
    assert float((y - wrong).abs().max()) > 0.1 * float(ref.abs().max())


@pytest.mark.parametrize("qtype,cols", [(QType.Q8_0, 2304), (QType.Q4_K, 512)])
def test_dense_view_of_a_packed_weight(qtype: int, cols: int) -> None:
    """``weights.dense`` still works on a repacked weight (rare dense uses): what the kernel multiplies by."""
    from sangama_p2p.model.weights import dense

    qt = QuantTensor(qtype, torch.from_numpy(_blocks(qtype, 40, cols)), cols)
    ref = qt.dequantize(torch.float32)
    got = dense(repack(qt, torch.float32), torch.float32)
    assert got.shape == ref.shape and float((got - ref).abs().max()) < TOL * float(ref.abs().max())


def test_memory_of_repacked_weights() -> None:
    """Bytes held per byte of blocks: 1.11x for Q4 types (bf16 scale + zero per 32 weights), 1.06x for Q8_0 and 1.64x
    for Q5_0 (two codes and a scale and zero per 32 weights), 1.52x for Q6_K (two codes, a scale and zero per 16)."""
    for qtype, ratio in ((QType.Q4_0, 1.112), (QType.Q4_K, 1.112), (QType.Q8_0, 1.059), (QType.Q5_0, 1.637),
                         (QType.Q6_K, 1.524)):
        qt = QuantTensor(qtype, torch.from_numpy(_blocks(qtype, 576, 512)), 512)
        assert repack(qt, torch.float32).nbytes <= ratio * qt.nbytes, gguf.GGMLQuantizationType(qtype).name


@pytest.mark.parametrize("parts,products", [([576, 192, 192], 1), ([64, 40], 1), ([40, 64], 2),
                                            ([1024, 512, 8, 8], 2), ([8, 64, 8], 2), ([8, 8, 8], 3)])
def test_concatenated_projections_equal_the_parts(parts: list[int], products: int) -> None:
    """FusedLinear joins repacked q/k/v (or gate/up) into one product when the packed layout allows it, and parts
    that cannot all be joined in runs, in order (a part that fills no whole 64-row tile ends a run: a Gated
    DeltaNet's q/k/v, z, beta and alpha are two products)."""
    cols = 576
    weights = [repack(QuantTensor(QType.Q8_0, torch.from_numpy(_blocks(QType.Q8_0, r, cols, seed=i)), cols),
                      torch.float32) for i, r in enumerate(parts)]
    fl = FusedLinear(weights)
    assert len(fl.parts) == products
    assert sum(len(s) for s in fl.splits) == len(parts)
    x = torch.randn(3, cols)
    got = fl(x)
    assert len(got) == len(parts)
    for y, w in zip(got, weights):
        assert torch.allclose(y, w.linear(x), atol=1e-6)


def test_float16_weights_multiply_in_fp16_without_overflow() -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 64, generator=g) * 0.05).half()
    fused = repack(w, torch.float32)
    assert isinstance(fused, FloatLinear) and fused.weight is w  # no copy: the file's F16 bytes themselves
    x = torch.randn(5, 64, generator=g)
    ref = x @ w.float().t()
    assert float((fused.linear(x) - ref).abs().max()) < 2e-3 * float(ref.abs().max())
    big = x * 1e6  # beyond fp16's range: scaled into it and back
    out = fused.linear(big)
    assert torch.isfinite(out).all()
    assert float((out - big @ w.float().t()).abs().max()) < 2e-3 * float((big @ w.float().t()).abs().max())


def test_what_repack_leaves_alone() -> None:
    f32 = torch.randn(8, 8)
    assert repack(f32, torch.float32) is f32  # already the compute dtype
    assert torch.equal(repack(f32, torch.bfloat16), f32.bfloat16())  # a router of a bf16 stage: cast once
    norm = torch.randn(8).half()
    assert repack(norm, torch.float32) is norm  # 1-D: turned into the compute dtype where it is loaded


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_K, QType.Q6_K])
def test_column_permuted_blocks(qtype: int) -> None:
    """Blocks whose columns llama.cpp reordered (ssm_out): packed as stored, the activations reordered per call."""
    cols = 512
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(0))
    qt = QuantTensor(qtype, torch.from_numpy(_blocks(qtype, 64, cols)), cols, perm)
    x = torch.randn(3, cols)
    ref = x @ qt.dequantize(torch.float32).t()
    got = repack(qt, torch.float32).linear(x)
    assert float((got - ref).abs().max()) < TOL * float(ref.abs().max())


def test_packed_weights_stay_on_the_cpu() -> None:
    qt = QuantTensor(QType.Q4_0, torch.from_numpy(_blocks(QType.Q4_0, 16, 64)), 64)
    w = repack(qt, torch.float32)
    assert w.to("cpu") is w
    with pytest.raises(UnsupportedModelError):
        w.to("meta")


SMOL_Q4_1 = Path(os.environ.get("SANGAMA_TEST_MODELS") or Path.home() / ".cache" / "sangama-test") / "SmolLM2-135M-Instruct.Q4_1.gguf"  # .ci/fetch-models


@pytest.mark.skipif(not SMOL_Q4_1.is_file(), reason="SmolLM2-135M Q4_1 file not found")
def test_real_q4_1_blocks() -> None:
    """The shipped SmolLM2 Q4_1 file's blocks (read with gguf-py: our reader learns Q4_1 elsewhere) repack exactly;
    576 columns, 192 rows. Measured 3.3e-3 - 4.2e-3."""
    reader = gguf.GGUFReader(SMOL_Q4_1)
    wanted = {"blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight"}
    seen = 0
    for t in reader.tensors:
        if t.name not in wanted:
            continue
        assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
        raw = np.asarray(t.data)
        cols, rows = int(t.shape[0]), int(t.shape[1])
        w = torch.from_numpy(gguf.quants.dequantize(raw, t.tensor_type).reshape(rows, cols).astype(np.float32))
        fused = repack(QuantTensor(Q4_1, torch.from_numpy(raw.reshape(rows, -1).copy()), cols), torch.float32)
        x = torch.randn(4, cols, generator=torch.Generator().manual_seed(0))
        ref = x @ w.t()
        assert float((fused.linear(x) - ref).abs().max()) < TOL * float(ref.abs().max()), t.name
        seen += 1
    assert seen == len(wanted)


def test_q6_k_beyond_fp16s_range() -> None:
    """Q6_K weights beyond fp16's 65504 (the fp16 copy it was held as before needed a bfloat16 fallback there):
    bfloat16 scales have fp32's range, so the int4 codes hold them like any other."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((40, 256)).astype(np.float32) * 3e4
    blocks = quantize(w, QType.Q6_K)
    fused = repack(QuantTensor(QType.Q6_K, torch.from_numpy(blocks), 256), torch.float32)
    ref = _reference(QType.Q6_K, blocks, 256)
    assert float(ref.abs().max()) > 65504
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    got = fused.linear(x)
    assert bool(torch.isfinite(got).all())
    assert float((got - x @ ref.t()).abs().max()) < TOL * float((x @ ref.t()).abs().max())


def test_a_q6_k_head_is_held_in_float16_and_in_bfloat16_beyond_its_range() -> None:
    """The output head (``head=True``) in Q6_K is an fp16 copy (11 significant bits: the logits keep fp16's
    resolution), a bfloat16 one where a weight exceeds fp16's 65504; other types of head go to the int4 kernel."""
    rng = np.random.default_rng(3)
    for scale, dtype in ((0.05, torch.float16), (3e4, torch.bfloat16)):
        w = rng.standard_normal((40, 256)).astype(np.float32) * scale
        blocks = quantize(w, QType.Q6_K)
        fused = repack(QuantTensor(QType.Q6_K, torch.from_numpy(blocks), 256), torch.float32, head=True)
        assert isinstance(fused, FloatLinear) and fused.weight.dtype == dtype
        ref = _reference(QType.Q6_K, blocks, 256)
        assert bool(torch.isfinite(fused.weight).all())
        assert float((fused.weight.float() - ref).abs().max()) <= 2 ** -8 * float(ref.abs().max())
    q8 = QuantTensor(QType.Q8_0, torch.from_numpy(_blocks(QType.Q8_0, 16, 64)), 64)
    assert isinstance(repack(q8, torch.float32, head=True), Int4Weight)


# ---- the CUDA layout ----------------------------------------------------------------------------------------------


def test_inner_k_tiles() -> None:
    assert [inner_k_tiles(k) for k in (576, 1152, 96, 2048)] == [4, 8, 2, 8]
    with pytest.raises(UnsupportedModelError, match="multiple of 32"):
        inner_k_tiles(48)


@pytest.mark.parametrize("qtype,rows,cols", [(QType.Q4_0, 100, 576), (QType.Q8_0, 100, 576), (QType.Q4_K, 40, 512),
                                             (QType.Q5_0, 16, 96)])
def test_cuda_layout_shapes_through_torchs_shape_functions(monkeypatch, qtype: int, rows: int, cols: int) -> None:
    """Without a GPU: the CUDA packing, the kernel's call and the joins run on fake CUDA tensors (torch's
    FakeTensorMode, whose shapes come from the two CUDA ops' own meta functions), so the shapes, dtypes and device
    our packing hands them are ones they take. (The numbers are checked on a GPU: the cuda-marked tests below.)"""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from sangama_p2p.model.gguf import packed

    # fake tensors cannot be copied across devices without CUDA: a moved tensor is a fresh fake one on the device
    monkeypatch.setattr(packed, "_to_device", lambda t, dev: t if dev.type == "cpu" else torch.empty_like(t, device=dev))
    qt = QuantTensor(qtype, torch.from_numpy(_blocks(qtype, rows, cols)), cols)
    per, group = layout(qtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        w = packed.pack_int4(qt, device="cuda")
        big = -(-rows // 16) * 16
        tiles = inner_k_tiles(per * cols)
        assert w.packed.device.type == "cuda" and w.packed.dtype == torch.int32
        assert tuple(w.packed.shape) == (big // 8, per * cols // (16 * tiles), 32, tiles // 2)
        assert w.padded == big and tuple(w.scales_zeros.shape) == (per * cols // group, big, 2)
        assert w.scales_zeros.device.type == "cuda" and w.scales_zeros.dtype == torch.bfloat16
        # the kernel's call as product() makes it (fake CUDA tensors cannot take the strided views around it)
        x = torch.randn(3, per * cols, device="cuda", dtype=torch.bfloat16)
        y = torch.ops.aten._weight_int4pack_mm(x, w.packed, group, w.scales_zeros)
        assert tuple(y.shape) == (3, big) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
        assert w.to("cuda") is w
        with pytest.raises(UnsupportedModelError, match="packed for cuda"):
            w.to("cpu")
        tile = packed.pack_int4(QuantTensor(qtype, torch.from_numpy(_blocks(qtype, 64, cols, seed=1)), cols),
                                device="cuda")
        joined = Int4Weight.concat([tile, w])  # a whole 64-row tile, then the rest
        assert joined is not None and joined.n == 64 + rows and joined.padded == 64 + big
        y = torch.ops.aten._weight_int4pack_mm(x, joined.packed, group, joined.scales_zeros)
        assert tuple(y.shape) == (3, 64 + big)


def test_repack_for_cuda_without_a_working_kernel_keeps_the_blocks(monkeypatch) -> None:
    """Where torch's CUDA int4 kernel does not run (or disagrees), int4 types stay quantized, dequantized per use."""
    from sangama_p2p.model.gguf import packed

    monkeypatch.setattr(packed, "_CUDA_CHECKED", {torch.device("cuda", 0): False})
    qt = QuantTensor(QType.Q4_K, torch.from_numpy(_blocks(QType.Q4_K, 16, 256)), 256)
    assert repack(qt, torch.bfloat16, device="cuda:0") is qt


def test_probe_of_a_missing_kernel_is_a_warning_not_an_error(caplog) -> None:
    """The probe of a device whose kernel cannot run answers False, with one warning naming the device."""
    from sangama_p2p.model.gguf import packed

    with caplog.at_level("WARNING"):
        ok = packed._probe_cuda_int4(torch.device("meta"))  # (meta tensors: the product cannot be compared)
    assert ok is False and "dequantized per use" in caplog.text


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.cuda
@_CUDA
def test_cuda_int4_kernel_passes_its_probe() -> None:
    from sangama_p2p.model.gguf.packed import cuda_int4_works

    assert cuda_int4_works("cuda:0")


@pytest.mark.cuda
@_CUDA
@pytest.mark.parametrize("qtype,rows,cols", _CASES, ids=[f"{gguf.GGMLQuantizationType(q).name}-{r}x{c}"
                                                          for q, r, c in _CASES])
def test_fused_product_on_cuda_equals_dequantized_product(qtype: int, rows: int, cols: int) -> None:
    """The same bound as on the CPU, every type in the CUDA kernel's layout."""
    blocks = _blocks(qtype, rows, cols)
    qt = QuantTensor(qtype, torch.from_numpy(blocks), cols)
    fused = repack(qt, torch.bfloat16, device="cuda:0")
    assert isinstance(fused, Int4Weight) and fused.packed.is_cuda and fused.packed.dim() == 4
    x = torch.randn(7, cols, generator=torch.Generator().manual_seed(1))
    ref = x @ _reference(qtype, blocks, cols).t()
    got = fused.linear(x.cuda()).float().cpu()
    err = float((got - ref).abs().max() / ref.abs().max())
    assert err < TOL, err
    assert float((dense_of(fused) - _reference(qtype, blocks, cols)).abs().max()) < TOL * float(ref.abs().max())


def dense_of(w: Int4Weight) -> torch.Tensor:
    return w.dequantize(torch.float32).cpu()
