"""Decoder layers that read the real checkpoint names: attention (plain and gated), Gated DeltaNet, MLP and MoE.

Every layer works on a batched step: ``x`` is ``[N, hidden]``, the concatenated new positions of several sessions,
described by ``segments``. Dense work (projections, experts) runs on all N rows at once. The Gated DeltaNet conv
and recurrence run once per group of sessions (equal step length, or equal chunk count for prefills) over their
states stacked for the step; attention runs per session over that session's own KV cache, with one call each.
"""

from __future__ import annotations

import contextvars
import functools
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .experts import DENSE_MAX, StackedExperts
from .ops import (
    apply_rope, attend_invariant, causal_conv, delta_rule_chunked, delta_rule_short, delta_rule_steps, l2norm, rms_norm,
    rotate_half_index,
)
from .spec import FULL, ModelSpec
from .state import AttentionLayerState, LinearLayerState, Segment
from .weights import FusedWeight, Weight, dense

__all__ = ["DecoderLayer", "Loader", "linear"]

# A loader returns the weight for a canonical name relative to a prefix.
Loader = Callable[[str], Weight]

# Steps up to this many positions run the delta rule stepwise; longer ones run it in chunks (as transformers does for
# a prefill), unless the session keeps a rollback ring, which needs every position's state. Stepwise steps of more
# than one position (verify steps) compute all their positions' states in closed form, except in batch-invariant
# mode, which runs them position by position.
_STEPWISE_MAX = 1
_CHUNK = 64  # positions per chunk of the chunked delta rule


# Batch-invariant numerics. BLAS runs a few rows through other kernels (gemv, small-matrix paths) than many rows, and
# vectorised elementwise kernels compute a tensor's tail elements with scalar code, so the same row can differ in its
# last bits depending on what it is batched with. With MIN_ROWS = m > 0, every dense product and every whole-step
# tensor has a row count that is a multiple of m (zero rows are appended), so each row takes the same path whatever
# its neighbours. The stage sets this per step (see StageModel.batch_invariant).
MIN_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("sangama_min_rows", default=0)


def pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``m`` rows (``x`` itself when m is 0 or it fits)."""
    n = x.shape[0]
    target = -(-n // m) * m if m else n
    if target == n:
        return x
    return torch.cat((x, torch.zeros(target - n, *x.shape[1:], dtype=x.dtype, device=x.device)))


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    n, m = x.shape[0], MIN_ROWS.get()
    if bias is not None and bias.dtype != x.dtype:  # biases are kept fp32; a bf16/fp16 step uses them cast
        bias = bias.to(x.dtype)
    if isinstance(w, FusedWeight):  # repacked at load: the kernel multiplies the packed weight itself
        return w.linear(pad_rows(x, m), bias)[:n] if m else w.linear(x, bias)
    if m:
        return F.linear(pad_rows(x, m), dense(w, x.dtype), bias)[:n]
    return F.linear(x, dense(w, x.dtype), bias)


class FusedLinear:
    """Projections of the same input as ONE product when their weights are dense or repacked alike (one each when
    quantized per use).

    The concatenated weight replaces the parts (same bytes), so a decode step makes one call where it made three
    or four: on CPU the per-call overhead, not the arithmetic, dominates small models.
    """

    def __init__(self, weights: list[Weight], biases: list[torch.Tensor] | None = None) -> None:
        self.sizes = [int(w.shape[0]) for w in weights]
        if all(isinstance(w, torch.Tensor) for w in weights) and len({w.dtype for w in weights}) == 1:
            self.parts: list[Weight] = [torch.cat(weights)]  # type: ignore[arg-type]
            self.biases: list[torch.Tensor | None] = [torch.cat(biases) if biases else None]
        elif isinstance(weights[0], FusedWeight) and (joined := weights[0].concat(weights)) is not None:
            self.parts = [joined]
            self.biases = [torch.cat(biases) if biases else None]
        else:
            self.parts = list(weights)
            self.biases = list(biases) if biases else [None] * len(weights)

    def weights(self) -> Iterator[Weight]:
        yield from self.parts
        yield from (b for b in self.biases if b is not None)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if len(self.parts) == 1:
            return list(linear(x, self.parts[0], self.biases[0]).split(self.sizes, dim=-1))
        return [linear(x, w, b) for w, b in zip(self.parts, self.biases)]


def norm_weight(w: Weight, spec: ModelSpec) -> torch.Tensor:
    """Effective RMSNorm scale, fp32: Qwen3.5 stores w and applies 1 + w."""
    t = dense(w, torch.float32)
    return (t + 1.0) if spec.zero_centered_norm else t


@functools.lru_cache(maxsize=8)
def _step_mask(t: int, start: int, rep: int, device: torch.device) -> torch.Tensor:
    """[rep * T, start + T] bool: causal within a step of T positions from ``start``, every cached position visible
    (one row per query row of the ``rep`` heads that share a KV head). A constant per shape; shared, never written.
    Cached so that a step's attention layers build it once (a few recent shapes only: one is start + T bytes long)."""
    return torch.ones(t, start + t, dtype=torch.bool, device=device).tril(start).repeat(rep, 1)


class Attention:
    """Full attention with GQA and partial RoPE; optional q/k/v biases (Qwen2; Llama's attention_bias, with an o_proj
    bias), q/k head norms (Qwen3, Qwen3-MoE, Qwen3.5) and Qwen3.5's sigmoid output gate."""

    def __init__(self, spec: ModelSpec, load: Loader, layer_key: int) -> None:
        self.spec = spec
        self.key = layer_key
        biases = [dense(load(f"self_attn.{p}_proj.bias"), torch.float32) for p in "qkv"] if spec.attention_bias \
            else None
        self.qkv = FusedLinear([load(f"self_attn.{p}_proj.weight") for p in "qkv"], biases)
        self.o = load("self_attn.o_proj.weight")
        self.o_bias = dense(load("self_attn.o_proj.bias"), torch.float32) if spec.o_proj_bias else None
        self.qk_norm = None  # [heads + kv_heads, head_dim]: q's norm scale for every query head, then k's
        if spec.qk_norm:
            q_norm = norm_weight(load("self_attn.q_norm.weight"), spec)
            k_norm = norm_weight(load("self_attn.k_norm.weight"), spec)
            self.qk_norm = torch.cat((q_norm.expand(spec.num_heads, -1), k_norm.expand(spec.num_kv_heads, -1)))

    def weights(self) -> Iterator[Weight]:
        yield from self.qkv.weights()
        yield self.o
        yield from (t for t in (self.o_bias, self.qk_norm) if t is not None)

    def forward(self, x: torch.Tensor, segments: list[Segment], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [N, hidden]; cos, sin: [N, 1, head_dim], the rows' RoPE (``StageModel.rope_rows``)."""
        spec = self.spec
        n, hd, heads, kv = x.shape[0], spec.head_dim, spec.num_heads, spec.num_kv_heads
        q, k, v = self.qkv(x)
        gate = None
        if spec.attn_output_gate:
            q, gate = q.reshape(n, heads, 2 * hd).chunk(2, dim=-1)  # [N, heads, hd] each
            gate = gate.reshape(n, heads * hd)
        # q and k side by side: one norm call and one rotation for both
        qk = torch.cat((q.reshape(n, heads, hd), k.reshape(n, kv, hd)), dim=1)  # [N, heads + kv, hd]
        if self.qk_norm is not None:
            qk = rms_norm(qk, self.qk_norm, spec.rms_norm_eps)
        q, k = apply_rope(qk, cos, sin, rotate_half_index(hd, spec.rotary_dim, x.device)).split((heads, kv), dim=1)
        v = v.reshape(n, kv, hd)

        rep = heads // kv
        invariant = MIN_ROWS.get()
        # Without the batch-invariant mode, the `rep` query heads that share a KV head go in as `rep` times the rows
        # of that head (no enable_gqa, which expands K and V on every call: 5x the cost of a small call here).
        qg = q.reshape(n, kv, rep, hd).permute(1, 2, 0, 3)  # [kv, rep, N, hd]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, kv, N, hd]
        if len(segments) == 1 and segments[0].length == n:  # one session, no padding: no split, no concatenation
            out = self._attend(segments[0], qg, k, v, q, 0, invariant).permute(2, 0, 1, 3)  # [N, kv, rep, hd]
        else:
            lengths = [seg.length for seg in segments]
            if sum(lengths) < n:  # batch-invariant mode's padding rows
                lengths.append(n - sum(lengths))
            outs, row = [], 0
            # one split call for all sessions' rows, then narrow and copy_ (the cheapest per-session calls)
            per_session = zip(segments, qg.split(lengths, dim=2), k.split(lengths, dim=2), v.split(lengths, dim=2))
            for seg, qs, ks, vs in per_session:
                outs.append(self._attend(seg, qs, ks, vs, q, row, invariant))
                row += seg.length
            out = torch.cat(outs, dim=2).permute(2, 0, 1, 3).reshape(row, heads, hd)  # [N', heads, hd]
            if row < n:  # batch-invariant mode's padding rows
                out = torch.cat((out, out.new_zeros(n - row, *out.shape[1:])))
        out = out.reshape(n, heads * hd)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return linear(out, self.o, self.o_bias)

    def _attend(
        self, seg: Segment, qs: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor, q: torch.Tensor, row: int,
        invariant: int,
    ) -> torch.Tensor:
        """One session: its new K and V into its cache, then attention over the cache. qs: [kv, rep, T, hd]; ks, vs:
        [1, kv, T, hd]; q: all rows [N, heads, hd] (the batch-invariant path's layout). Returns [kv, rep, T, hd]."""
        st = seg.state.layers[self.key]
        assert isinstance(st, AttentionLayerState)
        kv, rep, t, hd = qs.shape
        end = seg.start + t
        st.k.narrow(2, seg.start, t).copy_(ks)
        st.v.narrow(2, seg.start, t).copy_(vs)
        keys, values = st.k.narrow(2, 0, end), st.v.narrow(2, 0, end)
        if invariant:
            o = attend_invariant(q[row:row + t].transpose(0, 1), keys[0], values[0], seg.start)  # [heads, T, hd]
        else:
            mask = _step_mask(t, seg.start, rep, qs.device) if t > 1 else None  # causal within the step
            o = F.scaled_dot_product_attention(qs.reshape(1, kv, rep * t, hd), keys, values, attn_mask=mask)
        return o.reshape(kv, rep, t, hd)


class GatedDeltaNet:
    """Qwen3.5's linear attention: causal conv + gated delta rule with a recurrent state per session."""

    def __init__(self, spec: ModelSpec, load: Loader, layer_key: int) -> None:
        self.spec = spec
        self.key = layer_key
        self.in_proj = FusedLinear([load(f"linear_attn.in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")])
        self.out = load("linear_attn.out_proj.weight")
        conv = dense(load("linear_attn.conv1d.weight"), torch.float32)
        self.conv = conv.reshape(conv.shape[0], conv.shape[-1])  # [C, 1, K] -> [C, K]
        self.neg_a = -dense(load("linear_attn.A_log"), torch.float32).exp()  # -exp(A_log), [Hv]
        self.dt_bias = dense(load("linear_attn.dt_bias"), torch.float32)
        self.norm = dense(load("linear_attn.norm.weight"), torch.float32)  # plain (not zero-centred) gated norm

    def weights(self) -> Iterator[Weight]:
        yield from self.in_proj.weights()
        yield from (self.out, self.conv, self.neg_a, self.dt_bias, self.norm)

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        spec = self.spec
        n, nv, dv = x.shape[0], spec.linear_num_value_heads, spec.linear_value_head_dim
        mixed, z, b, a = self.in_proj(x)  # [N, conv_dim], [N, value_dim], [N, Hv], [N, Hv]
        beta = torch.sigmoid(b.float())
        g = self.neg_a * F.softplus(a.float() + self.dt_bias)
        # sessions run as groups, each one batched conv + delta rule over the group's stacked states: steps run
        # position by position (decode, verify) grouped by length; chunked steps (prefills without a rollback ring)
        # by chunk count, shorter ones padded (one session per group in batch-invariant mode)
        invariant = bool(MIN_ROWS.get())
        groups: dict[tuple, list[tuple[LinearLayerState, int, int, bool]]] = {}
        row = 0
        for seg in segments:
            st = seg.state.layers[self.key]
            assert isinstance(st, LinearLayerState)
            t = seg.length
            keep_ring = t > 1 and seg.state.ring >= t  # a 1-token step is never rolled back into
            if keep_ring or t <= _STEPWISE_MAX:
                key: tuple = (False, t)
            else:
                key = (True, id(st) if invariant else -(-t // _CHUNK))
            groups.setdefault(key, []).append((st, row, t, keep_ring))
            row += t
        conv_w = self.conv.to(x.dtype)
        # position by position (one-token steps, and every step in batch-invariant mode) with the decay itself;
        # chunked and closed-form short steps with the log-decay
        looped = {key: not key[0] and (key[1] == 1 or invariant) for key in groups}
        decay = g.exp() if any(looped.values()) else g
        parts = [self._group(items, key[0], mixed, decay if looped[key] else g, beta, conv_w, looped[key])
                 for key, items in groups.items()]
        if len(parts) == 1 and parts[0][0] == slice(0, n):  # one group, all rows in order
            core = parts[0][1]
        else:
            core = torch.zeros(n, nv, dv, dtype=torch.float32, device=x.device)
            for rows, out in parts:
                core[rows] = out
        # gated RMSNorm over each value head, then the output projection
        core = rms_norm(core, self.norm, spec.rms_norm_eps) * F.silu(z.float().reshape(n, nv, dv))
        return linear(core.reshape(n, nv * dv).to(x.dtype), self.out)

    def _qkv(self, mixed_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Conv outputs [..., C] -> q, k (L2-normed, q scaled, repeated to the value heads) [..., Hv, Dk], v."""
        spec = self.spec
        nk, nv, dk = spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_key_head_dim
        lead, x = mixed_t.shape[:-1], mixed_t.float()
        # q's and k's heads side by side in one norm call, made contiguous first, so that each head's norm sums its
        # terms in the same order whatever T (a norm over a strided view would not); then repeated to the value heads
        qk = l2norm(x[..., :2 * spec.linear_key_dim].reshape(*lead, 2 * nk, dk).contiguous())
        qk = qk.repeat_interleave(nv // nk, dim=-2)  # [..., 2 Hv, Dk]: q's heads, then k's
        v = x[..., 2 * spec.linear_key_dim:].reshape(*lead, nv, spec.linear_value_head_dim)
        return qk[..., :nv, :] * dk ** -0.5, qk[..., nv:, :], v

    def _group(
        self, items: list[tuple[LinearLayerState, int, int, bool]], chunked: bool, mixed: torch.Tensor,
        g: torch.Tensor, beta: torch.Tensor, conv_w: torch.Tensor, looped: bool,
    ) -> tuple[slice | torch.Tensor, torch.Tensor]:
        """Steps of B sessions as one batched conv + delta rule over their stacked states.

        ``items``: (layer state, first row, length, keep ring) per session; ``looped``: a stepwise group that runs
        position by position (:func:`delta_rule_steps`; one-token steps, and any step in batch-invariant mode), with
        ``g`` the decay itself (exp g); other stepwise groups (verify steps) run :func:`delta_rule_short`, chunked
        ones :func:`delta_rule_chunked`, both with ``g`` the log-decay. A chunked group's shorter steps are padded at
        the end with positions of zero gate and zero beta, which leave the state as it is. For B > 1 the recurrent states
        are gathered into one temporary [B, ...] tensor and written back after the step (and into the rollback rings
        of the sessions that keep one); a session alone is updated in place, its ring written directly. The
        sessions' own tensors stay where they are. Returns the step's rows (a slice or indices) and their outputs
        [rows, Hv, Dv] fp32.
        """
        spec = self.spec
        nv, bsz = spec.linear_num_value_heads, len(items)
        t = max(n for _, _, n, _ in items)
        states = [st for st, _, _, _ in items]
        width = states[0].conv.shape[1]
        first = items[0][1]
        if all(r == first + i * t and n == t for i, (_, r, n, _) in enumerate(items)):  # no gather, no padding
            rows: slice | torch.Tensor = slice(first, first + bsz * t)
            place = None
            new = mixed[rows]
            gate, bet = g[rows].view(bsz, t, nv), beta[rows].view(bsz, t, nv)
        else:
            rows = torch.tensor([r + i for _, r, n, _ in items for i in range(n)], device=mixed.device)
            place = torch.tensor([b * t + i for b, (_, _, n, _) in enumerate(items) for i in range(n)],
                                 device=mixed.device)
            new = mixed.new_zeros(bsz * t, mixed.shape[1]).index_copy_(0, place, mixed[rows])
            gb = g.new_zeros(2, bsz * t, nv).index_copy_(1, place, torch.stack((g[rows], beta[rows])))
            gate, bet = gb.view(2, bsz, t, nv).unbind(0)  # [B, T, Hv] each
        seq = torch.cat((torch.stack([st.conv for st in states]), new.reshape(bsz, t, -1).transpose(1, 2)), dim=-1)
        q, k, v = self._qkv(causal_conv(seq, conv_w, invariant=bool(MIN_ROWS.get())))  # [B, T, Hv, D] each
        windows = list(seq[:, :, t:t + width].unbind(0)) if place is None else \
            [seq[b, :, n:n + width] for b, (_, _, n, _) in enumerate(items)]  # the last K-1 inputs of each session
        torch._foreach_copy_([st.conv for st in states], windows)
        ringed = [i for i, (_, _, _, keep) in enumerate(items) if keep]
        alone = bsz == 1  # one session: its own state and ring, updated in place (no gather, no write-back)
        rec = states[0].rec.unsqueeze(0) if alone else torch.stack([st.rec for st in states])  # [B, Hv, Dk, Dv]
        if not ringed:
            after = None
        else:  # the state after every position
            after = states[0].ring_rec[:t].unsqueeze(0) if alone else rec.new_empty(bsz, t, *rec.shape[1:])
        if chunked:  # the sessions' heads side by side: [T, B*Hv, D]
            def fold(x: torch.Tensor) -> torch.Tensor:
                return x.transpose(0, 1).reshape(t, bsz * nv, *x.shape[3:])

            out = delta_rule_chunked(fold(q), fold(k), fold(v), fold(gate), fold(bet),
                                     rec.view(bsz * nv, *rec.shape[2:]), chunk=min(t, _CHUNK))
            out = out.reshape(t, bsz, nv, -1).transpose(0, 1)
        elif looped:
            out = delta_rule_steps(q, k, v, gate, bet, rec, after)
        else:
            out = delta_rule_short(q, k, v, gate, bet, rec, after)
        if not alone:
            torch._foreach_copy_([st.rec for st in states], list(rec.unbind(0)))
        if ringed:  # stepwise groups only (their steps all have length t): one copy per ring, for rollback
            every = seq.unfold(-1, width, 1)[:, :, 1:t + 1].transpose(1, 2)  # [B, T, C, K-1] after each position
            dst = [states[j].ring_conv[:t] for j in ringed]
            src = [every[j] for j in ringed]
            if not alone:  # (alone, the states went straight into the ring)
                dst += [states[j].ring_rec[:t] for j in ringed]
                src += [after[j] for j in ringed]  # type: ignore[index]
            torch._foreach_copy_(dst, src)
        out = out.reshape(bsz * t, nv, -1)
        return rows, out if place is None else out[place]


class DenseMLP:
    """SwiGLU MLP (Llama's FFN and Qwen3.5's shared expert)."""

    def __init__(self, load: Loader, prefix: str, bias: bool = False) -> None:
        biases = [dense(load(f"{prefix}.{p}.bias"), torch.float32) for p in ("gate_proj", "up_proj")] if bias \
            else None
        self.gate_up = FusedLinear([load(f"{prefix}.gate_proj.weight"), load(f"{prefix}.up_proj.weight")], biases)
        self.down = load(f"{prefix}.down_proj.weight")
        self.down_bias = dense(load(f"{prefix}.down_proj.bias"), torch.float32) if bias else None

    def weights(self) -> Iterator[Weight]:
        yield from self.gate_up.weights()
        yield self.down
        if self.down_bias is not None:
            yield self.down_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return linear(F.silu(gate) * up, self.down, self.down_bias)


class MoE:
    """Top-k softmax router (renormalised when ``norm_topk_prob``) over experts, plus a sigmoid-gated shared expert
    when the model has one (Qwen3.5-MoE; Qwen3-MoE has none)."""

    def __init__(self, spec: ModelSpec, load: Loader) -> None:
        self.spec = spec
        self.router = load("mlp.gate.weight")
        self.experts = [DenseMLP(load, f"mlp.experts.{e}") for e in range(spec.num_experts)]
        self.shared = DenseMLP(load, "mlp.shared_expert") if spec.shared_expert_intermediate_size else None
        self.shared_gate = load("mlp.shared_expert_gate.weight") if self.shared else None
        self.stacked = StackedExperts.build(self.experts)  # many-row steps in a few products (model/experts.py)

    def weights(self) -> Iterator[Weight]:
        yield self.router
        for e in self.experts:
            yield from e.weights()
        if self.shared is not None:
            yield from self.shared.weights()
            yield self.shared_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.spec.num_experts_per_tok, dim=-1)  # [N, k]
        if self.spec.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        n, st = x.shape[0], self.stacked
        if st is not None and st.dense_ok and (MIN_ROWS.get() or n * st.per_row <= DENSE_MAX):
            # small experts: every expert on every row in a few products, one row included (cheaper than the loop
            # below: 46 vs 95 us per layer for one row of the tiny model); the batch-invariant mode always
            return self._add_shared(x, st.dense(x, top_i, top_w))
        if n == 1 and not MIN_ROWS.get():  # one token (decode): no gathering or scattering at all
            out = None
            for slot, e in sorted(enumerate(top_i[0].tolist()), key=lambda se: se[1]):
                y = self.experts[e].forward(x) * top_w[0, slot]
                out = y if out is None else out + y
            assert out is not None
            return self._add_shared(x, out)
        if st is not None and not MIN_ROWS.get() and (out := st.grouped(x, top_i, top_w)) is not None:
            return self._add_shared(x, out)
        out = torch.zeros_like(x)
        # group (token, slot) pairs by expert in Python: cheaper than torch.unique + where for the few rows of a step
        groups: dict[int, tuple[list[int], list[int]]] = {}
        for token, row in enumerate(top_i.tolist()):
            for slot, e in enumerate(row):
                tokens, slots = groups.setdefault(e, ([], []))
                tokens.append(token)
                slots.append(slot)
        for e in sorted(groups):
            token = torch.tensor(groups[e][0], device=x.device)
            slot = torch.tensor(groups[e][1], device=x.device)
            y = self.experts[e].forward(x[token]) * top_w[token, slot, None]
            out.index_add_(0, token, y)
        return self._add_shared(x, out)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared is None:
            return out
        # a one-column product as multiply + sum (BLAS treats it as gemv, whose rounding depends on the row count),
        # and the sigmoid taken over [N, hidden] rather than [N, 1], where a vectorised kernel's scalar tail would
        # again depend on N
        logit = (x * dense(self.shared_gate, x.dtype).reshape(1, -1)).sum(-1, keepdim=True)
        return out + torch.sigmoid(logit.expand(-1, x.shape[1])) * self.shared.forward(x)


class DecoderLayer:
    """Pre-norm residual block: token mixer (attention or Gated DeltaNet) then FFN (dense MLP or MoE)."""

    def __init__(self, spec: ModelSpec, load: Loader, layer_key: int, layer_type: str) -> None:
        self.spec = spec
        self.kind = layer_type
        self.input_norm = norm_weight(load("input_layernorm.weight"), spec)
        self.post_norm = norm_weight(load("post_attention_layernorm.weight"), spec)
        self.mixer: Attention | GatedDeltaNet = (
            Attention(spec, load, layer_key) if layer_type == FULL else GatedDeltaNet(spec, load, layer_key)
        )
        self.ffn: MoE | DenseMLP = MoE(spec, load) if spec.is_moe else DenseMLP(load, "mlp", spec.mlp_bias)

    def weights(self) -> Iterator[Weight]:
        yield from (self.input_norm, self.post_norm)
        yield from self.mixer.weights()
        yield from self.ffn.weights()

    def forward(self, x: torch.Tensor, segments: list[Segment], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = rms_norm(x, self.input_norm, self.spec.rms_norm_eps)
        if isinstance(self.mixer, Attention):
            h = self.mixer.forward(h, segments, cos, sin)
        else:
            h = self.mixer.forward(h, segments)
        x = x + h
        return x + self.ffn.forward(rms_norm(x, self.post_norm, self.spec.rms_norm_eps))

