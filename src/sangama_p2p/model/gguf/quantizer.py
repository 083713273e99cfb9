"""Quantizers for the writers: Q4_K, Q5_K and Q6_K here; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are gguf-py's (bit-exact
with ggml's reference code).

The K-quants follow llama.cpp's reference code (``quantize_row_q4_K_ref``, ``q5_K_ref``, ``q6_K_ref`` in
``ggml-quants.c``, the path llama-quantize takes without an importance matrix) step by step in float32, vectorised
over sub-blocks but summing each sub-block's elements left to right as the C loops do, so that the blocks come out
bit for bit as llama.cpp writes them (the tests compare against llama-quantize's output). Q4_K/Q5_K: a weighted
affine fit per 32-element sub-block (``make_qkx2_quants``, a search over 21 / 16 candidate scales), 6-bit sub-block
scales and mins under fp16 super-block scales. Q6_K: a symmetric fit per 16-element sub-block (``make_qx_quants``
with x^2 weights, 19 candidate scales), 8-bit sub-block scales under an fp16 super-block scale.
"""

from __future__ import annotations

import numpy as np

from ...errors import UnsupportedModelError
from .quants import BLOCK_SIZES, QK_K, QType, type_name

__all__ = ["QUANTIZE_TYPES", "quantize"]

_F = np.float32
_GROUP_MAX_EPS = _F(1e-15)


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fp16 bytes [n, 2], the value they hold as float32 [n]) - round to nearest even, as GGML_FP32_TO_FP16."""
    h = np.asarray(x, _F).astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(_F).reshape(-1)


def _sum(terms: np.ndarray, start: np.ndarray | None = None) -> np.ndarray:
    """Left-to-right float32 sum over the first axis, like ``acc += t`` in a C loop (numpy's own sum is pairwise,
    which rounds differently). ``start`` is the initial accumulator (0 when None)."""
    acc = np.zeros(terms.shape[1:], _F) if start is None else start.copy()
    for t in terms:
        acc += t
    return acc


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b where b != 0 (the C code never uses the other lanes), without warnings."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return (a / np.where(b != 0, b, _F(1))).astype(_F)


def _nearest(x: np.ndarray) -> np.ndarray:
    """ggml's nearest_int (round half to even) as float32."""
    return np.rint(x).astype(_F)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple:
    """``make_qkx2_quants`` over many sub-blocks at once. ``x``, ``w``: float32 [n, R] (element-major: R sub-blocks
    of n elements). Returns (scale [R], -min [R], codes float32 [n, R])."""
    fn = _F(nmax)
    mn = np.where(x.min(axis=0) > 0, _F(0), x.min(axis=0)).astype(_F)
    mx = x.max(axis=0)
    flat = mx == mn
    sum_w = _sum(w[1:], w[0])
    sum_x = _sum(w[1:] * x[1:], w[0] * x[0])
    span = np.where(flat, _F(1), mx - mn).astype(_F)
    iscale = (fn / span).astype(_F)
    scale = (_F(1) / iscale).astype(_F)
    best_l = np.clip(_nearest(iscale * (x - mn)), 0, nmax).astype(_F)
    diff = scale * best_l + mn - x
    best = _sum(w * (diff * diff))
    for step in range(nstep + 1):
        span = np.where(flat, _F(1), mx - mn).astype(_F)
        iscale = ((_F(rmin) + _F(rdelta) * _F(step) + fn) / span).astype(_F)
        laux = np.clip(_nearest(iscale * (x - mn)), 0, nmax).astype(_F)
        wl = w * laux
        sum_l, sum_l2, sum_xl = _sum(wl), _sum(wl * laux), _sum(wl * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        this_scale = _div(sum_w * sum_xl - sum_x * sum_l, det)
        this_min = _div(sum_l2 * sum_x - sum_l * sum_xl, det)
        pos = this_min > 0
        this_scale = np.where(pos, _div(sum_xl, sum_l2), this_scale)
        this_min = np.where(pos, _F(0), this_min)
        diff = this_scale * laux + this_min - x
        err = _sum(w * (diff * diff))
        better = ok & (err < best) & ~flat
        best = np.where(better, err, best)
        best_l = np.where(better, laux, best_l)
        scale = np.where(better, this_scale, scale)
        mn = np.where(better, this_min, mn).astype(_F)  # C updates min in place: later steps use the new one
    scale = np.where(flat, _F(0), scale).astype(_F)
    best_l = np.where(flat, _F(0), best_l)
    return scale, (-mn).astype(_F), best_l


def _u8(x: np.ndarray) -> np.ndarray:
    """``uint8_t v = nearest_int(...)``: the int wraps modulo 256."""
    return (_nearest(x).astype(np.int64) & 0xFF).astype(np.uint8)


def _k_affine(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared part of ``quantize_row_q4_K_ref`` / ``q5_K_ref`` for float32 [n, 256]: (the 16 header bytes d,
    dmin, scales[12] as uint8 [n, 16], the codes uint8 [n, 8, 32])."""
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 8, 32).T)  # [32, n*8]
    av = np.sqrt(_sum(sub * sub) / _F(32)).astype(_F)
    scale, neg_min, codes = _make_qkx2(sub, av + np.abs(sub), nmax, rmin, rdelta, nstep)
    scale, neg_min = scale.reshape(n, 8), neg_min.reshape(n, 8)
    codes = codes.T.reshape(n, 8, 32)
    max_scale = np.maximum(scale.max(axis=-1), _F(0))
    max_min = np.maximum(neg_min.max(axis=-1), _F(0))
    inv_scale = np.where(max_scale > 0, _div(_F(63), max_scale), _F(0))[:, None]
    inv_min = np.where(max_min > 0, _div(_F(63), max_min), _F(0))[:, None]
    sc = np.minimum(_u8(inv_scale * scale), 63)
    mn = np.minimum(_u8(inv_min * neg_min), 63)
    d_bytes, d = _fp16((max_scale / _F(63)).astype(_F))
    dmin_bytes, dmin = _fp16((max_min / _F(63)).astype(_F))
    eff = (d[:, None] * sc.astype(_F))[..., None]  # [n, 8, 1]
    off = (dmin[:, None] * mn.astype(_F))[..., None]
    q = np.clip(_nearest(_div(x.reshape(n, 8, 32) + off, eff)), 0, nmax)
    q = np.where(eff != 0, q, codes).astype(np.uint8)  # `if (!d) continue;` keeps the fit's codes
    d_ = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    m_ = mn[:, :4] | ((mn[:, 4:] >> 4) << 6)
    m_d = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    return np.concatenate([d_bytes, dmin_bytes, d_, m_, m_d], axis=1), q


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """Low nibbles of the codes [n, 8, 32] in ggml's K-quant order: byte j of pair p holds sub-blocks 2p, 2p+1."""
    n = q.shape[0]
    low = (q & 0x0F).reshape(n, 4, 2, 32)
    return (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> Q4_K blocks uint8 [n, 144], as llama.cpp's ``quantize_row_q4_K_ref``."""
    head, q = _k_affine(x, 15, -1.0, 0.1, 20)
    return np.concatenate([head, _pack_nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> Q5_K blocks uint8 [n, 176], as llama.cpp's ``quantize_row_q5_K_ref``."""
    head, q = _k_affine(x, 31, -0.5, 0.1, 15)
    high = (q >> 4).astype(np.uint8)  # [n, 8, 32]: bit s of qh[j] is the fifth bit of sub-block s, element j
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    return np.concatenate([head, qh, _pack_nibbles(q)], axis=1)


def _make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants(n, nmax, x, L, rmse_type=1, NULL)`` over sub-blocks: ``x`` float32 [n, R] element-major.
    Returns (scale [R], codes float32 [n, R] in [0, 2*nmax))."""
    fn = _F(nmax)
    idx = np.abs(x).argmax(axis=0)  # the first largest |x|, as the strict `>` in the C loop
    peak = np.take_along_axis(x, idx[None], axis=0)[0]
    zero = np.abs(peak) < _GROUP_MAX_EPS
    peak = np.where(zero, _F(1), peak).astype(_F)
    w = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = np.clip(_nearest(iscale * x), -fn, fn - 1)
        return lv, _sum(w * x * lv), _sum(w * lv * lv)

    iscale = (-fn / peak).astype(_F)
    lv, sumlx, suml2 = fit(iscale)
    best_l = lv + fn
    scale = np.where(suml2 != 0, _div(sumlx, suml2), _F(0)).astype(_F)
    best = (scale * sumlx).astype(_F)
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = (-(fn + _F(0.1) * _F(step)) / peak).astype(_F)
        lv, sumlx, suml2 = fit(iscale)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        best_l = np.where(better, lv + fn, best_l)
        scale = np.where(better, _div(sumlx, suml2), scale).astype(_F)
        best = np.where(better, scale * sumlx, best).astype(_F)
    return np.where(zero, _F(0), scale).astype(_F), np.where(zero, _F(0), best_l)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> Q6_K blocks uint8 [n, 210], as llama.cpp's ``quantize_row_q6_K_ref``."""
    n = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(n * 16, 16).T)  # [16, n*16]
    scales, codes = _make_qx(sub, 32)
    scales, codes = scales.reshape(n, 16), codes.T.reshape(n, 16, 16)
    idx = np.abs(scales).argmax(axis=-1)[:, None]
    max_scale = np.take_along_axis(scales, idx, axis=-1)[:, 0]
    empty = np.abs(max_scale) < _GROUP_MAX_EPS
    iscale = _div(_F(-128), np.where(empty, _F(1), max_scale))
    d_bytes, d = _fp16(_div(_F(1), iscale))
    sc = np.minimum(_nearest(iscale[:, None] * scales), 127).astype(np.int8)
    eff = (d[:, None] * sc.astype(_F))[..., None]  # [n, 16, 1]
    q = np.clip(_nearest(_div(x.reshape(n, 16, 16), eff)), -32, 31) + 32
    q = np.where(eff != 0, q, codes).astype(np.uint8).reshape(n, QK_K)
    low, high = q & 0x0F, q >> 4
    low = low.reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    out = np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
    out[empty] = 0  # an all-zero block is written as zeros, d = 0
    return out


# types gguf-py quantizes bit-exactly like ggml's reference code, and the K-quants we quantize ourselves
GGUF_PY_TYPES = (QType.Q4_0, QType.Q4_1, QType.Q5_0, QType.Q5_1, QType.Q8_0)
_OURS = {QType.Q4_K: quantize_q4_k, QType.Q5_K: quantize_q5_k, QType.Q6_K: quantize_q6_k}
QUANTIZE_TYPES = GGUF_PY_TYPES + tuple(_OURS)


def quantize(x: np.ndarray, qtype: int) -> np.ndarray:
    """Quantize a float array whose last dimension is a whole number of blocks; returns uint8 ``[..., row_bytes]``."""
    if qtype not in QUANTIZE_TYPES:
        names = ", ".join(type_name(t) for t in sorted(QUANTIZE_TYPES))
        raise UnsupportedModelError(f"cannot quantize to {type_name(qtype)} (supported: {names})")
    bs, ts = BLOCK_SIZES[qtype]
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape[-1] % bs:
        raise UnsupportedModelError(f"rows of {x.shape[-1]} are not a whole number of {type_name(qtype)} blocks")
    if qtype in GGUF_PY_TYPES:
        import gguf

        return gguf.quants.quantize(x, gguf.GGMLQuantizationType(qtype))
    out = _OURS[qtype](x.reshape(-1, bs))
    return out.reshape(*x.shape[:-1], x.shape[-1] // bs * ts)
