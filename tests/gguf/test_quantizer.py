"""Our quantizers write ggml's blocks bit for bit (hashes of ggml's own output on the same input), gguf-py reads
them like we do, and they round-trip closely."""

from __future__ import annotations

import hashlib

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


# sha256 of ggml's ggml_quantize_chunk output (libggml-base 0.25.3 from llama.cpp 0c1e570, no imatrix, through
# ctypes) for _edge_rows(): what llama-quantize writes for these values
GGML_SHA256 = {
    "Q4_0": "4b13b926a4ea1307a24407b67e046ab143f0f0d0d45d312245086249e59de780",
    "Q4_1": "40cae5ab702ac9bbc5dea492ff57e438db787156e29bfeb282553c93f48debb8",
    "Q5_0": "d7c2962a5b0607df347c5ad9e6464e853904fd62b13beea0ef595344583a1fc8",
    "Q5_1": "bb897347fa27886f5842d2f02abee81c3226acc0455a48ee1b21630e7a5e2dc6",
    "Q8_0": "5740b07d5488751f2a47566fc22d67a00053c8e52f8ec5bcf17c5e1a60e96d6a",
    "Q4_K": "2ed060afd85c482538c7b428b5e9a21a44daafd61af24a95192c4ac5c7c27868",
    "Q5_K": "9e22b2436fd157949f94a5fdae0992e5af3b9eed4f587aca060038cc16315cdd",
    "Q6_K": "be62544203019e5c607357c9b45981f31cbf104f78548056b6c634d5d683bb5f",
}


def _edge_rows() -> np.ndarray:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 512)).astype(np.float32)
    w[3, 7] = 25.0  # an outlier
    w[5] = 0.0  # all zero
    w[6] = np.abs(w[6])  # all positive: the K-quant min clamps at 0
    w[7] *= 1e-8  # scales that underflow fp16
    w[8] *= 1e4  # large
    w[9] = -np.abs(w[9])
    w[10, :256] = 0.5  # one constant super-block
    w[11] = rng.uniform(-1, 1, 512)
    w[12, ::2] = 0.0
    w[13] *= 3e-5  # fp16 subnormal scales
    return w


@pytest.mark.parametrize("name", sorted(GGML_SHA256))
def test_bit_exact_with_ggml(name: str) -> None:
    blocks = quantize(_edge_rows(), int(gguf.GGMLQuantizationType[name]))
    assert hashlib.sha256(blocks.tobytes()).hexdigest() == GGML_SHA256[name]
