"""GGUF weights repacked once at load into the layouts of torch's fused low-bit kernels (CPU and CUDA).

:func:`repack` turns what :class:`~.source.GGUFSource` returns into a :class:`~..weights.FusedWeight` that multiplies
without ever being dequantized again:

- **Int4** (torch's ``_weight_int4pack_mm_for_cpu`` on the CPU, ``_weight_int4pack_mm`` on CUDA, the same codes,
  scales and zeros in each device's own packing): every type whose weights are affine per group of G elements,
  ``w = A * v + B``. Torch's kernel computes ``w = (c - 8) * S + Z`` per code c with ``scales_and_zeros``
  ``[K'/group, N, 2]`` (checked numerically in the tests). Q4_0, Q4_1 and Q4_K are one code a weight, group 32:
  S = A, Z = B + 8 A (Q4_K: A = d*sc, B = -dmin*m). The 5-, 6- and 8-bit types are two codes a weight, **side by
  side in one group** (:data:`_WIDE`): a group of G weights becomes 2G columns, first the low nibbles l, then the
  high parts h (v = l + 16 h, h offset so that it is 0..15), and the activations go in as ``[x_g, 16 x_g]`` per
  group, so the kernel's sum over the 2G columns is ``A * sum (l + 16 h) x + (17 Z - 136 A) sum x``: S = A and
  Z = (B + 136 A) / 17, one scale and zero per 2G columns. Q8_0, Q5_0, Q5_1 and Q5_K (G = 32) take kernel groups of
  64 (9 bits a weight: 1.06x Q8_0's blocks, 1.64x Q5_0's), Q6_K (G = 16, its sub-blocks) groups of 32 (10 bits,
  1.52x its blocks). The offsets are chosen so that Z is small (8 A / 17 for all but Q5_1/Q5_K), which keeps its
  rounding small. Measured against the earlier layouts (two planes of 32-groups, and Q6_K as an fp16 copy: 1.18x,
  1.82x and 2.44x), see docs/gguf.md.
  The kernel is fast only with bfloat16 activations (fp32 and fp16 take a reference path 30x slower, measured), so
  scales and zeros are rounded to **bfloat16** and the activations are cast to bfloat16 per call (16 x is exact);
  the kernel accumulates in fp32 and rounds its output to bfloat16 once. N must be a multiple of 16 (rows of zeros
  pad it; the padding is cut from the output), K a multiple of 32 (always true of these block types).
- **Dense** (:class:`~.dense.FloatLinear`): F16/BF16 tensors stay in their own dtype and are multiplied in it (fp16 products
  accumulate in fp32; the activations are scaled into fp16's range first), never upcast whole. An fp16 weight times
  16 rows or more (prefill) is multiplied in fp32 instead, a chunk of its rows upcast at a time: torch's fp16 GEMM
  on the CPU is 3-4x slower than fp32's there.

2-D F32 tensors (routers, the shared expert's gate) of a stage computing in bf16/fp16 are cast to it once. Anything
else (1-D tensors, whose users take them in fp32; tensors already in the compute dtype) is returned as is.

**On CUDA** (``device=cuda:N``) the blocks are turned into codes on the CPU, as above, and only the packed result
goes to the device (``_convert_weight_to_int4pack``, which packs on the GPU). The first packing on a device checks
the kernel once against the dequantized product of a probe weight (:func:`cuda_int4_works`); where it is missing or
disagrees (a GPU older than sm80, a build without the kernel), the weights stay in their blocks and are dequantized
per use, with a warning. Float weights of a 16-bit stage are held once in the compute dtype (the per-use path casts
them to it on every step: the same numbers).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import ClassVar

import torch

from ...errors import UnsupportedModelError
from ..weights import FusedWeight, Weight
from .dense import TEMP_BYTES, FloatLinear, dequantize_chunked, trim_heap
from .ggml_kernels import ggml_weight
from .quants import QK_K, QType, QuantTensor, _k_scale_min, fp16_at, q6_k_parts, type_name

__all__ = ["FloatLinear", "Int4Weight", "INT4_TYPES", "cuda_int4_works", "repack", "trim_heap"]

log = logging.getLogger(__name__)

GROUP = 32  # the int4 kernel's group size: one (scale, zero) per 32 weights of a row
_ROW_TILE = 64  # packed rows are laid out in tiles of 64: packings of whole tiles concatenate along N
_TEMP_BYTES = TEMP_BYTES  # the most the repacking of one chunk of rows allocates besides its result (about)

Q4_1, Q5_1 = QType.Q4_1, QType.Q5_1  # d, m fp16 + codes; w = d*q + m
# the types held as two codes a weight, and their group G (the block's, or Q6_K's 16-weight sub-block)
_WIDE = {QType.Q5_0: 32, Q5_1: 32, QType.Q5_K: 32, QType.Q8_0: 32, QType.Q6_K: 16}
INT4_TYPES = frozenset({QType.Q4_0, Q4_1, QType.Q4_K, *_WIDE})
_TYPE_SIZE = {QType.Q4_0: 18, Q4_1: 20, QType.Q4_K: 144, QType.Q5_0: 22, Q5_1: 24, QType.Q5_K: 176, QType.Q8_0: 34,
              QType.Q6_K: 210}


# ---- codes, scales and zeros from raw blocks --------------------------------------------------------------------
# Each returns (codes uint8 [n, K'] in 0..15, scale fp32 [n, K'/group], zero fp32 [n, K'/group]) for n rows, with
# w = (code - 8) * scale + zero per code; K' = K (one code a weight) or 2K (two, :data:`_WIDE`).


def _nib32(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of packed nibbles per 32 weights: element j < 16 is byte j's low nibble, j >= 16 byte j-16's high."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """4 bytes per 32 weights (a little-endian uint32): element j is bit j."""
    return torch.stack([(qh >> k) & 1 for k in range(8)], dim=-1).flatten(-2)


def _one(lo: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w = a * lo + b per 32-group: codes lo [n, g, 32], S = a, Z = b + 8 a ([n, g])."""
    n = lo.shape[0]
    return lo.reshape(n, -1), a, b + 8 * a


def _two(lo: torch.Tensor, hi: torch.Tensor, a: torch.Tensor,
         b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w = a * (lo + 16 hi) + b per group of G: lo, hi [n, g, G] in 0..15 side by side in 2G columns (the
    activations go in as [x, 16 x] per group), S = a, Z = (b + 136 a) / 17 ([n, g])."""
    n = lo.shape[0]
    return torch.cat((lo, hi), dim=-1).reshape(n, -1), a, (b + 136 * a) / 17


def _codes_32(qtype: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): b uint8 [n, g, type_size]."""
    d = b[..., 0:2].contiguous().view(torch.float16).float()[..., 0]  # [n, g]
    if qtype == QType.Q8_0:  # w = d q, q in [-128, 127]: v = q + 128 = lo + 16 hi
        v = (b[..., 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        return _two(v & 0x0F, v >> 4, d, -128 * d)
    m = b[..., 2:4].contiguous().view(torch.float16).float()[..., 0] if qtype in (Q4_1, Q5_1) else None
    lo = _nib32(b[..., -16:])
    if qtype in (QType.Q4_0, Q4_1):
        return _one(lo, d, -8 * d if m is None else m)
    # Q5_0: w = d (lo + 16 h - 16); Q5_1: w = d (lo + 16 h) + m; with hi = h + 7 (so that Z is small):
    qh = b[..., 2:6] if qtype == QType.Q5_0 else b[..., 4:8]
    hi = _high_bits(qh) + 7
    return _two(lo, hi, d, -128 * d if m is None else m - 112 * d)


def _codes_k(qtype: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_K and Q5_K super-blocks: b uint8 [n, nb, type_size]; 8 groups of 32 per block, w = dd * q - dm."""
    n, nb, ts = b.shape
    flat = b.reshape(n * nb, ts)
    sc, mn = _k_scale_min(flat[:, 4:16])
    dd = (fp16_at(flat, 0) * sc.float()).reshape(n, nb * 8)
    dm = (fp16_at(flat, 2) * mn.float()).reshape(n, nb * 8)
    qs = flat[:, -128:].reshape(n * nb, 4, 32)
    lo = torch.stack((qs & 0x0F, qs >> 4), dim=2).reshape(n, nb * 8, 32)  # group 2i: low nibbles of chunk i
    if qtype == QType.Q4_K:
        return _one(lo, dd, -dm)
    qh = flat[:, 16:48]  # Q5_K: bit i of byte j is the fifth bit of element 32 i + j
    hi = torch.stack([(qh >> i) & 1 for i in range(8)], dim=1).reshape(n, nb * 8, 32) + 7
    return _two(lo, hi, dd, -dm - 112 * dd)


def _codes_q6_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q6_K super-blocks: b uint8 [n, nb, 210]; 16 sub-blocks of 16, w = a (q - 32) with q = lo + 16 h (h 0..3),
    a = d * sc: hi = h + 6, so w = a (lo + 16 hi) - 128 a."""
    n, nb, _ = b.shape
    lo, h, a = q6_k_parts(b.reshape(n * nb, 210))
    return _two(lo.reshape(n, nb * 16, 16), (h + 6).reshape(n, nb * 16, 16), a.reshape(n, nb * 16),
                -128 * a.reshape(n, nb * 16))


def int4_codes(qtype: int, data: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of GGML blocks (uint8 ``[n, row_bytes]``) as int4 codes ``[n, K']`` with fp32 scales and zeros
    ``[n, K'/group]`` (:func:`layout`) such that ``(code - 8) * scale + zero``, summed over a weight's codes
    weighted by 1 and 16 (two-code types), is the dequantized weight."""
    ts = _TYPE_SIZE[qtype]
    n = data.shape[0]
    if qtype in (QType.Q4_K, QType.Q5_K):
        return _codes_k(qtype, data.reshape(n, n_cols // QK_K, ts))
    if qtype == QType.Q6_K:
        return _codes_q6_k(data.reshape(n, n_cols // QK_K, ts))
    return _codes_32(qtype, data.reshape(n, n_cols // GROUP, ts))


def layout(qtype: int) -> tuple[int, int]:
    """(codes per weight, the kernel's group size in codes) of a type held as int4 codes."""
    g = _WIDE.get(qtype)
    return (1, GROUP) if g is None else (2, 2 * g)


# ---- the weights ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False)
class Int4Weight(FusedWeight):
    """``W [n, k]`` as int4 codes, ``wide`` = 0 (one code a weight, K' = k) or G (two, K' = 2k: each group of G
    weights as G low then G high codes, multiplied by ``[x_g, 16 x_g]``), N = n padded to a multiple of 16, with
    bfloat16 ``scales_zeros`` [K'/group, N, 2]. ``packed`` is torch's CPU layout (uint8 [N, K'/2]) or, on CUDA, its
    tensor-core layout (int32 [N/8, K'/(16 t), 32, t/2] for t inner K tiles, :func:`inner_k_tiles`)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    n: int
    k: int
    wide: int
    group: int
    qtype: int
    in_perm: torch.Tensor | None = None  # the file's columns are x[:, in_perm] (llama.cpp reordered them: ssm_out)
    product_dtype: ClassVar[torch.dtype] = torch.bfloat16

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def padded(self) -> int:
        return self.packed.shape[0] * (8 if self.packed.dim() == 4 else 1)

    @property
    def nbytes(self) -> int:
        return self.packed.numel() + self.scales_zeros.numel() * self.scales_zeros.element_size()

    @property
    def type_name(self) -> str:
        name = "mixed" if self.qtype < 0 else type_name(self.qtype)
        return f"{name} as int4" if not self.wide else f"{name} as int4x2 (groups of {self.wide})"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x if x.dim() == 2 else x.reshape(-1, self.k)
        y = self.product(x2).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y if x.dim() == 2 else y.reshape(*x.shape[:-1], self.n)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, k]`` (any float dtype) times the weight, as the kernel gives it: ``[M, n]`` bfloat16."""
        xb = x.to(torch.bfloat16)
        if self.in_perm is not None:
            xb = xb.index_select(1, self.in_perm)
        if self.wide:  # [x_g, 16 x_g] per group of G (x 16 is exact), one broadcast product (4.8 us for a row of
            m = xb.shape[0]  # 576 here; a concatenation of x_g and 16 x_g took 6.5)
            xb = (xb.view(m, -1, 1, self.wide) * _one_sixteen(xb.device)).view(m, 2 * self.k)
        if self.packed.dim() == 4:  # the CUDA layout
            y = torch.ops.aten._weight_int4pack_mm(xb, self.packed, self.group, self.scales_zeros)  # [M, N]
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.packed, self.group, self.scales_zeros)
        return y if self.padded == self.n else y[:, : self.n]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight the kernel multiplies by (bfloat16 products of the identity, 1024 columns at a time; for tests
        and rare dense uses)."""
        dev = self.packed.device
        out = torch.empty(self.n, self.k, dtype=dtype, device=dev)
        for c0 in range(0, self.k, 1024):
            c1 = min(c0 + 1024, self.k)
            eye = torch.zeros(c1 - c0, self.k, device=dev)
            eye[torch.arange(c1 - c0), torch.arange(c0, c1)] = 1.0
            out[:, c0:c1] = self.linear(eye).t()
        return out

    def to(self, device: torch.device | str) -> "Int4Weight":
        dev = torch.device(device)
        here = self.packed.device
        if dev.type != here.type or (dev.index is not None and dev.index != here.index):  # each layout is its kernel's
            raise UnsupportedModelError(f"int4-packed weights are packed for {here}; repack them for {dev}")
        return self

    @staticmethod
    def joinable(parts: list[FusedWeight]) -> bool:
        """The same K and layout, and every part but the last filling whole 64-row tiles of the packed layout."""
        if not all(isinstance(p, Int4Weight) for p in parts):
            return False
        ps: list[Int4Weight] = parts  # type: ignore[assignment]
        first = ps[0]
        if any(p.k != first.k or (p.wide, p.group) != (first.wide, first.group) or p.in_perm is not None for p in ps):
            return False
        return not any(p.padded != p.n or p.n % _ROW_TILE for p in ps[:-1])

    @staticmethod
    def concat(parts: list[FusedWeight]) -> "Int4Weight | None":
        """The parts stacked along N (one product for q/k/v or gate/up), or None where the layout does not allow it
        (:meth:`joinable`)."""
        if not Int4Weight.joinable(parts):
            return None
        ps: list[Int4Weight] = parts  # type: ignore[assignment]
        first = ps[0]
        packed = torch.cat([p.packed for p in ps])
        sz = torch.cat([p.scales_zeros for p in ps], dim=1)
        return Int4Weight(packed, sz, sum(p.n for p in ps[:-1]) + ps[-1].n, first.k, first.wide, first.group,
                          first.qtype if len({p.qtype for p in ps}) == 1 else -1)


def chunk_rows(k: int, codes: int) -> int:
    """Rows repacked at a time: a whole number of 64-row tiles whose temporaries stay under :data:`_TEMP_BYTES`,
    counted as 32 bytes per weight and code (the codes as uint8 and int32, and the kernel's packing, which makes
    copies of its own: with 8, the peak of a SmolLM2 Q8_0 load rose 28 MiB over what the stage holds; with 32, 11)."""
    return max(_ROW_TILE, _TEMP_BYTES // (32 * k * codes) // _ROW_TILE * _ROW_TILE)


def inner_k_tiles(k: int) -> int:
    """K tiles per inner block of torch's CUDA int4 layout for K columns: the largest of 8, 4, 2 with 16 t | K."""
    for tiles in (8, 4, 2):
        if k % (16 * tiles) == 0:
            return tiles
    raise UnsupportedModelError(f"the CUDA int4 layout needs K a multiple of 32, got {k}")


def pack_int4(qt: QuantTensor, release: Callable[[torch.Tensor], None] | None = None,
              device: torch.device | str = "cpu") -> Int4Weight:
    """Repack a quantized tensor (one of :data:`INT4_TYPES`, its blocks on the CPU) for the int4 kernel of
    ``device``, a chunk of rows at a time into outputs allocated once (so the peak is the result plus one chunk's
    temporaries); ``release`` is given each chunk's blocks once they are packed (the source drops their mapped
    pages). Blocks whose columns llama.cpp reordered are packed as stored; the activations are reordered instead."""
    n, k = qt.shape
    codes_per, group = layout(qt.qtype)
    dev = torch.device(device)
    big = -(-n // 16) * 16
    width = codes_per * k
    packed = torch.empty(big, width // 2, dtype=torch.uint8) if dev.type == "cpu" else None
    tiles = 0 if packed is not None else inner_k_tiles(width)
    parts: list[torch.Tensor] = []  # the CUDA layout's chunks (rows of 8 are independent there: they concatenate)
    sz = torch.empty(width // group, big, 2, dtype=torch.bfloat16)
    step = chunk_rows(k, codes_per)
    for r0 in range(0, big, step):
        r1 = min(r0 + step, big)
        real = max(0, min(r1, n) - r0)
        codes = torch.full((r1 - r0, width), 8, dtype=torch.int32)  # pad rows: codes 8 at scale 0, zero 0 -> 0
        if real:
            blocks = qt.data[r0 : r0 + real]
            c, scale, zero = int4_codes(qt.qtype, blocks, k)
            if release is not None:
                release(blocks)
            codes[:real] = c
            sz[:, r0 : r0 + real, 0] = scale.t()
            sz[:, r0 : r0 + real, 1] = zero.t()
            del c, scale, zero
        sz[:, r0 + real : r1] = 0
        if packed is not None:
            packed[r0:r1] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
        else:
            parts.append(_pack_cuda(codes, dev, tiles))
        del codes
    if packed is None:
        packed = parts[0] if len(parts) == 1 else torch.cat(parts)
    in_perm = None if qt.col_perm is None else _to_device(torch.argsort(qt.col_perm), dev)
    return Int4Weight(packed, _to_device(sz, dev), n, k, _WIDE.get(qt.qtype, 0), group, qt.qtype, in_perm)


@functools.lru_cache(maxsize=8)
def _one_sixteen(device: torch.device) -> torch.Tensor:
    """[2, 1] bfloat16 (1, 16): the two codes' activations, x and 16 x (a constant per device; never written)."""
    return torch.tensor([1.0, 16.0], dtype=torch.bfloat16, device=device).view(2, 1)


def _to_device(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    """``t`` on ``dev`` (every move of the CUDA packing goes through here: the fake-CUDA test replaces it)."""
    return t if dev.type == "cpu" else t.to(dev)


def _pack_cuda(codes: torch.Tensor, dev: torch.device, tiles: int) -> torch.Tensor:
    """int32 codes [r, K] in 0..15 (CPU) as torch's CUDA int4 layout on ``dev``: two codes a byte, the even column
    in the high nibble (the convention of torch's own ``_group_quantize_tensor``), packed on the device."""
    u8 = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)
    return torch.ops.aten._convert_weight_to_int4pack(_to_device(u8, dev), tiles)


_CUDA_CHECKED: dict[torch.device, bool] = {}


def cuda_int4_works(device: torch.device | str) -> bool:
    """Whether torch's CUDA int4 kernel runs on ``device`` and gives what the CPU reference gives: one probe (a
    Q4_0 and a Q8_0 weight of 72 x 256, odd rows padded, 5 rows of activations) per device and process, against
    ``x @ dequantize(w).T`` within the tests' bound (1e-2 of the largest output). False, with a warning, when the
    kernel is missing (a GPU older than sm80) or disagrees: the caller keeps the weights' blocks then."""
    dev = torch.device(device)
    if dev not in _CUDA_CHECKED:
        _CUDA_CHECKED[dev] = _probe_cuda_int4(dev)
    return _CUDA_CHECKED[dev]


def _probe_cuda_int4(dev: torch.device) -> bool:
    from .quantizer import quantize

    g = torch.Generator().manual_seed(0)
    worst = 0.0
    try:
        for qtype in (QType.Q4_0, QType.Q8_0):
            w = torch.randn(72, 256, generator=g) * 0.05
            qt = QuantTensor(qtype, torch.from_numpy(quantize(w.numpy(), qtype)), 256)
            x = torch.randn(5, 256, generator=g)
            ref = x @ qt.dequantize(torch.float32).t()
            got = pack_int4(qt, device=dev).product(x.to(dev)).float().cpu()
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max()))
    except Exception as exc:  # noqa: BLE001 - whatever stops the probe (no kernel for this GPU, a torch build
        # without it, a device torch cannot run it on) means the same: keep the blocks
        log.warning("torch's CUDA int4 kernel does not run on %s (%s); GGUF weights stay in their blocks there and "
                    "are dequantized per use", dev, str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
        return False
    if not worst < 1e-2:
        log.warning("torch's CUDA int4 kernel disagrees with the reference on %s (error %.3g of the output); GGUF "
                    "weights stay in their blocks there and are dequantized per use", dev, worst)
        return False
    return True


def repack(w: Weight, dtype: torch.dtype, release: Callable[[torch.Tensor], None] | None = None,
           device: torch.device | str = "cpu", head: bool = False) -> Weight:
    """The fused form of a weight that a stage computing in ``dtype`` on ``device`` will multiply by (see the module
    docstring); anything it does not apply to comes back unchanged, on the CPU (the caller moves it). ``release`` is
    given the stored blocks that a repacked weight no longer needs, a chunk at a time (never those a result still
    refers to). ``head``: the output head, whose products are the logits: a Q6_K head (llama.cpp's Q4_K_M gives
    every model one) is held as an fp16 copy there instead, so that the logits keep fp16's resolution (bfloat16's,
    the int4 kernel's output, is 0.0625 at 12: two of 24 rows of the tiny Llama Q4_K_M fixture tied or flipped)."""
    dev = torch.device(device)
    if dev.type != "cpu":
        return _repack_for(dev, w, dtype, release)
    if isinstance(w, QuantTensor):
        if w.data.device.type != "cpu":
            return w  # blocks already elsewhere stay on the dequantize-per-use path
        if head and w.qtype == QType.Q6_K:
            dense_w = dequantize_chunked(w, torch.float16, release)
            return FloatLinear(dense_w if dense_w is not None else dequantize_chunked(w, torch.bfloat16, release))
        if not head and (g := ggml_weight(w)) is not None:  # multiplied as stored, by ggml (ggml_kernels.py)
            return g
        if w.qtype in INT4_TYPES:
            return pack_int4(w, release)
        return w
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.device.type == "cpu" and w.dtype != dtype:
        if w.dtype in (torch.float16, torch.bfloat16):
            return FloatLinear(w)
        if w.dtype == torch.float32:  # a router or gate (F32 in every GGUF) of a bf16/fp16 stage: cast once, not per
            return w.to(dtype)  # step (the same rounding the per-use path applies on every step)
    return w


def _repack_for(dev: torch.device, w: Weight, dtype: torch.dtype,
                release: Callable[[torch.Tensor], None] | None) -> Weight:
    """:func:`repack` for a CUDA stage: int4 types packed for the device's kernel (where it works), 2-D float weights
    of a 16-bit stage once into its dtype, on the device."""
    half = dtype in (torch.float16, torch.bfloat16)
    if isinstance(w, QuantTensor):
        if w.data.device.type == "cpu" and w.qtype in INT4_TYPES and cuda_int4_works(dev):
            return pack_int4(w, release, dev)
        return w
    if isinstance(w, torch.Tensor) and w.dim() == 2 and w.dtype != dtype and w.dtype.is_floating_point and half:
        return w.to(dev).to(dtype)  # what the per-use path casts it to on every step
    return w
