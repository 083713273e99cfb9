"""torch <-> wire Tensor: exact for fp32, rounded for bf16/fp16, typed errors, through the codec."""

from __future__ import annotations

import pytest
import torch

from sangama_p2p.errors import InvalidMessageError
from sangama_p2p.tensors import from_wire, to_wire
from sangama_p2p.wire.codec import decode, encode
from sangama_p2p.wire.messages import Step


@pytest.mark.parametrize("dtype,tol", [("fp32", 0.0), ("bf16", 1e-2), ("fp16", 1e-3)])
def test_round_trip_through_a_step_frame(dtype, tol):
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    t = to_wire(x, dtype)
    assert t.dtype == dtype and t.shape == (5, 64)
    msg = decode(encode(Step(bytes(16), 1, 0, (1,) * 5, t, (), ())))
    y = from_wire(msg.hidden)
    assert y.shape == x.shape
    assert float((y.float() - x).abs().max()) <= tol * float(x.abs().max())
    if dtype == "fp32":
        assert torch.equal(y, x)
    assert from_wire(t, dtype=torch.float32).dtype == torch.float32


def test_non_contiguous_and_empty_and_bad_dtype():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4).t()
    assert torch.equal(from_wire(to_wire(x)), x)
    e = from_wire(to_wire(torch.zeros(0, 8)))
    assert e.shape == (0, 8)
    with pytest.raises(InvalidMessageError):
        to_wire(x, "int8")
