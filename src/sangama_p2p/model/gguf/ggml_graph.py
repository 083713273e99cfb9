"""ggml graphs over memory we own (ggml_kernels.py's products, ggml_layer.py's layers): a graph's tensor headers
point at our weights, inputs and outputs, its intermediates and ggml's work area at the calling thread's arena."""

from __future__ import annotations

import collections
import ctypes
import threading
from typing import Any, Callable

import torch

__all__ = ["CACHED_ROWS", "F32", "I32", "Graph", "Graphs"]

F32, I32 = 0, 26  # ggml_type ids
CACHED_ROWS = 64  # graphs for at most this many rows are kept (per weight); bigger ones are built per call
_CACHED_GRAPHS = 8  # per weight


class Graph:
    """A ggml graph over memory we own: ``build(ctx)`` creates the tensors and returns (inputs, outputs, also) -
    ``also``: results that write into inputs (a state updated in place) and must run too; an input may be an
    operation's result, which then writes where the call points it (ggml_layer's state written in place). Weights
    were pointed at their memory by ``build``; inputs and outputs are re-pointed per call, and every view after its
    source; the other intermediates and ggml's work area live in the calling thread's arena (:func:`_arena`: one
    buffer a thread, not one a graph - a stage keeps graphs for every weight and several row counts)."""

    def __init__(self, lib: Any, threads: int, build: Callable[[Any], tuple[list[Any], list[Any], list[Any]]],
                 nodes: int = 16) -> None:
        self.lib = lib
        size = lib.ggml_tensor_overhead() * nodes + lib.ggml_graph_overhead_custom(nodes, False)
        self.ctx = lib.ggml_init(lib.ggml_init_params(mem_size=size, mem_buffer=None, no_alloc=True))
        if not self.ctx:
            raise MemoryError("ggml_init failed")
        try:
            inputs, outputs, also = build(self.ctx)
            self.graph = lib.ggml_new_graph_custom(self.ctx, nodes, False)
            for t in (*also, *outputs):
                lib.ggml_build_forward_expand(self.graph, t)
            ins = {ctypes.addressof(t.contents) for t in (*inputs, *outputs)}
            self.views: list[tuple[Any, Any, int]] = []
            self.between: list[tuple[Any, int]] = []
            for i in range(lib.ggml_graph_n_nodes(self.graph)):
                node = lib.ggml_graph_node(self.graph, i).contents
                if node.view_src:
                    self.views.append((node, node.view_src.contents, int(node.view_offs)))
                elif ctypes.addressof(node) not in ins:
                    self.between.append((node, -(-lib.ggml_nbytes(ctypes.pointer(node)) // 64) * 64))
            self.plan = lib.ggml_graph_plan(self.graph, threads, None)
            self.need = sum(s for _, s in self.between) + int(self.plan.work_size)
            self.plan_p = ctypes.pointer(self.plan)
            self.base = -1
            self.inputs = [t.contents for t in inputs]
            self.outputs = [t.contents for t in outputs]
        except BaseException:
            lib.ggml_free(self.ctx)
            raise

    def __call__(self, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        base = _arena(self.need)
        if base != self.base:
            at = base
            for t, s in self.between:
                t.data = at
                at += s
            self.plan.work_data = ctypes.cast(at, ctypes.POINTER(ctypes.c_uint8))
            self.base = base
        for t, x in zip(self.inputs, inputs):
            t.data = x.data_ptr()
        for t, x in zip(self.outputs, outputs):
            t.data = x.data_ptr()
        for v, src, offs in self.views:
            v.data = src.data + offs
        status = self.lib.ggml_graph_compute(self.graph, self.plan_p)
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute failed with status {status}")

    def __del__(self) -> None:
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx:
            self.lib.ggml_free(ctx)


_local = threading.local()


def _arena(size: int) -> int:
    """The address of this thread's scratch buffer, grown to at least ``size`` bytes (graphs that used the old one
    re-point at the next call: their ``base`` differs)."""
    buf: torch.Tensor | None = getattr(_local, "arena", None)
    if buf is None or buf.numel() < size:
        buf = torch.empty(max(size, 1 << 16, 2 * (0 if buf is None else buf.numel())), dtype=torch.uint8)
        _local.arena = buf
    return buf.data_ptr()


class Graphs:
    """A weight's graphs by (rows, threads): the small ones kept (least recently used dropped), big ones per call.
    One call at a time per weight (a lock: the graphs' inputs are re-pointed per call)."""

    def __init__(self, make: Callable[[int, int], Graph]) -> None:
        self.make = make
        self.kept: collections.OrderedDict[tuple[int, int], Graph] = collections.OrderedDict()
        self.lock = threading.Lock()

    def run(self, rows: int, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
        key = (rows, torch.get_num_threads())
        with self.lock:
            g = self.kept.get(key)
            if g is None:
                g = self.make(*key)
                if rows <= CACHED_ROWS:
                    self.kept[key] = g
                    if len(self.kept) > _CACHED_GRAPHS:
                        self.kept.popitem(last=False)
            else:
                self.kept.move_to_end(key)
            g(inputs, outputs)
