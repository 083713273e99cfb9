"""Qwen3.5's Gated DeltaNet (linear attention): a causal conv and the gated delta rule, with a recurrent state per
session and, for steps that may be rolled back into, the state after every position in the session's ring.

Sessions run as groups, each one batched conv + delta rule over the group's stacked states (see
:meth:`GatedDeltaNet.forward`).
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F

from .gguf.ggml_layer import deltanet_step
from .linear import MIN_ROWS, FusedLinear, Loader, linear
from .ops import (causal_conv, delta_rule_chunked, delta_rule_one, delta_rule_short, delta_rule_steps, l2norm,
                  rms_norm)
from .spec import ModelSpec
from .state import LinearLayerState, Segment
from .weights import Weight, dense

__all__ = ["GatedDeltaNet"]


# Steps up to this many positions run the delta rule stepwise; longer ones run it in chunks (as transformers does for
# a prefill), unless the session keeps a rollback ring, which needs every position's state. Stepwise steps of more
# than one position (verify steps) compute all their positions' states in closed form, except in batch-invariant
# mode, which runs them position by position.
_STEPWISE_MAX = 1
_CHUNK = 64  # positions per chunk of the chunked delta rule


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
        self.step = deltanet_step(self)  # a session's one-token step as one ggml graph, where its weights are ggml's

    def weights(self) -> Iterator[Weight]:
        yield from self.in_proj.weights()
        yield from (self.out, self.conv, self.neg_a, self.dt_bias, self.norm)

    def graph_state(self, segments: list[Segment]) -> LinearLayerState | None:
        """The session's state where the step is one the graph takes (one session, one position, not the
        batch-invariant mode, a float32 window and a state as ``state.rec_layout`` stores it, on the CPU), else None."""
        if self.step is None or len(segments) != 1 or segments[0].length != 1 or MIN_ROWS.get():
            return None
        st = segments[0].state.layers[self.key]
        assert isinstance(st, LinearLayerState)
        ok = st.conv.dtype == torch.float32 and st.conv.is_contiguous() and st.rec.mT.is_contiguous() and \
            st.conv.device.type == "cpu"
        return st if ok else None

    def forward(self, x: torch.Tensor, segments: list[Segment]) -> torch.Tensor:
        if (st := self.graph_state(segments)) is not None:
            return self.step(x, st.conv, st.rec).to(x.dtype)  # type: ignore[misc]
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
            keep_ring = seg.state.window.keeps_ring(t)  # what the step keeps: positions.SessionPositions
            if keep_ring or t <= _STEPWISE_MAX:
                key: tuple = (False, t)
            else:
                key = (True, id(st) if invariant else -(-t // _CHUNK))
            # where its snapshots go in the ring (None: nowhere)
            at = seg.state.window.ring_offset(seg.start, t) if keep_ring else None
            groups.setdefault(key, []).append((st, row, t, at))
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
        self, items: list[tuple[LinearLayerState, int, int, int | None]], chunked: bool, mixed: torch.Tensor,
        g: torch.Tensor, beta: torch.Tensor, conv_w: torch.Tensor, looped: bool,
    ) -> tuple[slice | torch.Tensor, torch.Tensor]:
        """Steps of B sessions as one batched conv + delta rule over their stacked states.

        ``items``: (layer state, first row, length, ring slot of its first snapshot or None) per session;
        ``looped``: a stepwise group that runs position by position (:func:`delta_rule_steps`; one-token steps, and
        any step in batch-invariant mode), with ``g`` the decay itself (exp g); other stepwise groups (verify steps)
        run :func:`delta_rule_short`, chunked ones :func:`delta_rule_chunked`, both with ``g`` the log-decay. A
        chunked group's shorter steps are padded at the end with positions of zero gate and zero beta, which leave the
        state as it is. For B > 1 the recurrent states are gathered into one temporary [B, ...] tensor (stored as the
        sessions' are) and written back after the step (and into the rollback rings of the sessions that keep one); a
        session alone is updated in place, its ring written directly. The
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
        ringed = [i for i, (_, _, _, at) in enumerate(items) if at is not None]
        at = [a or 0 for _, _, _, a in items]  # the ring slot of each session's first snapshot
        alone = bsz == 1  # one session: its own state and ring, updated in place (no gather, no write-back)
        # [B, Hv, Dk, Dv], stored as the sessions' states are (transposed: state.rec_layout), so copies are straight
        rec = states[0].rec.unsqueeze(0) if alone else torch.stack([st.rec.mT for st in states]).mT
        # the state after every position: straight into the ring of a session alone whose step does not wrap round
        # the ring's end, else into the rings below
        direct = bool(ringed) and alone and at[0] + t <= states[0].ring_rec.shape[0]
        if not ringed:
            after = None
        elif direct:
            after = states[0].ring_rec[at[0]:at[0] + t].unsqueeze(0)
        else:
            after = rec.new_empty(bsz, t, nv, rec.shape[-1], rec.shape[-2]).mT  # stored as the rings are: same sums
        if chunked:  # the sessions' heads side by side: [T, B*Hv, D]
            def fold(x: torch.Tensor) -> torch.Tensor:
                return x.transpose(0, 1).reshape(t, bsz * nv, *x.shape[3:])

            out = delta_rule_chunked(fold(q), fold(k), fold(v), fold(gate), fold(bet),
                                     rec.view(bsz * nv, *rec.shape[2:]), chunk=min(t, _CHUNK))
            out = out.reshape(t, bsz, nv, -1).transpose(0, 1)
        elif looped and t == 1 and after is None and not MIN_ROWS.get() and (
                rec.is_contiguous() or rec.mT.is_contiguous()):
            out = delta_rule_one(q, k, v, gate, bet, rec)  # decode: batched products (equal to rounding)
        elif looped:
            out = delta_rule_steps(q, k, v, gate, bet, rec, after)
        else:
            out = delta_rule_short(q, k, v, gate, bet, rec, after)
        if not alone:
            torch._foreach_copy_([st.rec for st in states], list(rec.unbind(0)))
        if ringed:  # stepwise groups only (their steps all have length t): one copy per ring, for rollback
            every = seq.unfold(-1, width, 1)[:, :, 1:t + 1].transpose(1, 2)  # [B, T, C, K-1] after each position
            dst: list[torch.Tensor] = []
            src: list[torch.Tensor] = []
            for j in ringed:
                _into_ring(states[j].ring_conv, at[j], every[j], dst, src)
                if not direct:  # (else the states went straight into the ring)
                    _into_ring(states[j].ring_rec, at[j], after[j], dst, src)  # type: ignore[index]
            torch._foreach_copy_(dst, src)
        out = out.reshape(bsz * t, nv, -1)
        return rows, out if place is None else out[place]


def _into_ring(ring: torch.Tensor, at: int, values: torch.Tensor, dst: list[torch.Tensor],
               src: list[torch.Tensor]) -> None:
    """Queue the copy of ``values`` [T, ...] into ``ring`` from slot ``at`` on, wrapping round its end
    (positions.SessionPositions: the state after position p is in slot p % ring)."""
    first = min(values.shape[0], ring.shape[0] - at)
    dst.append(ring[at:at + first])
    src.append(values[:first])
    if first < values.shape[0]:
        dst.append(ring[:values.shape[0] - first])
        src.append(values[first:])
