"""Reference quantizers for the writers: Q4_K, Q5_K and Q6_K here; Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 are gguf-py's
(bit-exact with ggml's reference code).

Q4_K and Q5_K follow llama.cpp's ``quantize_row_q4_K_ref`` / ``q5_K_ref`` (``make_qkx2_quants``: a weighted affine
fit per 32-element sub-block with a search over 21 / 16 candidate scales), vectorised over all sub-blocks. Q6_K is
simpler than llama.cpp's ``make_qx_quants`` (no scale search): a symmetric fit to each 16-element sub-block's largest
magnitude. All store 6-bit (Q4_K, Q5_K) or 8-bit (Q6_K) sub-block scales under an fp16 super-block scale, in exactly ggml's layout, so
llama.cpp, gguf-py and our dequantizers all read these blocks alike.
"""

from __future__ import annotations

import numpy as np

from ...errors import UnsupportedModelError
from .quants import BLOCK_SIZES, QK_K, QType, type_name

__all__ = ["QUANTIZE_TYPES", "quantize"]


def _fp16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the fp16 bytes [n, 2], the value they hold as float32 [n, 1])."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(-1, 2), h.astype(np.float32).reshape(-1, 1)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> Q6_K blocks uint8 [n, 210]."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    idx = np.abs(sub).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(sub, idx, axis=-1)[..., 0]  # signed value of largest magnitude
    scale = (peak / -32.0).astype(np.float32)  # the peak maps to -32, the widest end of [-32, 31]
    amax = np.abs(scale).max(axis=-1)
    d_bytes, d = _fp16(amax / 127.0)
    sc = np.clip(np.rint(_safe_div(scale, d)), -128, 127).astype(np.int8)  # [n, 16]
    eff = (d * sc.astype(np.float32))[..., None]  # [n, 16, 1]
    q = np.clip(np.rint(_safe_div(sub, eff)) + 32, 0, 63).astype(np.uint8).reshape(n, QK_K)
    low, high = q & 0x0F, q >> 4
    low = low.reshape(n, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128)
    high = high.reshape(n, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(n, 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple:
    """llama.cpp's ``make_qkx2_quants`` over rows of ``x`` at once: an affine fit ``scale * L + min`` (min <= 0),
    searching ``nstep + 1`` candidate scales and solving weighted least squares for each. Returns (scale, -min)."""
    lo = np.minimum(x.min(axis=-1), 0.0)
    hi = x.max(axis=-1)
    flat = hi == lo
    span = np.where(flat, 1.0, hi - lo).astype(np.float32)
    sum_w = w.sum(axis=-1)
    sum_x = (w * x).sum(axis=-1)
    iscale = nmax / span
    scale = 1.0 / iscale
    q = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    best = (w * (scale[:, None] * q + lo[:, None] - x) ** 2).sum(axis=-1)
    best_scale, best_min = scale.copy(), lo.copy()
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * step + nmax) / span
        q = np.clip(np.rint(iscale[:, None] * (x - lo[:, None])), 0, nmax)
        sum_l = (w * q).sum(axis=-1)
        sum_l2 = (w * q * q).sum(axis=-1)
        sum_xl = (w * q * x).sum(axis=-1)
        det = sum_w * sum_l2 - sum_l * sum_l
        ok = det > 0
        safe = np.where(ok, det, 1.0)
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe
        pos = this_min > 0
        this_scale = np.where(pos, sum_xl / np.where(sum_l2 > 0, sum_l2, 1.0), this_scale)
        this_min = np.where(pos, 0.0, this_min)
        err = (w * (this_scale[:, None] * q + this_min[:, None] - x) ** 2).sum(axis=-1)
        better = ok & (err < best)
        best = np.where(better, err, best)
        best_scale = np.where(better, this_scale, best_scale)
        best_min = np.where(better, this_min, best_min)
    best_scale = np.where(flat, 0.0, best_scale)
    best_min = np.where(flat, lo, best_min)
    return best_scale.astype(np.float32), (-best_min).astype(np.float32)


def _k_affine(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared part of llama.cpp's ``quantize_row_q4_K_ref`` / ``q5_K_ref``: per 32-element sub-block an affine
    fit with codes in [0, nmax], 6-bit sub-block scales and mins under fp16 super-block scales. Returns (the 16
    header bytes d, dmin, scales[12] as uint8 [n, 16], the codes uint8 [n, 8, 32])."""
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av = np.sqrt((sub * sub).mean(axis=-1, keepdims=True))
    scale, neg_min = _make_qkx2(sub, av + np.abs(sub), nmax, rmin, rdelta, nstep)
    scale, neg_min = scale.reshape(n, 8), neg_min.reshape(n, 8)
    d_bytes, d = _fp16(scale.max(axis=-1) / 63.0)
    dmin_bytes, dmin = _fp16(neg_min.max(axis=-1) / 63.0)
    sc = np.clip(np.rint(scale * _safe_div(np.float32(63.0), scale.max(axis=-1, keepdims=True))), 0, 63)
    mn = np.clip(np.rint(neg_min * _safe_div(np.float32(63.0), neg_min.max(axis=-1, keepdims=True))), 0, 63)
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    eff = (d * sc.astype(np.float32))[..., None]
    off = (dmin * mn.astype(np.float32))[..., None]
    q = np.clip(np.rint(_safe_div(x.reshape(n, 8, 32) + off, eff)), 0, nmax).astype(np.uint8)
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
    """float32 [n, 256] -> Q4_K blocks uint8 [n, 144], following llama.cpp's ``quantize_row_q4_K_ref``."""
    head, q = _k_affine(x, 15, -1.0, 0.1, 20)
    return np.concatenate([head, _pack_nibbles(q)], axis=1)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 [n, 256] -> Q5_K blocks uint8 [n, 176], following llama.cpp's ``quantize_row_q5_K_ref``."""
    head, q = _k_affine(x, 31, -0.5, 0.1, 15)
    high = (q >> 4).astype(np.uint8)  # [n, 8, 32]: bit s of qh[j] is the fifth bit of sub-block s, element j
    qh = np.zeros((q.shape[0], 32), np.uint8)
    for s in range(8):
        qh |= high[:, s] << s
    return np.concatenate([head, qh, _pack_nibbles(q)], axis=1)


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
