"""Small numeric building blocks shared by the layers: norms, RoPE, gated delta rule, causal conv."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from ..errors import CheckpointError
from .spec import ModelSpec

__all__ = [
    "attend_invariant",
    "causal_conv",
    "delta_rule_chunked",
    "delta_rule_one",
    "delta_rule_short",
    "delta_rule_steps",
    "flush_denormals_in_process",
    "l2norm",
    "rms_norm",
    "rope_inv_freq",
    "rope_tables",
    "rotate_half_index",
    "apply_rope",
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in fp32; ``weight`` is the effective scale (1 + w already folded in for zero-centred norms).

    torch's ``rms_norm`` does the same operations in the same order (bit-identical) in one call from Python.
    ``weight`` may also hold one scale row per slice of the leading dims (e.g. ``[heads, D]`` for ``x`` ``[N, heads,
    D]``): then the norm runs without a weight and the product follows (the same operations, so the same bits).
    """
    if weight.dim() > 1:
        return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * weight).to(x.dtype)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies for the rotary dims (plain, linear-, llama3- or per-frequency-scaled), fp32."""
    dim = spec.rotary_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if spec.rope_linear is not None:  # positions / factor, as inverse frequencies / factor (transformers does this)
        return inv / spec.rope_linear
    if spec.rope_freq_factors is not None:  # llama.cpp: theta_i / rope_freqs[i]
        if len(spec.rope_freq_factors) != inv.shape[0]:
            raise CheckpointError(f"rope_freqs has {len(spec.rope_freq_factors)} entries; the rotary dims need "
                                  f"{inv.shape[0]}")
        return inv / torch.tensor(spec.rope_freq_factors, dtype=torch.float32)
    if spec.rope_llama3 is None:
        return inv
    factor, low, high, old_len = spec.rope_llama3
    low_wl, high_wl = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wl, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
    return torch.where(medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, head_dim: int, length: int, dtype: torch.dtype) -> torch.Tensor:
    """cos and sin of positions 0..length-1 over whole heads, as :func:`apply_rope` takes them: [2, length, 1, D].

    Past the rotary dims cos is 1 and sin 0 (those dims pass through unchanged); the sign of the rotate-half is
    folded into sin.
    """
    r = 2 * inv_freq.shape[0]
    freqs = torch.arange(length, device=inv_freq.device).float()[:, None] * inv_freq[None, :]  # [L, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)
    table = torch.zeros(2, length, 1, head_dim, dtype=torch.float32, device=inv_freq.device)
    table[0, :, 0, r:] = 1.0
    table[0, :, 0, :r] = emb.cos()
    table[1, :, 0, :r] = emb.sin()
    table[1, :, 0, :r // 2].neg_()
    return table.to(dtype)


@functools.lru_cache(maxsize=16)
def rotate_half_index(head_dim: int, rotary_dim: int, device: torch.device) -> torch.Tensor:
    """[D] indices that swap the two halves of the rotary dims (and keep the others), for :func:`apply_rope`.

    A constant per shape and device; shared, never written."""
    half = rotary_dim // 2
    index = torch.arange(head_dim, device=device)
    index[:half] += half
    index[half:rotary_dim] -= half
    return index


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotate_half: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the leading rotary dims of each head. x: [T, heads, D]; cos/sin: [T, 1, D] rows of
    :func:`rope_tables`; rotate_half: :func:`rotate_half_index`.

    The same products and sum as ``rot * cos + cat(-rot2, rot1) * sin`` on the rotary dims (the same bits); the
    other dims come out as ``x * 1 + x' * 0 = x``.
    """
    return x * cos + x.index_select(-1, rotate_half) * sin


def causal_conv(seq: torch.Tensor, weight: torch.Tensor, invariant: bool = False) -> torch.Tensor:
    """Depthwise causal conv + SiLU over the new inputs of ``seq``.

    seq: [..., C, K-1+T], the previous ``K-1`` inputs (oldest first) followed by the T new ones (a leading batch dim
    holds one window per session); weight: [C, K]. Returns [..., T, C]. ``invariant``: compute with elementwise
    products (batch-invariant mode) instead of conv1d.
    """
    if invariant or seq.shape[-1] - weight.shape[-1] + 1 <= 8:  # products and sums: the same for any T, and
        out = (seq.unfold(-1, weight.shape[-1], 1) * weight[:, None, :]).sum(-1)  # cheaper than conv1d for short steps
    else:  # what transformers does, for the closest match
        out = F.conv1d(seq.reshape(-1, *seq.shape[-2:]), weight[:, None, :], groups=seq.shape[-2])  # [B, C, T]
        out = out.reshape(*seq.shape[:-1], -1)
    return F.silu(out).transpose(-1, -2)


def delta_rule_steps(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gated delta rule, one position at a time, for B sessions at once (decode and short verify steps).

    q, k: [B, T, H, Dk] (already L2-normed, q scaled); v: [B, T, H, Dv]; decay (= exp(g)), beta: [B, T, H];
    state: [B, H, Dk, Dv] fp32, updated in place. ``keep`` [B, T, H, Dk, Dv], if given, receives the state after
    every position (for the rollback rings). Returns the outputs [B, T, H, Dv] fp32.
    """
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    prev = state
    for t in range(q.shape[1]):
        kt = k[:, t, :, :, None]  # [B, H, Dk, 1]
        cur = keep[:, t] if keep is not None else state  # each position's state written in place (no copies)
        torch.mul(prev, decay[:, t, :, None, None], out=cur)
        kv_mem = (cur * kt).sum(-2)  # [B, H, Dv] (products + sum: cheaper than einsum here)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        cur.add_(kt * delta[:, :, None, :])
        torch.sum(cur * q[:, t, :, :, None], -2, out=out[:, t])
        prev = cur
    if keep is not None and q.shape[1]:
        state.copy_(prev)
    return out


def delta_rule_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
) -> torch.Tensor:
    """One position of the gated delta rule for B sessions (decode), with batched products: the maths and arguments
    of :func:`delta_rule_steps` at T = 1 without a ring, ``state`` contiguous or stored transposed
    (``state.rec_layout``). Six ops where the loop takes about 25 (21 against 34 us for Qwen3.5-MoE's 8 heads of
    64 x 64 here); the products sum in bmm's order, so the result equals the loop's to rounding, not bit for bit (the
    batch-invariant mode keeps the loop)."""
    b, _, h, dk = k.shape
    dv = v.shape[-1]
    kr = k.reshape(b * h, 1, dk)
    if not state.is_contiguous():  # stored transposed (state.rec_layout): the same products on M = S^T [Dv, Dk]
        m = state.transpose(-1, -2).view(b * h, dv, dk)
        m.mul_(decay.reshape(b * h, 1, 1))
        delta = (v.reshape(b * h, dv, 1) - torch.bmm(m, kr.transpose(1, 2))).mul_(beta.reshape(b * h, 1, 1))
        m.baddbmm_(delta, kr)
        return torch.bmm(m, q.reshape(b * h, dk, 1)).view(b, 1, h, dv)
    s = state.view(b * h, dk, dv)
    s.mul_(decay.reshape(b * h, 1, 1))
    delta = (v.reshape(b * h, 1, dv) - torch.bmm(kr, s)).mul_(beta.reshape(b * h, 1, 1))
    s.baddbmm_(kr.transpose(1, 2), delta)
    return torch.bmm(q.reshape(b * h, 1, dk), s).view(b, 1, h, dv)


@functools.lru_cache(maxsize=16)
def _above_diagonal(t: int, device: torch.device) -> torch.Tensor:
    """[T, T] bool, True above the diagonal (a constant per step length; shared, never written)."""
    return torch.ones(t, t, dtype=torch.bool, device=device).triu(1)


SHORT_TEMP_BYTES = 256 << 20
"""At most this much temporary memory per :func:`delta_rule_short` call (more sessions go in groups)."""


def delta_rule_short(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    keep: torch.Tensor | None = None, max_temp_bytes: int = SHORT_TEMP_BYTES,
) -> torch.Tensor:
    """Gated delta rule over a short step (verify steps of a few positions) in closed form, for B sessions at once.

    Same maths and arguments as :func:`delta_rule_steps`, except that ``g`` is the log-decay (decay = exp g), and
    with a fixed number of batched calls whatever T instead of a handful per position. With the UT transform of
    :func:`delta_rule_chunked` the corrected values of all positions are ``v_new = u - w @ S0``; then the state after
    position t is ``exp(c_t) S0 + sum_{j<=t} exp(c_t - c_j) k_j v_new_j^T`` (c the cumulative log-decay), all T of
    them in one product, written into ``keep`` [B, T, H, Dk, Dv] (a temporary if None). ``state`` [B, H, Dk, Dv] is
    updated in place. Equal to the position-by-position loop up to rounding (not bit-identical: the batch-invariant
    mode keeps the loop). Returns the outputs [B, T, H, Dv] fp32.

    Its temporaries hold two ``[T, H, Dk, Dv]`` fp32 tensors per session (about 56 MiB a session for Qwen3.5-397B's
    64 x 128 x 128 heads at T=7): sessions go in groups of at most ``max_temp_bytes`` of them, through views of
    ``state`` and ``keep``, so the bound holds for any batch.
    """
    bsz, t, h, dk = k.shape
    dv = v.shape[-1]
    per_session = 2 * t * h * dk * dv * 4
    group = max(1, max_temp_bytes // per_session)
    if bsz > group:
        outs = [delta_rule_short(q[i:i + group], k[i:i + group], v[i:i + group], g[i:i + group], beta[i:i + group],
                                 state[i:i + group], None if keep is None else keep[i:i + group], max_temp_bytes)
                for i in range(0, bsz, group)]
        return torch.cat(outs)
    kh = k.transpose(1, 2)  # [B, H, T, Dk]
    cum = g.transpose(1, 2).cumsum(-1)  # [B, H, T]
    decay = cum.exp()[..., None]  # [B, H, T, 1] exp(c_t)
    beta_h = beta.transpose(1, 2)[..., None]  # [B, H, T, 1]
    # pair[t, j] = exp(c_t - c_j) for j <= t, 0 above the diagonal
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(_above_diagonal(t, k.device), float("-inf")).exp()
    system = (kh @ kh.transpose(-1, -2)) * pair * beta_h  # [B, H, T, T]; the solve reads only below the diagonal
    # v_new = u - w @ S0 = solve(beta * (v - exp(c) k S0)): one solve with S0 already applied
    rhs = (v.transpose(1, 2) - (kh @ state) * decay) * beta_h  # [B, H, T, Dv]
    v_new = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [B, H, T, Dv]
    outer = kh[..., :, None] * v_new[..., None, :]  # [B, H, T, Dk, Dv]
    s0 = state.reshape(bsz, h, 1, dk * dv)  # (a copy where the state is stored transposed)
    states = (pair @ outer.view(bsz, h, t, dk * dv)).addcmul_(decay, s0)  # [B, H, T, Dk*Dv]
    if keep is None:
        keep = outer.new_empty(bsz, t, h, dv, dk).mT if state.mT.is_contiguous() else outer.new_empty(bsz, t, h, dk, dv)
    keep.copy_(states.view(bsz, h, t, dk, dv).transpose(1, 2))  # (matmul's out= into the strided ring view is slower)
    state.copy_(keep[:, -1])
    return (keep * q[..., None]).sum(-2)


_DECAY_FLOOR = -60.0  # a decay under e^-60 (9e-27) is taken as 0 (see _decay)


def _decay(log: torch.Tensor) -> torch.Tensor:
    """``exp(log)``, 0 where ``log`` is under :data:`_DECAY_FLOOR` (whose exponentials, and their products, would be
    denormals: see :func:`delta_rule_chunked`). A term it drops is under 2^-86 of its scale, beside each position's
    own term at e^0 = 1 (its pair with itself)."""
    return log.masked_fill(log < _DECAY_FLOOR, float("-inf")).exp()


_PROCESS_FLUSHES = False  # every thread of this process flushes denormals (flush_denormals_in_process)


def flush_denormals_in_process() -> bool:
    """Flush float32 denormals to zero (FTZ/DAZ) on this thread for good, and so on every thread started after it:
    a new thread inherits its creator's floating-point mode, torch's intra-op pool included, which starts at the
    first parallel operation. Call it before any torch work (the console script does, ``cli.main.entry``; a library
    user decides for their process, and a CLI command run in-process by ``cli.main.main`` leaves it alone). Then the
    chunked delta rule's products are flushed on every thread that computes them, not only on the calling one:
    measured on the mid made MoE's 512-token prefill at 2 threads, 31.3-32.0 -> 34.0-35.2 tokens/s (the rule alone
    88-93 -> 73-76 ms a layer); at one thread nothing changes. Values below float32's normal range (1.2e-38) become
    0 everywhere, as they do inside the chunked rule anyway. Returns whether the CPU has the mode."""
    global _PROCESS_FLUSHES
    _PROCESS_FLUSHES = bool(torch.set_flush_denormal(True))
    return _PROCESS_FLUSHES


def delta_rule_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
    chunk: int = 64,
) -> torch.Tensor:
    """Gated delta rule over a long run of positions in chunks (prefill); same maths as :func:`delta_rule_steps`.

    Within a chunk the delta-rule updates are condensed with a unit-lower-triangular solve (the UT transform of the
    DeltaNet paper); between chunks the recurrent state carries over. ``state`` [H, Dk, Dv] is updated in place.

    Denormals: a chunk's decays multiply into products far below float32's normal range (cumulated log-decays reach
    -1000 on the made MoE), and the CPU's arithmetic on denormals is many times slower: this runs with them flushed
    to zero on the calling thread (FTZ/DAZ, as TensorFlow's CPU kernels do; torch's other threads keep IEEE
    arithmetic, so decays under e^-60 are also taken as 0 before any product, :func:`_decay`). The mode is cleared
    after the call (torch cannot read it back: a caller that had set it sets it again), unless the whole process
    flushes (:func:`flush_denormals_in_process`, which the console script sets). Measured on the mid made MoE's
    512-token prefill, one thread: 295 ms a layer as before, 150 with the floor, 92 with both.
    """
    if _PROCESS_FLUSHES:
        return _chunked(q, k, v, g, beta, state, chunk)
    flushed = torch.set_flush_denormal(True)  # (False where the CPU has no such mode: then nothing changed)
    try:
        return _chunked(q, k, v, g, beta, state, chunk)
    finally:
        if flushed:
            torch.set_flush_denormal(False)


def _chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, chunk: int) -> torch.Tensor:
    t_len = q.shape[0]
    pad = (chunk - t_len % chunk) % chunk
    # [H, T, D] layout, fp32
    q, k, v = (F.pad(x.transpose(0, 1).float(), (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x.transpose(0, 1).float(), (0, pad)) for x in (g, beta))
    h, total, dk = k.shape
    n = total // chunk
    q, k, v = (x.reshape(h, n, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(h, n, chunk), beta.reshape(h, n, chunk)
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)  # [H, N, C]
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    pair = _decay((cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")))  # [H, N, C, C]
    system = (k_beta @ k.transpose(-1, -2)) * pair
    system = system.masked_fill(~torch.ones_like(upper).tril(-1), 0.0)
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    a = system + eye
    u = torch.linalg.solve_triangular(a, v_beta, upper=False, unitriangular=True)
    decay = _decay(cum)[..., None]
    w = torch.linalg.solve_triangular(a, k_beta * decay, upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * pair
    q_dec = q * decay
    k_dec = k * _decay(cum[..., -1:] - cum)[..., None]
    chunk_decay = _decay(cum[..., -1])[..., None, None]  # [H, N, 1, 1]
    out = torch.empty_like(v)
    s = state
    for i in range(n):
        v_new = u[:, i] - w[:, i] @ s
        out[:, i] = q_dec[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k_dec[:, i].transpose(-1, -2) @ v_new
    state.copy_(s)
    return out.reshape(h, total, -1)[:, :t_len].transpose(0, 1)


def attend_invariant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """Causal attention whose every output row is computed the same way whatever the number of query rows.

    q: [H, T, D] at positions start..start+T-1; k, v: [Hkv, L, D] with L = start + T. Each row reduces over exactly
    its own visible keys with elementwise products and sums: BLAS picks different kernels for 1 row and for many,
    and masked softmax sums over a longer row group their terms differently. Used in batch-invariant mode.
    """
    kv, (heads, t_len, dim) = k.shape[0], q.shape
    qg = q.reshape(kv, heads // kv, t_len, dim)  # the query heads that share a KV head, without copying K and V
    k, v = k[:, None], v[:, None]  # [Hkv, 1, L, D]
    scale = dim ** -0.5
    out = torch.empty_like(qg)
    for t in range(t_len):
        n = start + t + 1
        scores = (qg[:, :, t, None, :] * k[:, :, :n, :]).sum(-1) * scale  # [Hkv, rep, n]
        probs = torch.softmax(scores, dim=-1)
        out[:, :, t] = (probs[..., None] * v[:, :, :n, :]).sum(-2)
    return out.reshape(heads, t_len, dim)
