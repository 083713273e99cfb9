"""Decoder layers as ggml graphs (issue 30): a Gated DeltaNet layer's one-token step whole, a MoE layer, and an
attention layer's MoE half, over weights that ggml multiplies (``ggml_kernels.py``).

Why: with ggml's products a mid-size MoE's decode step spent a third of its time in the ~100 small torch operations
and the Python between them per layer (docs/benchmarks.md); here a layer is one ``ggml_graph_compute``, its small
operations llama.cpp's own for these layers (``ggml_ssm_conv``, ``ggml_l2_norm``, ``ggml_gated_delta_net`` on the
session's state as ``state.rec_layout`` stores it, ``ggml_argsort_top_k``, ``ggml_mul_mat_id``...).

A graph is built once per thread count (and row count) and kept: its weights point at the weights' memory, its
inputs and outputs (the step's rows, the session's conv window and recurrent state, updated in place) are re-pointed
per call (``ggml_graph.Graph``).

Only what these graphs compute as the torch path does (to float32 rounding) takes them: the whole DeltaNet layer for
one position of one session, not in the batch-invariant mode (no rollback ring: a one-token step keeps none); the MoE
and the MoE half of a layer for any rows (row by row, so batch-invariant). Every other step runs the torch path.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .ggml_graph import CACHED_ROWS, F32, I32, Graph, Graphs
from .ggml_kernels import GgmlExperts, GgmlWeight, binding

__all__ = ["MAX_ROWS", "DeltaNetStep", "LayerStep", "MoEStep", "deltanet_step", "layer_step", "moe_step"]

MAX_ROWS = CACHED_ROWS
"""Steps of at most this many rows take the MoE graphs (decode, verify windows, batches of them), whose graphs are
kept; a longer one (a prefill) runs the torch path between ggml's products, where building a graph per call cost a
prefill of the small made MoE 2-3%."""

_NODES = 256  # tensors a block's graph holds at most


def _weight(lib: Any, ctx: Any, w: Any) -> Any | None:
    """A ggml tensor over a weight's memory (ggml blocks, or a dense float32 matrix [n, k]); None for others."""
    if isinstance(w, GgmlWeight) and w.in_perm is None:
        return w.tensor(ctx)
    if _dense32(w):
        return _const(lib, ctx, w, w.shape[1], w.shape[0])
    return None


def _const(lib: Any, ctx: Any, x: torch.Tensor, *ne: int) -> Any:
    """A ggml float32 tensor of shape ``ne`` (ggml's order: fastest first) over a contiguous float32 tensor."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.numel() == math.prod(ne)
    t = getattr(lib, f"ggml_new_tensor_{len(ne)}d")(ctx, F32, *ne)
    t.contents.data = x.data_ptr()
    return t


def _takes(w: Any) -> bool:
    """Whether :func:`_weight` takes ``w``."""
    return (isinstance(w, GgmlWeight) and w.in_perm is None) or _dense32(w)


# ---- Gated DeltaNet ---------------------------------------------------------------------------------------------


class DeltaNetStep:
    """One position of one session through a Gated DeltaNet (``deltanet.GatedDeltaNet``), projections included:
    ``x [1, H]`` (normed) -> ``[1, H]`` float32, the session's conv window and recurrent state updated in place."""

    def __init__(self, net: Any, lib: Any) -> None:
        self.net, self.lib = net, lib
        self.consts = [net.conv.contiguous(), net.neg_a.contiguous(), net.dt_bias.contiguous(),
                       net.norm.contiguous()]
        perm = net.out.in_perm
        self.perm = None if perm is None else perm.to(torch.int32).contiguous()
        self._graphs = {p: Graphs(lambda rows, threads, p=p: self._make(threads, p)) for p in (False, True)}

    def _make(self, threads: int, in_place: bool) -> Graph:
        def build(ctx: Any) -> tuple[list[Any], list[Any], list[Any]]:
            x = self.lib.ggml_new_tensor_2d(ctx, F32, self.net.spec.hidden_size, 1)
            ins, out, also = self.ops(ctx, x, in_place)
            return [x, *ins], [out], also

        return Graph(self.lib, threads, build, _NODES)

    def ops(self, ctx: Any, x: Any, in_place: bool = False) -> tuple[list[Any], Any, list[Any]]:
        """The step's operations on ``x [H, 1]`` in ``ctx``: (the state's tensors, to point at the session's conv
        window and recurrent state per call - and with ``in_place`` the state's region, :func:`rec_region`; the
        output [H, 1]; the in-place updates of the state)."""
        lib, net, spec = self.lib, self.net, self.net.spec
        nk, nv = spec.linear_num_key_heads, spec.linear_num_value_heads
        dk, dv, kw = spec.linear_key_head_dim, spec.linear_value_head_dim, spec.linear_conv_kernel
        cdim, vdim = spec.linear_conv_dim, spec.linear_value_dim
        conv_w, neg_a, dt_bias, norm = self.consts
        conv = lib.ggml_new_tensor_2d(ctx, F32, kw - 1, cdim)  # [C, K-1] oldest first
        rec = lib.ggml_new_tensor_4d(ctx, F32, dk, dv, nv, 1)  # [Hv, Dk, Dv] stored as [Hv, Dv, Dk]
        # the in-projections' outputs, in order: mixed (conv input), z, b, a
        outs = []
        for w, sizes in zip(net.in_proj.parts, net.in_proj.splits):
            y = lib.ggml_mul_mat(ctx, _weight(lib, ctx, w), x)
            off = 0
            for n in sizes:
                outs.append(lib.ggml_view_1d(ctx, y, n, off * 4))
                off += n
        mixed, z, b, a = outs
        beta = lib.ggml_sigmoid(ctx, b)
        g = lib.ggml_mul(ctx, lib.ggml_softplus(ctx, lib.ggml_add(ctx, a, _const(lib, ctx, dt_bias, nv))),
                         _const(lib, ctx, neg_a, nv))  # the log-decay
        # the causal conv over the window and the new input, then the window moves on by one
        sx = lib.ggml_concat(ctx, conv, lib.ggml_reshape_2d(ctx, mixed, 1, cdim), 0)  # [C, K]
        c = lib.ggml_silu(ctx, lib.ggml_ssm_conv(ctx, lib.ggml_reshape_3d(ctx, sx, kw, cdim, 1),
                                                 _const(lib, ctx, conv_w, kw, cdim)))  # [C, 1, 1]
        moved = lib.ggml_cpy(ctx, lib.ggml_view_2d(ctx, sx, kw - 1, cdim, sx.contents.nb[1], 4), conv)
        qk = lib.ggml_l2_norm(ctx, lib.ggml_reshape_2d(ctx, lib.ggml_view_1d(ctx, c, 2 * nk * dk, 0), dk,
                                                       2 * nk), 1e-6)  # q's heads then k's, each normed
        q = lib.ggml_view_3d(ctx, qk, dk, 1, nk, dk * 4, dk * 4, 0)
        k = lib.ggml_view_3d(ctx, qk, dk, 1, nk, dk * 4, dk * 4, nk * dk * 4)
        if nv != nk:  # each key head to its value heads (interleaved: value head h reads key head h // r)
            q = lib.ggml_repeat_4d(ctx, q, dk, nv // nk, nk, 1)
            k = lib.ggml_repeat_4d(ctx, k, dk, nv // nk, nk, 1)
        q = lib.ggml_reshape_4d(ctx, lib.ggml_cont(ctx, q), dk, nv, 1, 1)
        k = lib.ggml_reshape_4d(ctx, lib.ggml_cont(ctx, k), dk, nv, 1, 1)
        v = lib.ggml_reshape_4d(ctx, lib.ggml_view_1d(ctx, c, nv * dv, 2 * nk * dk * 4), dv, nv, 1, 1)
        # llama.cpp's gated delta rule (q scaled by 1/sqrt(Dv) inside, Dv = Dk here); its output is the heads'
        # outputs, then the new state, which goes back into the session's
        r = lib.ggml_gated_delta_net(ctx, q, k, v, lib.ggml_reshape_4d(ctx, g, 1, nv, 1, 1),
                                     lib.ggml_reshape_4d(ctx, beta, 1, nv, 1, 1), rec, 1)
        # in place: r is pointed at the state's region per call, its state part the session's state itself
        also = [moved] if in_place else [moved, lib.ggml_cpy(ctx, lib.ggml_view_1d(ctx, r, nv * dv * dk, nv * dv * 4),
                                                             rec)]
        core = lib.ggml_reshape_2d(ctx, lib.ggml_view_1d(ctx, r, nv * dv, 0), dv, nv)
        # the gated RMSNorm of each value head, then the output projection
        core = lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, core, spec.rms_norm_eps), _const(lib, ctx, norm, dv))
        core = lib.ggml_mul(ctx, core, lib.ggml_silu(ctx, lib.ggml_reshape_2d(ctx, z, dv, nv)))
        flat = lib.ggml_reshape_2d(ctx, core, 1, vdim)
        if self.perm is not None:  # llama.cpp reordered the out-projection's columns: the input follows
            idx = lib.ggml_new_tensor_1d(ctx, I32, vdim)
            idx.contents.data = self.perm.data_ptr()
            flat = lib.ggml_get_rows(ctx, flat, idx)
        out = lib.ggml_mul_mat(ctx, net.out.tensor(ctx), lib.ggml_reshape_2d(ctx, flat, vdim, 1))
        return [conv, rec, r] if in_place else [conv, rec], out, also

    def __call__(self, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
        out = torch.empty(1, self.net.spec.hidden_size)
        in_place, state = _state(conv, rec)
        self._graphs[in_place].run(1, [x.float().contiguous(), *state], [out])
        return out


def _state(conv: torch.Tensor, rec: torch.Tensor) -> tuple[bool, list[torch.Tensor]]:
    """Whether the step writes ``rec`` in place (:func:`rec_region`), and the state's inputs of that graph."""
    region = rec_region(rec)
    return (False, [conv, rec]) if region is None else (True, [conv, rec, region])


def rec_region(rec: torch.Tensor) -> torch.Tensor | None:
    """The session's recurrent state ``rec`` ``[Hv, Dk, Dv]`` with the scratch ``state.rec_layout`` puts before it,
    as one flat tensor - where ggml's gated delta rule writes a token's outputs and then the new state, so the state
    in place - or None where ``rec`` has no such scratch (the graph then copies the new state back)."""
    hv, dk, dv = rec.shape
    pre = hv * dv
    if rec.storage_offset() != pre or rec.untyped_storage().nbytes() != (pre + rec.numel()) * 4 or \
            rec.stride() != (dv * dk, 1, dk):
        return None
    return torch.as_strided(rec, (pre + rec.numel(),), (1,), 0)


def deltanet_step(net: Any) -> DeltaNetStep | None:
    """The one-position step of ``net`` (a ``GatedDeltaNet``) as one graph, or None: its projections are not ggml's
    (or float32 matrices beside them), or its shapes are not the ones the graph takes."""
    spec = net.spec
    parts = list(net.in_proj.parts)
    sizes = [n for split in net.in_proj.splits for n in split]
    if not (all(_takes(w) for w in parts) and isinstance(net.out, GgmlWeight) and net.in_proj.biases ==
            [None] * len(parts) and sizes == [spec.linear_conv_dim, spec.linear_value_dim,
                                              spec.linear_num_value_heads, spec.linear_num_value_heads]):
        return None
    # (its conv, decay and norm vectors are float32 whatever the file: GatedDeltaNet loads them so)
    if spec.linear_num_value_heads % spec.linear_num_key_heads or spec.linear_key_head_dim != \
            spec.linear_value_head_dim:
        return None
    lib = binding()
    return None if lib is None else DeltaNetStep(net, lib)


# ---- MoE ----------------------------------------------------------------------------------------------------------


class MoEStep:
    """A MoE layer (``layers.MoE``) for N rows as one graph: router softmax, top-k (renormalised), the routed experts
    (``ggml_mul_mat_id``) weighted and summed, and the shared expert with its sigmoid gate."""

    def __init__(self, moe: Any, lib: Any) -> None:
        self.moe, self.lib = moe, lib
        self._graphs = Graphs(self._make)

    def _make(self, rows: int, threads: int) -> Graph:
        def build(ctx: Any) -> tuple[list[Any], list[Any], list[Any]]:
            x = self.lib.ggml_new_tensor_2d(ctx, F32, self.moe.spec.hidden_size, rows)
            return [x], [self.ops(ctx, x, rows)], []

        return Graph(self.lib, threads, build, _NODES)

    def ops(self, ctx: Any, x: Any, rows: int) -> Any:
        """The layer's operations on ``x [H, rows]`` in ``ctx``: its output [H, rows]."""
        lib, moe, spec = self.lib, self.moe, self.moe.spec
        ex: GgmlExperts = moe.grouped
        hidden, k, e_num = spec.hidden_size, spec.num_experts_per_tok, spec.num_experts
        probs = lib.ggml_soft_max(ctx, lib.ggml_mul_mat(ctx, _weight(lib, ctx, moe.router), x))  # [E, N]
        chosen = lib.ggml_argsort_top_k(ctx, probs, k)  # [k, N], highest first
        w = lib.ggml_get_rows(ctx, lib.ggml_reshape_3d(ctx, probs, 1, e_num, rows), chosen)  # [1, k, N]
        if spec.norm_topk_prob:
            w2 = lib.ggml_reshape_2d(ctx, w, k, rows)
            w = lib.ggml_reshape_3d(ctx, lib.ggml_div(ctx, w2, lib.ggml_sum_rows(ctx, w2)), 1, k, rows)
        xs = lib.ggml_reshape_3d(ctx, x, hidden, 1, rows)
        h = lib.ggml_swiglu_split(ctx, lib.ggml_mul_mat_id(ctx, ex.stacked(ctx, 0), xs, chosen),
                                  lib.ggml_mul_mat_id(ctx, ex.stacked(ctx, 1), xs, chosen))
        y = lib.ggml_mul(ctx, lib.ggml_mul_mat_id(ctx, ex.stacked(ctx, 2), h, chosen), w)  # [H, k, N]
        out = lib.ggml_view_2d(ctx, y, hidden, rows, y.contents.nb[2], 0)
        for i in range(1, k):
            out = lib.ggml_add(ctx, out, lib.ggml_view_2d(ctx, y, hidden, rows, y.contents.nb[2],
                                                          i * y.contents.nb[1]))
        if moe.shared is not None:
            sh = moe.shared
            up = lib.ggml_swiglu(ctx, lib.ggml_mul_mat(ctx, _weight(lib, ctx, sh.gate_up.parts[0]), x))
            y_sh = lib.ggml_mul_mat(ctx, _weight(lib, ctx, sh.down), up)
            gate = lib.ggml_sigmoid(ctx, lib.ggml_mul_mat(ctx, _weight(lib, ctx, moe.shared_gate), x))  # [1, N]
            out = lib.ggml_add(ctx, out, lib.ggml_mul(ctx, y_sh, gate))
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.moe.spec.hidden_size)
        self._graphs.run(x.shape[0], [x.float().contiguous()], [out])
        return out


def moe_step(moe: Any) -> MoEStep | None:
    """``moe`` (a ``layers.MoE`` with grouped ggml experts) as one graph per row count, or None: its router or shared
    expert are not what the graph takes (float32 router and shared gate, one ggml gate/up product and a ggml down)."""
    if not isinstance(moe.grouped, GgmlExperts) or not _dense32(moe.router):
        return None
    sh = moe.shared
    if sh is not None and not (len(sh.gate_up.parts) == 1 and sh.down_bias is None and sh.gate_up.biases == [None]
                               and all(isinstance(w, GgmlWeight) and w.in_perm is None
                                       for w in (sh.gate_up.parts[0], sh.down)) and _dense32(moe.shared_gate)):
        return None
    lib = binding()
    return None if lib is None else MoEStep(moe, lib)


def _dense32(w: Any) -> bool:
    return isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.is_contiguous()


# ---- a decoder layer ----------------------------------------------------------------------------------------------


class LayerStep:
    """A decoder layer's residual blocks around its MoE as one graph: ``x + moe(norm(x))`` for any rows
    (:meth:`ffn`), and where its token mixer is a Gated DeltaNet with a graph, the whole layer for one token of one
    session (``__call__``): ``h = x + mixer(norm(x))``, then ``h + moe(norm(h))``. Inputs and outputs float32."""

    def __init__(self, layer: Any, mixer: DeltaNetStep | None, moe: MoEStep, lib: Any) -> None:
        self.layer, self.mixer, self.moe, self.lib = layer, mixer, moe, lib
        self._whole = {p: Graphs(lambda rows, threads, p=p: self._make(rows, threads, True, p)) for p in (False, True)}
        self._half = Graphs(lambda rows, threads: self._make(rows, threads, False))

    def _norm(self, ctx: Any, x: Any, w: torch.Tensor) -> Any:
        lib = self.lib
        return lib.ggml_mul(ctx, lib.ggml_rms_norm(ctx, x, self.layer.spec.rms_norm_eps),
                            _const(lib, ctx, w, w.numel()))

    def _make(self, rows: int, threads: int, whole: bool, in_place: bool = False) -> Graph:
        lib, layer = self.lib, self.layer

        def build(ctx: Any) -> tuple[list[Any], list[Any], list[Any]]:
            x = lib.ggml_new_tensor_2d(ctx, F32, layer.spec.hidden_size, rows)
            ins: list[Any] = []
            also: list[Any] = []
            h = x
            if whole:
                assert self.mixer is not None
                ins, mixed, also = self.mixer.ops(ctx, self._norm(ctx, x, layer.input_norm), in_place)
                h = lib.ggml_add(ctx, x, mixed)
            out = lib.ggml_add(ctx, h, self.moe.ops(ctx, self._norm(ctx, h, layer.post_norm), rows))
            return [x, *ins], [out], also

        return Graph(lib, threads, build, _NODES)

    def __call__(self, x: torch.Tensor, conv: torch.Tensor, rec: torch.Tensor) -> torch.Tensor:
        out = torch.empty(1, self.layer.spec.hidden_size)
        in_place, state = _state(conv, rec)
        self._whole[in_place].run(1, [x.contiguous(), *state], [out])
        return out

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.layer.spec.hidden_size)
        self._half.run(x.shape[0], [x.contiguous()], [out])
        return out


def layer_step(layer: Any) -> LayerStep | None:
    """``layer`` (a ``layers.DecoderLayer``) around its MoE graph (and its Gated DeltaNet's, if it has one) as one
    graph, or None: its FFN has no graph, or its norms are not float32 vectors."""
    moe = getattr(layer.ffn, "step", None)
    if not isinstance(moe, MoEStep) or not all(
            isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 1 and w.is_contiguous()
            for w in (layer.input_norm, layer.post_norm)):
        return None
    mixer = getattr(layer.mixer, "step", None)
    return LayerStep(layer, mixer if isinstance(mixer, DeltaNetStep) else None, moe, moe.lib)
