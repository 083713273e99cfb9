"""Conversion between torch tensors and the wire's :class:`~sangama_p2p.wire.tensor.Tensor` (dtype, shape, bytes).

Why a separate module: ``wire/`` must not import torch, and both ``stage/`` and ``client/`` may need the conversion
without importing each other. fp32 is the default wire dtype for hidden states: bf16 rounding between stages makes
greedy tokens diverge from the single-process chain (``generate --local``) on small models, and equality with the
local chain is what the network promises. bf16 halves the bytes and is the choice for large models.
"""

from __future__ import annotations

import sys

import torch

from .errors import InvalidMessageError
from .wire.tensor import DTYPE_SIZES, Tensor

__all__ = ["DEFAULT_WIRE_DTYPE", "TORCH_DTYPES", "from_wire", "to_wire"]

DEFAULT_WIRE_DTYPE = "fp32"
TORCH_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def to_wire(t: torch.Tensor, dtype: str = DEFAULT_WIRE_DTYPE) -> Tensor:
    """``t`` cast to ``dtype`` ("bf16", "fp16", "fp32") as little-endian C-order bytes (one copy at most)."""
    if dtype not in TORCH_DTYPES:
        raise InvalidMessageError(f"wire dtype must be one of {sorted(TORCH_DTYPES)}, got {dtype!r}")
    x = t.detach().to("cpu", TORCH_DTYPES[dtype]).contiguous()
    if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
        raise InvalidMessageError("big-endian hosts are not supported")
    data = x.view(torch.uint8).reshape(-1).numpy().tobytes() if x.numel() else b""
    return Tensor(dtype, tuple(int(d) for d in x.shape), data)


def from_wire(t: Tensor, *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A torch tensor over a copy of ``t``'s bytes, cast to ``dtype`` when given."""
    if t.dtype not in DTYPE_SIZES:  # Tensor validates this; kept so a future dtype fails loudly here
        raise InvalidMessageError(f"unknown wire dtype {t.dtype!r}")
    raw = bytearray(t.data)
    flat = torch.frombuffer(raw, dtype=TORCH_DTYPES[t.dtype]) if raw else torch.empty(0, dtype=TORCH_DTYPES[t.dtype])
    out = flat.reshape(t.shape)
    return out.to(dtype) if dtype is not None and dtype != out.dtype else out
