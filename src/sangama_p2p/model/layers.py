"""Decoder layers that read the real checkpoint names: attention (plain and gated), MoE, and the decoder block
(the Gated DeltaNet is in ``deltanet.py``, dense products and the MLP in ``linear.py``).

Every layer works on a batched step: ``x`` is ``[N, hidden]``, the concatenated new positions of several sessions,
described by ``segments``. Dense work (projections, experts) runs on all N rows at once. The Gated DeltaNet conv
and recurrence run once per group of sessions (equal step length, or equal chunk count for prefills) over their
states stacked for the step; attention runs per session over that session's own KV cache, with one call each.
"""

from __future__ import annotations

import functools
from typing import Iterator

import torch
import torch.nn.functional as F

from .deltanet import GatedDeltaNet
from .experts import DENSE_MAX, StackedExperts
from .gguf.ggml_layer import MAX_ROWS, layer_step, moe_step
from .linear import MIN_ROWS, DenseMLP, FusedLinear, Loader, linear, norm_weight
from .ops import apply_rope, attend_invariant, rms_norm, rotate_half_index
from .spec import FULL, ModelSpec
from .state import AttentionLayerState, Segment
from .weights import FusedWeight, GroupedExperts, Weight, dense

__all__ = ["Attention", "DecoderLayer", "MoE"]


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


class MoE:
    """Top-k softmax router (renormalised when ``norm_topk_prob``) over experts, plus a sigmoid-gated shared expert
    when the model has one (Qwen3.5-MoE; Qwen3-MoE has none)."""

    def __init__(self, spec: ModelSpec, load: Loader) -> None:
        self.spec = spec
        self.router = load("mlp.gate.weight")
        # experts whose weights group (one product per projection for all of them: ggml's, model/gguf/ggml_kernels.py)
        # run as one; the others each as its own MLP
        loaded = {f"mlp.experts.{e}.{p}_proj.weight": load(f"mlp.experts.{e}.{p}_proj.weight")
                  for e in range(spec.num_experts) for p in ("gate", "up", "down")}
        first = loaded["mlp.experts.0.gate_proj.weight"]
        self.grouped: GroupedExperts | None = type(first).group_experts(
            *[[loaded[f"mlp.experts.{e}.{p}_proj.weight"] for e in range(spec.num_experts)]
              for p in ("gate", "up", "down")]) if isinstance(first, FusedWeight) else None
        self.experts = [] if self.grouped is not None else [
            DenseMLP(lambda name: loaded.pop(name) if name in loaded else load(name), f"mlp.experts.{e}")
            for e in range(spec.num_experts)]
        self.shared = DenseMLP(load, "mlp.shared_expert") if spec.shared_expert_intermediate_size else None
        self.shared_gate = load("mlp.shared_expert_gate.weight") if self.shared else None
        self.stacked = StackedExperts.build(self.experts)  # many-row steps in a few products (model/experts.py)
        # a decode row's MLPs (every expert, the shared one) chain natively in one dtype: the row is cast once
        mlps = self.experts + ([self.shared] if self.shared is not None else [])
        takes = {m.takes for m in mlps}
        self._decode_native = len(takes) == 1 and all(m.native for m in mlps)
        self._decode_dtype: torch.dtype | None = next(iter(takes)) if self._decode_native else None
        self.step = moe_step(self) if self.grouped is not None else None  # the whole layer as one ggml graph

    def weights(self) -> Iterator[Weight]:
        yield self.router
        if self.grouped is not None:
            yield from self.grouped.weights()
        for e in self.experts:
            yield from e.weights()
        if self.shared is not None:
            yield from self.shared.weights()
            yield self.shared_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.step is not None and x.device.type == "cpu" and x.shape[0] <= MAX_ROWS:  # row by row: invariant
            return self.step(x).to(x.dtype)
        logits = linear(x, self.router)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.spec.num_experts_per_tok, dim=-1)  # [N, k]
        if self.spec.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(x.dtype)
        n, st = x.shape[0], self.stacked
        if self.grouped is not None:
            out = self.grouped(x, top_i, top_w).to(x.dtype)
            return self._decode_shared(x, out) if n == 1 and not MIN_ROWS.get() else self._add_shared(x, out)
        if st is not None and st.dense_ok and (MIN_ROWS.get() or n * st.per_row <= DENSE_MAX):
            # small experts: every expert on every row in a few products, one row included (cheaper than the loop
            # below: 46 vs 95 us per layer for one row of the tiny model); the batch-invariant mode always
            return self._add_shared(x, st.dense(x, top_i, top_w))
        if n == 1 and not MIN_ROWS.get():  # one token (decode): no gathering or scattering at all
            return self._decode_experts(x, top_i[0].tolist(), top_w[0].tolist())
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

    def _decode_experts(self, x: torch.Tensor, experts: list[int], weights: list[float]) -> torch.Tensor:
        """One row through its experts, summed with their routing weights (in expert order), then the shared expert
        with its sigmoid gate. Repacked experts take the row cast once for all of them and give their outputs in the
        kernels' dtype, added in ``x``'s: per expert one call less per product and no indexing of the weights
        (``add_`` takes each as a number); the shared expert's gate is one number too (its sigmoid of one value,
        not of the [N, hidden] broadcast that :meth:`_add_shared` takes for batch invariance)."""
        out = torch.zeros_like(x)
        native = self._decode_native
        xin = x.to(self._decode_dtype or x.dtype) if native else x
        for slot, e in sorted(enumerate(experts), key=lambda se: se[1]):
            mlp = self.experts[e]
            out.add_(mlp.forward_native(xin) if native else mlp.forward(x), alpha=weights[slot])
        return self._decode_shared(x, out, xin if native else None)

    def _decode_shared(self, x: torch.Tensor, out: torch.Tensor, xin: torch.Tensor | None = None) -> torch.Tensor:
        """``out`` (one row's experts) plus the shared expert with its sigmoid gate, taken as one number; ``xin``:
        the row already cast to what the shared expert's native products take, if it was."""
        if self.shared is not None:
            logit = (x * dense(self.shared_gate, x.dtype).reshape(1, -1)).sum()
            gate = float(torch.sigmoid(logit))
            takes = self.shared.takes
            if self.shared.native and takes is not None:
                y = self.shared.forward_native(xin if xin is not None else x.to(takes))
            else:
                y = self.shared.forward(x)
            out.add_(y, alpha=gate)
        return out

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
        self.step = layer_step(self)  # the layer around its MoE as one ggml graph, where its weights are ggml's

    def weights(self) -> Iterator[Weight]:
        yield from (self.input_norm, self.post_norm)
        yield from self.mixer.weights()
        yield from self.ffn.weights()

    def forward(self, x: torch.Tensor, segments: list[Segment], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        graphs = self.step is not None and x.dtype == torch.float32 and x.device.type == "cpu" and \
            x.shape[0] <= MAX_ROWS
        if graphs and self.step.mixer is not None and (st := self.mixer.graph_state(segments)) is not None:  # type: ignore
            return self.step(x, st.conv, st.rec)  # type: ignore[union-attr]  # a token: the whole layer
        h = rms_norm(x, self.input_norm, self.spec.rms_norm_eps)
        if isinstance(self.mixer, Attention):
            h = self.mixer.forward(h, segments, cos, sin)
        else:
            h = self.mixer.forward(h, segments)
        x = x + h
        if graphs:
            return self.step.ffn(x)  # type: ignore[union-attr]  # norm, MoE and the residual as one graph
        return x + self.ffn.forward(rms_norm(x, self.post_norm, self.spec.rms_norm_eps))

