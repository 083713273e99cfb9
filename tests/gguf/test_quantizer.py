"""Our Q4_K/Q6_K quantizers write valid ggml blocks: gguf-py reads them like we do, and they round-trip closely."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.gguf.quantizer import quantize
from sangama_p2p.model.gguf.quants import QType, QuantTensor

# relative RMS error bounds (measured on N(0,1) rows with outliers: see the test ids)
CASES = [
    (QType.Q4_K, 0.1),
    (QType.Q5_K, 0.05),
    (QType.Q6_K, 0.03),
    (QType.Q8_0, 0.01),
    (QType.Q4_1, 0.12),
    (QType.Q5_1, 0.06),
    (QType.Q5_0, 0.06),
]


@pytest.mark.parametrize("qtype,bound", CASES, ids=lambda c: gguf.GGMLQuantizationType(c).name if c > 1 else str(c))
def test_round_trip_close_and_readable_by_gguf(qtype: int, bound: float) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 512)).astype(np.float32)
    w[3, 7] = 25.0  # an outlier
    w[5] = 0.0  # an all-zero row
    w[6] = np.abs(w[6])  # all positive (Q4_K min clamps at 0)
    blocks = quantize(w, qtype)
    ours = QuantTensor(qtype, torch.from_numpy(blocks), 512).dequantize(torch.float32).numpy()
    theirs = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(qtype))
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))
    assert np.all(ours[5] == 0.0)
    err = np.sqrt(((ours - w) ** 2).mean()) / np.sqrt((w**2).mean())
    assert err < bound, err
    assert np.abs(ours - w).max() < 0.25 * np.abs(w).max()


def test_q4_k_never_worse_than_one_step_per_sub_block() -> None:
    """Each value lands within one quantization step (d*sc) of itself, plus scale rounding."""
    rng = np.random.default_rng(1)
    w = rng.uniform(-1, 1, size=(8, 256)).astype(np.float32)
    ours = gguf.quants.dequantize(quantize(w, QType.Q4_K), gguf.GGMLQuantizationType.Q4_K)
    step = (w.reshape(8, 8, 32).max(-1) - np.minimum(w.reshape(8, 8, 32).min(-1), 0)) / 15
    assert np.all(np.abs(ours - w).reshape(8, 8, 32) <= step[..., None] * 1.2)


def test_quantize_rejects_bad_input() -> None:
    with pytest.raises(UnsupportedModelError, match="whole number"):
        quantize(np.zeros((2, 100), np.float32), QType.Q4_K)
    with pytest.raises(UnsupportedModelError, match="cannot quantize to Q2_K"):
        quantize(np.zeros((2, 256), np.float32), QType.Q2_K)
