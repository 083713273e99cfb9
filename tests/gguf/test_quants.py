"""Our torch dequantizers equal gguf-py's numpy reference bit for bit on random valid blocks."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.gguf.quants import (
    BLOCK_SIZES,
    QType,
    QuantTensor,
    dequantize_blocks,
    type_name,
)

# byte offsets of the fp16 scale fields in each block layout
_FP16_FIELDS = {
    QType.Q4_0: (0,),
    QType.Q4_1: (0, 2),
    QType.Q5_0: (0,),
    QType.Q5_1: (0, 2),
    QType.Q8_0: (0,),
    QType.Q2_K: (80, 82),
    QType.Q3_K: (108,),
    QType.Q4_K: (0, 2),
    QType.Q5_K: (0, 2),
    QType.Q6_K: (208,),
    QType.IQ4_NL: (0,),
    QType.IQ4_XS: (0,),
}
_EXTREME = np.array([65504.0, -65504.0, 6e-8, -6e-8, 6.1e-5, 1024.0], np.float16)  # fp16 max, smallest subnormal


def random_blocks(qtype: int, n: int, seed: int) -> np.ndarray:
    """Random bytes with finite fp16 scales (random NaN/inf bit patterns would make the comparison meaningless)."""
    rng = np.random.default_rng(seed)
    _, ts = BLOCK_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(n, ts), dtype=np.uint8)
    for off in _FP16_FIELDS[qtype]:
        scale = rng.standard_normal(n) * rng.choice([1e-4, 1e-2, 1.0, 100.0], n)
        scale = scale.astype(np.float16)
        scale[0] = np.float16(0.0)
        if n > 1:
            scale[1] = np.float16(-6.1e-5)  # subnormal neighbourhood
        if n > 2 + len(_EXTREME):
            scale[2 : 2 + len(_EXTREME)] = rng.permutation(_EXTREME)  # extreme scales (and mins) in every field
        blocks[:, off : off + 2] = scale.view(np.uint8).reshape(n, 2)
    return blocks


@pytest.mark.parametrize("qtype", sorted(_FP16_FIELDS), ids=lambda t: gguf.GGMLQuantizationType(t).name)
@pytest.mark.parametrize("seed", [0, 1])
def test_dequantize_bit_exact(qtype: int, seed: int) -> None:
    blocks = random_blocks(qtype, 257, seed)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).reshape(257, -1)
    ours = dequantize_blocks(qtype, torch.from_numpy(blocks))
    assert ours.dtype == torch.float32
    assert ours.shape == ref.shape
    assert np.array_equal(ours.numpy().view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("qtype", sorted(_FP16_FIELDS), ids=lambda t: gguf.GGMLQuantizationType(t).name)
def test_quant_tensor_rows_and_column_permutation(qtype: int) -> None:
    bs, ts = BLOCK_SIZES[qtype]
    rows, cols = 6, 2 * bs
    blocks = random_blocks(qtype, rows * cols // bs, 3)
    data = torch.from_numpy(blocks.reshape(rows, -1))
    ref = torch.from_numpy(gguf.quants.dequantize(blocks.reshape(rows, -1), gguf.GGMLQuantizationType(qtype)))
    qt = QuantTensor(qtype, data, cols)
    assert qt.shape == (rows, cols)
    assert qt.nbytes == rows * (cols // bs) * ts
    assert torch.equal(qt.dequantize(torch.float32), ref)
    assert qt.dequantize(torch.float16).dtype == torch.float16
    idx = torch.tensor([[4, 0], [5, 5]])
    assert torch.equal(qt.take_rows(idx), ref[idx])
    perm = torch.randperm(cols, generator=torch.Generator().manual_seed(0))
    assert torch.equal(QuantTensor(qtype, data, cols, perm).dequantize(torch.float32), ref[:, perm])


def test_every_read_type_is_in_the_tables() -> None:
    """Block sizes and names agree with gguf-py for every type we read; the other types keep gguf-py's names."""
    for qtype, (bs, ts) in BLOCK_SIZES.items():
        gt = gguf.GGMLQuantizationType(qtype)
        assert gguf.GGML_QUANT_SIZES[gt] == (bs, ts) and type_name(qtype) == gt.name
    assert set(BLOCK_SIZES) - {QType.F32, QType.F16, QType.BF16} == set(_FP16_FIELDS)
    assert type_name(int(gguf.GGMLQuantizationType.TQ1_0)) == "TQ1_0"
    assert type_name(250) == "ggml type 250"


def test_unsupported_type_is_typed() -> None:
    with pytest.raises(UnsupportedModelError, match=r"^IQ2_XXS is not supported; supported: F32, F16, Q4_0, Q4_1,"):
        dequantize_blocks(int(gguf.GGMLQuantizationType.IQ2_XXS), torch.zeros(1, 66, dtype=torch.uint8))
    with pytest.raises(UnsupportedModelError, match=r"^ggml type 250 is not supported; supported: F32,"):
        dequantize_blocks(250, torch.zeros(1, 66, dtype=torch.uint8))
    with pytest.raises(UnsupportedModelError, match="uint8"):
        dequantize_blocks(QType.Q8_0, torch.zeros(1, 33, dtype=torch.uint8))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("qtype", sorted(_FP16_FIELDS), ids=lambda t: gguf.GGMLQuantizationType(t).name)
def test_dequantize_bit_exact_on_cuda(qtype: int) -> None:
    blocks = random_blocks(qtype, 1031, 7)
    ref = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype)).reshape(1031, -1)
    ours = dequantize_blocks(qtype, torch.from_numpy(blocks).cuda())
    assert ours.is_cuda
    assert np.array_equal(ours.cpu().numpy().view(np.uint32), ref.astype(np.float32).view(np.uint32))
