"""GGML block formats, dequantized with device-agnostic torch ops.

Each ``dequantize_*`` takes raw blocks as a uint8 tensor ``[n_blocks, type_size]`` (on any device) and returns float32
``[n_blocks, block_size]``. The arithmetic follows gguf-py's numpy reference (``gguf/quants.py``) operation for
operation, in float32, so the results are bit-for-bit equal to ``gguf.quants.dequantize``; the tests hold us to that.
No numpy is used here, so the same code runs on CUDA tensors kept resident on a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ...errors import UnsupportedModelError

__all__ = [
    "BLOCK_SIZES",
    "QUANT_TYPES",
    "QType",
    "dequantize_blocks",
    "dequantize_rows",
    "fp16_at",
    "row_bytes",
    "type_name",
    "unsupported_type",
]

QK_K = 256


class QType:
    """GGML type ids (``gguf.GGMLQuantizationType`` values) that we read, without importing gguf here."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    IQ4_XS = 23
    BF16 = 30


# ggml type id -> (block_size in elements, type_size in bytes)
BLOCK_SIZES: dict[int, tuple[int, int]] = {
    QType.F32: (1, 4),
    QType.F16: (1, 2),
    QType.BF16: (1, 2),
    QType.Q4_0: (32, 18),
    QType.Q4_1: (32, 20),
    QType.Q5_0: (32, 22),
    QType.Q5_1: (32, 24),
    QType.Q8_0: (32, 34),
    QType.Q2_K: (QK_K, 84),
    QType.Q3_K: (QK_K, 110),
    QType.Q4_K: (QK_K, 144),
    QType.Q5_K: (QK_K, 176),
    QType.Q6_K: (QK_K, 210),
    QType.IQ4_NL: (32, 18),
    QType.IQ4_XS: (QK_K, 136),
}
NAMES = {v: k for k, v in vars(QType).items() if not k.startswith("_")}


def fp16_at(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at byte ``offset`` of every block, as float32 ``[n, 1]``."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(torch.float32)


# Speed notes (measured on CPU): a shift by a broadcast tensor of shift amounts is ~10x slower than shifts by a
# scalar, and a mixed uint8 x float32 multiply ~2x slower than converting then multiplying in place. So the codes are
# unpacked with scalar shifts and stacked, converted to float32 once, and scaled/offset in place. Each step rounds
# exactly like gguf-py's float32 numpy code, which keeps the results bit-identical.


def _nibbles(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Low and high nibbles of ``x``, stacked along a new ``dim``."""
    return torch.stack((x & 0x0F, x >> 4), dim=dim)


def _bits(x: torch.Tensor, count: int, width: int, dim: int) -> torch.Tensor:
    """The ``count`` fields of ``width`` bits of each byte of ``x``, lowest first, stacked along a new ``dim``."""
    mask = (1 << width) - 1
    return torch.stack([(x >> (k * width)) & mask for k in range(count)], dim=dim)


def dequantize_q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = fp16_at(b, 0)
    q = _nibbles(b[:, 2:], 1).reshape(n, 32).view(torch.int8).sub_(8)
    return q.to(torch.float32).mul_(d)


def dequantize_q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = fp16_at(b, 0), fp16_at(b, 2)
    q = _nibbles(b[:, 4:], 1).reshape(n, 32)
    return q.to(torch.float32).mul_(d).add_(m)


def dequantize_q5_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = fp16_at(b, 0)
    qh = _bits(b[:, 2:6], 8, 1, 2).reshape(n, 32)  # element j is bit j % 8 of byte j // 8 (little-endian uint32)
    q = _nibbles(b[:, 6:], 1).reshape(n, 32).bitwise_or_(qh.bitwise_left_shift_(4))
    return q.view(torch.int8).sub_(16).to(torch.float32).mul_(d)


def dequantize_q5_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = fp16_at(b, 0), fp16_at(b, 2)
    qh = _bits(b[:, 4:8], 8, 1, 2).reshape(n, 32)
    q = _nibbles(b[:, 8:], 1).reshape(n, 32).bitwise_or_(qh.bitwise_left_shift_(4))
    return q.to(torch.float32).mul_(d).add_(m)


def dequantize_q8_0(b: torch.Tensor) -> torch.Tensor:
    d = fp16_at(b, 0)
    return b[:, 2:].view(torch.int8).to(torch.float32).mul_(d)


def dequantize_q2_k(b: torch.Tensor) -> torch.Tensor:
    # layout: scales[16] (low nibble scale, high nibble min), qs[64], d fp16, dmin fp16
    n = b.shape[0]
    sc = b[:, :16]
    dl = (fp16_at(b, 80) * (sc & 0x0F).to(torch.float32)).reshape(n, 16, 1)
    ml = (fp16_at(b, 82) * (sc >> 4).to(torch.float32)).reshape(n, 16, 1)
    q = _bits(b[:, 16:80].reshape(n, 2, 32), 4, 2, 2).reshape(n, 16, 16)
    return q.to(torch.float32).mul_(dl).sub_(ml).reshape(n, QK_K)


def dequantize_q3_k(b: torch.Tensor) -> torch.Tensor:
    # layout: hmask[32], qs[64], scales[12] (16 6-bit scales: low nibbles in bytes 0-7, high 2 bits in 8-11), d fp16
    n = b.shape[0]
    low = _nibbles(b[:, 96:104], 1).reshape(n, 16)
    high = _bits(b[:, 104:108], 4, 2, 1).reshape(n, 16)
    sc = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    dl = (fp16_at(b, 108) * sc.to(torch.float32)).reshape(n, 16, 1)
    ql = _bits(b[:, 32:96].reshape(n, 2, 32), 4, 2, 2).reshape(n, 16, 16)
    qh = _bits(b[:, :32].reshape(n, 1, 32), 8, 1, 2).reshape(n, 16, 16)
    # a set hmask bit means no offset, a clear one subtracts 4
    q = ql.view(torch.int8).sub_(qh.bitwise_xor_(1).bitwise_left_shift_(2).view(torch.int8))
    return q.to(torch.float32).mul_(dl).reshape(n, QK_K)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Unpack the 12-byte 6-bit scales and mins of a Q4_K/Q5_K block into two ``[n, 8]`` uint8 tensors."""
    n = scales.shape[0]
    s = scales.reshape(n, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _k_scales(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    dd = (fp16_at(b, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    dm = (fp16_at(b, 2) * mn.to(torch.float32)).reshape(n, 8, 1)
    return dd, dm


def dequantize_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dd, dm = _k_scales(b)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32), 2).reshape(n, 8, 32)
    return q.to(torch.float32).mul_(dd).sub_(dm).reshape(n, QK_K)


def dequantize_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    dd, dm = _k_scales(b)
    qh = _bits(b[:, 16:48], 8, 1, 1).reshape(n, 8, 32)
    q = _nibbles(b[:, 48:].reshape(n, 4, 32), 2).reshape(n, 8, 32).bitwise_or_(qh.bitwise_left_shift_(4))
    return q.to(torch.float32).mul_(dd).sub_(dm).reshape(n, QK_K)


def q6_k_parts(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K blocks [n, 210] as (low nibbles uint8 [n, 256], high 2 bits uint8 [n, 256], in element order, and the
    sub-blocks' scales d * sc fp32 [n, 16]): w = scale * (low + 16 high - 32)."""
    n = b.shape[0]
    scale = fp16_at(b, 208) * b[:, 192:208].view(torch.int8).to(torch.float32)
    ql = _nibbles(b[:, :128].reshape(n, 2, 64), 2).reshape(n, QK_K)
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), 4, 2, 2).reshape(n, QK_K)
    return ql, qh, scale


def dequantize_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    ql, qh, scale = q6_k_parts(b)
    q = ql.bitwise_or_(qh.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    return q.reshape(n, QK_K // 16, 16).to(torch.float32).mul_(scale.reshape(n, QK_K // 16, 1)).reshape(n, QK_K)


# IQ4_NL's non-linear 4-bit code book (ggml's kvalues_iq4nl), shared by IQ4_XS
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_lookup(codes: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=codes.device)
    return table[codes.to(torch.int64)]  # uint8 indices would be read as a boolean mask


def dequantize_iq4_nl(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = fp16_at(b, 0)
    return _iq4_lookup(_nibbles(b[:, 2:], 1).reshape(n, 32)).mul_(d)


def dequantize_iq4_xs(b: torch.Tensor) -> torch.Tensor:
    # layout: d fp16, scales_h uint16 (2 bits per sub-block), scales_l[4] (4 bits per sub-block), qs[128]
    n = b.shape[0]
    low = _nibbles(b[:, 4:8], 2).reshape(n, 8)
    high = _bits(b[:, 2:4], 4, 2, 2).reshape(n, 8)  # the little-endian uint16's 2-bit fields, lowest first
    sc = low.bitwise_or_(high.bitwise_left_shift_(4)).view(torch.int8).sub_(32)
    dl = (fp16_at(b, 0) * sc.to(torch.float32)).reshape(n, 8, 1)
    q = _nibbles(b[:, 8:].reshape(n, 8, 16), 2).reshape(n, 8, 32)
    return _iq4_lookup(q).mul_(dl).reshape(n, QK_K)


_DEQUANT: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {
    QType.Q4_0: dequantize_q4_0,
    QType.Q4_1: dequantize_q4_1,
    QType.Q5_0: dequantize_q5_0,
    QType.Q5_1: dequantize_q5_1,
    QType.Q8_0: dequantize_q8_0,
    QType.Q2_K: dequantize_q2_k,
    QType.Q3_K: dequantize_q3_k,
    QType.Q4_K: dequantize_q4_k,
    QType.Q5_K: dequantize_q5_k,
    QType.Q6_K: dequantize_q6_k,
    QType.IQ4_NL: dequantize_iq4_nl,
    QType.IQ4_XS: dequantize_iq4_xs,
}
QUANT_TYPES = frozenset(_DEQUANT)


def type_name(qtype: int) -> str:
    """The ggml name of ``qtype`` ("Q4_K"), also for types we do not read; "ggml type N" for unknown ids."""
    name = NAMES.get(qtype)
    if name is not None:
        return name
    import gguf  # only for the names of types we do not read

    try:
        return gguf.GGMLQuantizationType(qtype).name
    except ValueError:  # a type number gguf-py does not name
        return f"ggml type {qtype}"


def unsupported_type(qtype: int, where: str = "") -> UnsupportedModelError:
    """The one error for a tensor type we cannot read: ``IQ2_XXS is not supported (...); supported: F32, ...``."""
    context = f" ({where})" if where else ""
    return UnsupportedModelError(
        f"{type_name(qtype)} is not supported{context}; supported: "
        f"{', '.join(type_name(t) for t in sorted(BLOCK_SIZES))}"
    )


def row_bytes(qtype: int, n_cols: int) -> int:
    """Bytes one row of ``n_cols`` elements takes in ``qtype``."""
    if qtype not in BLOCK_SIZES:
        raise unsupported_type(qtype)
    bs, ts = BLOCK_SIZES[qtype]
    if n_cols % bs:
        raise UnsupportedModelError(f"a row of {n_cols} elements is not a whole number of {type_name(qtype)} blocks")
    return n_cols // bs * ts


def dequantize_blocks(qtype: int, blocks: torch.Tensor) -> torch.Tensor:
    """Dequantize ``[n_blocks, type_size]`` uint8 blocks to float32 ``[n_blocks, block_size]``."""
    fn = _DEQUANT.get(qtype)
    if fn is None:
        raise unsupported_type(qtype) if qtype not in BLOCK_SIZES else UnsupportedModelError(
            f"{type_name(qtype)} is not a block type (only quantized types are dequantized block-wise)"
        )
    _, ts = BLOCK_SIZES[qtype]
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != ts:
        raise UnsupportedModelError(
            f"{type_name(qtype)} blocks must be uint8 [n, {ts}], got {blocks.dtype} {tuple(blocks.shape)}"
        )
    return fn(blocks)


def dequantize_rows(qtype: int, data: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Dequantize ``[rows, row_bytes]`` uint8 data into float32 ``[rows, n_cols]``."""
    rows = data.shape[0]
    bs, ts = BLOCK_SIZES[qtype]
    out = dequantize_blocks(qtype, data.reshape(-1, ts))
    return out.reshape(rows, n_cols)


@dataclasses.dataclass(frozen=True, eq=False)
class QuantTensor:
    """A 2-D weight kept as GGML blocks; implements the runtime's ``QuantWeight`` protocol.

    ``data`` is uint8 ``[out, row_bytes]`` (often a view of the memory-mapped file). ``col_perm``, when set, is applied
    to the columns after dequantizing: llama.cpp reorders the *columns* of some matrices (``ssm_out``) and the columns
    of raw blocks cannot be permuted, so the permutation waits until the values exist.
    """

    qtype: int
    data: torch.Tensor
    n_cols: int
    col_perm: torch.Tensor | None = None
    reread: Callable[[], torch.Tensor] | None = None  # ``data`` read again, where it is a reordered copy of the file's

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.data.shape[0]), self.n_cols)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.col_perm is None else self.col_perm.numel() * self.col_perm.element_size()
        return int(self.data.numel()) + extra

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = dequantize_rows(self.qtype, self.data, self.n_cols)
        if self.col_perm is not None:
            out = out.index_select(1, self.col_perm.to(out.device))
        return out if dtype == torch.float32 else out.to(dtype)

    def take_rows(self, index: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize only the rows in ``index`` (an embedding lookup without dequantizing the whole table)."""
        sub = self.data.index_select(0, index.reshape(-1).to(self.data.device))
        out = dequantize_rows(self.qtype, sub, self.n_cols)
        if self.col_perm is not None:
            out = out.index_select(1, self.col_perm.to(out.device))
        out = out.reshape(*index.shape, self.n_cols)
        return out if dtype == torch.float32 else out.to(dtype)

    def to(self, device: torch.device | str) -> "QuantTensor":
        """The same weight with its blocks on ``device`` (the blocks stay quantized there)."""
        perm = None if self.col_perm is None else self.col_perm.to(device)
        return QuantTensor(self.qtype, self.data.to(device), self.n_cols, perm)
