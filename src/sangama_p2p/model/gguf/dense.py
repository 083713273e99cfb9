"""Dense GGUF weights multiplied in their own 16-bit dtype, and the helpers the repacking shares with them.

:class:`FloatLinear` holds an F16/BF16 tensor (or a Q6_K output head dequantized once into fp16, see
``packed.repack``) and multiplies by it without upcasting it whole: fp16 products accumulate in fp32, with the
activations scaled into fp16's range first; an fp16 weight times 16 rows or more (prefill) is multiplied in fp32,
a chunk of its rows upcast at a time (torch's fp16 GEMM on the CPU is 3-4x slower than fp32's there).
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..weights import FusedWeight
from .quants import QuantTensor, dequantize_rows

__all__ = ["FloatLinear", "TEMP_BYTES", "dequantize_chunked", "trim_heap"]

TEMP_BYTES = 16 << 20  # the most a chunked conversion allocates besides its result (about)
_FP16_MAX = 60000.0  # activations scaled below this before an fp16 product
_WIDE_ROWS = 16  # an fp16 weight multiplies this many activation rows or more in fp32 (torch's fp16 GEMM is slow)


@dataclasses.dataclass(frozen=True, eq=False)
class FloatLinear(FusedWeight):
    """A dense weight multiplied in its own dtype (fp16 or bf16) whatever the activations' dtype."""

    weight: torch.Tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weight
        if w.dtype == torch.float16 and x.dtype != torch.float16 and x.numel() >= _WIDE_ROWS * w.shape[1]:
            y = _fp32_by_row_chunks(x.reshape(-1, w.shape[1]), w).reshape(*x.shape[:-1], w.shape[0]).to(x.dtype)
        elif w.dtype == torch.float16 and x.dtype != torch.float16:
            lo, hi = torch.aminmax(x) if x.numel() else (x.new_zeros(()), x.new_zeros(()))
            peak = max(-float(lo), float(hi))  # (cheaper than abs().max(): one op)
            if peak > _FP16_MAX:  # keep the activations inside fp16's range (and scale the product back)
                scale = peak / _FP16_MAX
                y = F.linear((x / scale).to(w.dtype), w).to(x.dtype) * scale
            else:
                y = F.linear(x.to(w.dtype), w).to(x.dtype)
        else:
            y = F.linear(x.to(w.dtype), w).to(x.dtype)
        return y if bias is None else y + bias

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def to(self, device: torch.device | str) -> "FloatLinear":
        return FloatLinear(self.weight.to(device))

    @staticmethod
    def joinable(parts: list[FusedWeight]) -> bool:
        if not all(isinstance(p, FloatLinear) for p in parts):
            return False
        return len({p.weight.dtype for p in parts}) == 1  # type: ignore[attr-defined]

    @staticmethod
    def concat(parts: list[FusedWeight]) -> "FloatLinear | None":
        if not FloatLinear.joinable(parts):
            return None
        return FloatLinear(torch.cat([p.weight for p in parts]))  # type: ignore[attr-defined]


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc's ``malloc_trim``; nothing elsewhere). Repacking frees many
    temporaries of a few MB, which glibc otherwise keeps in the process (measured: ~10 MB on llama/small Q4_K)."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return
    fn(0)


def _fp32_by_row_chunks(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.T`` in fp32 for an fp16 ``w`` (upcast exactly), a chunk of w's rows at a time (copies of at most
    :data:`TEMP_BYTES`). On the CPU, torch's fp16 GEMM is 3-4x slower than fp32's for many rows (measured at 512 rows,
    1 thread: 1536x576 35.8 ms fp16, 10.3 fp32, 2.9 bf16); one activation row it does at the speed of memory."""
    x32 = x.float()
    n, k = w.shape
    out = torch.empty(x32.shape[0], n, dtype=torch.float32)
    step = max(64, TEMP_BYTES // (4 * k))
    for r0 in range(0, n, step):
        out[:, r0 : r0 + step] = x32 @ w[r0 : r0 + step].float().t()
    return out
def dequantize_chunked(qt: QuantTensor, dtype: torch.dtype,
                        release: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor | None:
    """The weight in ``dtype``, a chunk of rows at a time; None when a value does not fit ``dtype`` (fp16's 65504).
    Released blocks stay readable (the mapped pages come back from the file)."""
    n, k = qt.shape
    limit = torch.finfo(dtype).max
    out = torch.empty(n, k, dtype=dtype)
    step = max(1, TEMP_BYTES // (8 * k))  # rows whose fp32 dequantization (and its steps) fit the bound
    for r0 in range(0, n, step):
        blocks = qt.data[r0 : r0 + step]
        part = dequantize_rows(qt.qtype, blocks, k)
        if release is not None:
            release(blocks)
        if float(part.abs().max()) > limit:
            return None
        out[r0 : r0 + step] = part if qt.col_perm is None else part.index_select(1, qt.col_perm)
    return out
