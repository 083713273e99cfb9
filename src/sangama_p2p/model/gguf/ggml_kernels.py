"""GGUF weights multiplied as they are stored, in their blocks, by ggml's own CPU kernels (the ``ggml-python``
binding: llama.cpp's tensor library, built on the user's machine by pip) - or, for the types ggml's CPU backend
repacks (Q4_0, Q4_K...), in ggml's repacked layout, which replaces the file's pages (ggml_repack.py).

Why, measured (docs/architecture.md, "ggml's kernels"): the weight is the file's bytes, not a repacking of them
(torch's int4 layout holds the 5-, 6- and 8-bit types as two codes a weight, 1.06-1.64x the file), and for those types
ggml's products are faster, streamed from memory as a decode step reads them (1.07-1.39x) and in the cache (1.9-2.7x);
ggml also has kernels for the types torch's layouts do not take (Q2_K, Q3_K, IQ4_*). The activations are quantized per
call to the weight's dot-product type (Q8_K for the K-quants, Q8_0/Q8_1 for the 32-blocks), as llama.cpp does.

How: a product is one ggml graph of tensor headers whose data are ours (a context that allocates nothing): the weight
points at the blocks, the input and output at each call's torch tensors, intermediates and ggml's work area at the
calling thread's arena; a call is one ``ggml_graph_compute`` (ctypes releases the GIL). Graphs are kept per (row
count, threads) for small row counts (decode, verification windows) and built per call for big ones (prefill, where
building costs ~1% of the product).

A MoE layer's experts (:class:`GgmlExperts`) are three 3-D ggml tensors over the stacked blocks of the file
(``ffn_*_exps``, one view per projection), and a step's rows go through their routed experts with
``ggml_mul_mat_id`` - gate, up, SwiGLU and down in one graph, one call a layer whatever the batch - as llama.cpp does.

Selection (:func:`mode`, ``SANGAMA_KERNELS``): ``auto`` (default) multiplies :data:`AUTO_TYPES` here and leaves Q4_0
and Q4_1 to torch's int4 kernel (``packed.py``), which streams them faster on our CPU; ``ggml`` every type;
``torch`` none. Either needs the binding to load and pass its probe (:func:`binding`). The output head stays on
torch's kernel: its coarse logits' error bound (``head.REL``) assumes activations rounded to bfloat16, not quantized
per block.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from ...errors import UnsupportedModelError
from ..weights import FusedWeight
from .ggml_graph import F32, I32, Graph, Graphs
from .ggml_repack import REPACK_ENV, Repacked, repack_buffer_type
from .quants import QuantTensor, type_name

__all__ = ["AUTO_TYPES", "KERNELS_ENV", "GgmlExperts", "GgmlWeight", "binding", "ggml_weight", "mode"]

log = logging.getLogger(__name__)

KERNELS_ENV = "SANGAMA_KERNELS"


# The types ggml multiplies by default (SANGAMA_KERNELS unset or auto), chosen per type by measurement
# (benchmarks/kernels_streamed.py, docs/architecture.md): those torch's int4 layout holds as two codes a weight
# (1.06-1.64x the file, and slower than ggml streamed from memory: 1.07-1.39x), those it does not take at all (they
# would be dequantized per use), and Q4_K: torch's kernel streams it 1.26x faster, but holds it at 1.11x the file,
# and a Q4_K_M file (Q4_K beside Q6_K, Q5_0) through two kernels that round the activations differently (bfloat16;
# ggml: per block, as llama.cpp) agreed with llama.cpp's tokens less than through either alone (tests/real).
# Q4_0 and Q4_1 stay on torch's int4 kernel: 1.0-1.11x the file, 1.4-1.5x faster streamed and 2x in 512-row
# products, on our CPU.
AUTO_TYPES = frozenset({12, 6, 7, 13, 14, 8, 10, 11, 20, 23})  # Q4_K Q5_0 Q5_1 Q5_K Q6_K Q8_0 Q2_K Q3_K IQ4_NL IQ4_XS


def mode() -> str:
    """``SANGAMA_KERNELS``: ``auto`` (default: ggml for :data:`AUTO_TYPES`), ``ggml`` (every type) or ``torch``."""
    choice = os.environ.get(KERNELS_ENV, "auto").strip().lower() or "auto"
    if choice not in ("auto", "ggml", "torch"):
        raise UnsupportedModelError(f"{KERNELS_ENV}={choice!r}: expected 'auto', 'ggml' or 'torch'")
    return choice


@functools.cache
def binding() -> Any | None:
    """ggml-python's ``ggml`` module, or None: not installed, or failing its probe - a child process that runs
    products of each family of types once (a build for instructions that the CPU reports but the machine does not
    allow dies with SIGILL there, not here)."""
    try:
        from ggml import ggml as G  # the binding loads libggml at import
    except (ImportError, OSError) as exc:
        (log.warning if mode() == "ggml" else log.info)("ggml kernels unavailable (%s): torch's int4 kernels", exc)
        return None
    if not _probe_passes():
        log.warning("ggml's kernels failed their probe on this machine: torch's int4 kernels are used instead")
        return None
    G.ggml_log_set(_LOG, None)  # ggml's own lines (a line a weight it repacks) go to our log, not to stderr
    G.ggml_cpu_init()
    return G


def _log(level: int, text: bytes, _data: Any) -> None:
    if level in (3, 4):  # GGML_LOG_LEVEL_WARN, GGML_LOG_LEVEL_ERROR
        log.warning("ggml: %s", (text or b"").decode(errors="replace").rstrip())


_LOG = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(_log)  # kept: ggml holds a pointer


def _probe_passes() -> bool:
    """Run :func:`probe` in a child process; True when it exits cleanly. A pass is remembered on disk per library
    build and CPU (``~/.cache/sangama/ggml-probe-*``), so each process does not pay the child's start-up."""
    from ggml import ggml as G

    lib = os.path.realpath(getattr(G.lib, "_name", "") or "")
    try:
        st = os.stat(lib)
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
    except OSError:
        st, flags = None, ""
    key = hashlib.sha256(f"{lib}|{st and (st.st_size, st.st_mtime_ns)}|{flags}|{sys.executable}|repack".encode())
    mark = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sangama" / \
        f"ggml-probe-{key.hexdigest()[:16]}"
    if mark.exists():
        return True
    try:
        done = subprocess.run([sys.executable, "-c", f"from {__name__} import probe; probe()"], timeout=120,
                              capture_output=True)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("ggml probe could not run: %s", exc)
        return False
    if done.returncode != 0:
        log.warning("ggml probe exited %s: %s", done.returncode, done.stderr.decode(errors="replace")[-500:])
        return False
    try:
        mark.parent.mkdir(parents=True, exist_ok=True)
        mark.touch()
    except OSError:
        pass
    return True


def probe() -> None:
    """Products of each kernel family (32-blocks, K-quants; repacked where ggml repacks the type) for one row, a
    cached batch and a big batch, and a step of grouped experts, on random bytes (run in a child process by
    :func:`binding`: only that the kernels run)."""
    from ggml import ggml as G

    os.environ[REPACK_ENV] = "1"  # (a child process: its pass is trusted whether or not a stage repacks)
    G.ggml_cpu_init()
    gen = torch.Generator().manual_seed(0)
    rows, cols, experts = 64, 512, 4
    for qtype in (2, 8, 12, 14):  # Q4_0, Q8_0, Q4_K, Q6_K
        stacked = torch.zeros(experts, rows, G.ggml_row_size(qtype, cols), dtype=torch.uint8)  # zero scales
        w = [GgmlWeight(stacked[e], qtype, cols, lib=G) for e in range(experts)]
        for m in (1, 32, 300):
            w[0].product(torch.randn(m, cols, generator=gen))
        if qtype != 8:  # gate, up [E, 64, 512]; down [E, 512, 64] as Q8_0 (64 is no K-quant row)
            down = torch.zeros(experts, cols, G.ggml_row_size(8, rows), dtype=torch.uint8)
            grouped = GgmlExperts.build(w, w, [GgmlWeight(down[e], 8, rows, lib=G) for e in range(experts)])
            assert grouped is not None
            for m in (1, 40):
                grouped(torch.randn(m, cols, generator=gen), torch.randint(0, experts, (m, 2), generator=gen),
                        torch.rand(m, 2, generator=gen))


# ---- weights --------------------------------------------------------------------------------------------------

_SETTLING = threading.Lock()


@dataclasses.dataclass(eq=False)
class GgmlWeight(FusedWeight):
    """``W [n, k]`` as GGML blocks (uint8 ``[n, row_bytes]``, often a view of the mapped file), multiplied by ggml.
    ``in_perm``: the file's columns are ``x[:, in_perm]`` (llama.cpp reordered them: ``ssm_out``)."""

    blocks: torch.Tensor
    qtype: int
    k: int
    in_perm: torch.Tensor | None = None
    lib: Any = None
    reread: Callable[[], torch.Tensor] | None = None  # ``blocks`` read from the file again, where they are a copy
    parts: tuple["GgmlWeight", ...] = ()  # a joined weight's parts, where its own ``blocks`` hold no data (meta)
    product_dtype: ClassVar[torch.dtype] = torch.float32

    def __post_init__(self) -> None:
        self.lib = self.lib or binding()
        if self.lib is None:
            raise UnsupportedModelError("ggml's kernels are not available")
        if self.blocks.dtype != torch.uint8 or self.blocks.dim() != 2 or not self.blocks.is_contiguous():
            raise UnsupportedModelError("ggml weights are contiguous uint8 rows of blocks")
        if self.lib.ggml_row_size(self.qtype, self.k) != self.blocks.shape[1]:
            raise UnsupportedModelError(
                f"{type_name(self.qtype)} rows of {self.k} are not {self.blocks.shape[1]} bytes")
        self._graphs = Graphs(self._graph)
        self._packed: Repacked | None | bool = None  # None: not tried yet; False: ggml has no repacked layout

    def tensor(self, ctx: Any) -> Any:
        """This weight as a ggml tensor for a graph in ``ctx`` (its columns as stored: a graph reorders its input by
        ``in_perm``): repacked where ggml has a layout for its type and shape (:meth:`settle`), else over its blocks."""
        if self._packed is None:
            self.settle()
        if self._packed:
            return self._packed.tensor  # type: ignore[union-attr]
        t = self.lib.ggml_new_tensor_2d(ctx, self.qtype, self.k, self.n)
        t.contents.data = self.blocks.data_ptr()
        return t

    def settle(self) -> None:
        """Repack the blocks as llama.cpp's CPU backend does (ggml_repack.py), once, where ggml has a layout for them
        (a stage calls this when the layer is built: a weight may be joined before; else the first graph does). A
        copy of the file's rows that was repacked is dropped (read again only by :meth:`dequantize`)."""
        if self._packed is not None:
            return
        with _SETTLING:  # (two threads' first graphs must not repack twice: a graph would keep a freed buffer)
            if self._packed is None:
                self._packed = self._repack([self.blocks]) or False
                if self._packed and self.reread is not None:
                    self.blocks = torch.empty(self.blocks.shape, dtype=torch.uint8, device="meta")

    def _repack(self, blocks: list[torch.Tensor], experts: int = 0) -> Repacked | None:
        """``blocks`` (this weight's rows in order, or one expert's each) repacked; None where ggml has no repacked
        layout for them."""
        buft = repack_buffer_type(self.lib)
        if buft is None:
            return None
        try:
            return Repacked(self.lib, buft, self.qtype, self.k, blocks, experts)
        except ValueError:
            return None

    def stored(self) -> torch.Tensor:
        """The blocks as the file stores them (read again where this weight dropped a repacked copy)."""
        if not self.blocks.is_meta:
            return self.blocks
        if self.parts:
            return torch.cat([p.stored() for p in self.parts])
        if self.reread is None:
            raise UnsupportedModelError("a repacked ggml weight without its file's blocks")
        return self.reread()

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.blocks.shape[0]), self.k)

    @property
    def n(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.blocks.numel())

    @property
    def type_name(self) -> str:
        return f"{type_name(self.qtype)} (ggml)"

    def _graph(self, rows: int, threads: int) -> Graph:
        lib = self.lib

        def build(ctx: Any) -> tuple[list[Any], list[Any], list[Any]]:
            x = lib.ggml_new_tensor_2d(ctx, F32, self.k, rows)
            return [x], [lib.ggml_mul_mat(ctx, self.tensor(ctx), x)], []

        return Graph(lib, threads, build)

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, k]`` (any float dtype) times the weight: ``[M, n]`` float32."""
        x = x.float()
        if self.in_perm is not None:
            x = x.index_select(1, self.in_perm)
        x = x.contiguous()
        out = torch.empty(x.shape[0], self.n)
        self._graphs.run(x.shape[0], [x], [out])
        return out

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        y = self.product(x.reshape(-1, self.k)).to(x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], self.n)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        col_perm = None if self.in_perm is None else torch.argsort(self.in_perm)
        return QuantTensor(self.qtype, self.stored(), self.k, col_perm).dequantize(dtype)

    def to(self, device: torch.device | str) -> "GgmlWeight":
        if torch.device(device).type != "cpu":
            raise UnsupportedModelError(f"ggml weights are multiplied on the CPU; {device} takes repacked ones")
        return self

    @staticmethod
    def joinable(parts: list[FusedWeight]) -> bool:
        return all(isinstance(p, GgmlWeight) and p.qtype == parts[0].qtype and p.k == parts[0].k  # type: ignore
                   and p.in_perm is None for p in parts)

    @staticmethod
    def group_experts(gates: list[Any], ups: list[Any], downs: list[Any]) -> "GgmlExperts | None":
        return GgmlExperts.build(gates, ups, downs)

    @staticmethod
    def concat(parts: list[FusedWeight]) -> "GgmlWeight | None":
        """The parts' rows as one weight (one product for q/k/v or gate/up): repacked part by part into one buffer
        where ggml repacks their type (the parts kept for :meth:`dequantize`, their copies of the file's rows
        dropped), else a copy of their blocks; either replaces them (the same bytes as the file's)."""
        if not GgmlWeight.joinable(parts):
            return None
        ws: list[GgmlWeight] = parts  # type: ignore[assignment]
        first, blocks = ws[0], [p.stored() for p in ws]
        if (packed := first._repack(blocks)) is not None:
            n = sum(p.n for p in ws)
            joined = GgmlWeight(torch.empty(n, first.blocks.shape[1], dtype=torch.uint8, device="meta"), first.qtype,
                                first.k, lib=first.lib, parts=tuple(ws))
            joined._packed = packed
            for p in ws:
                p._packed = False  # multiplied only as part of the joined weight
                if p.reread is not None:
                    p.blocks = torch.empty(p.blocks.shape, dtype=torch.uint8, device="meta")
            return joined
        return GgmlWeight(torch.cat(blocks), first.qtype, first.k, lib=first.lib)


def ggml_weight(qt: QuantTensor) -> GgmlWeight | None:
    """The blocks of ``qt`` as a :class:`GgmlWeight`, or None when ggml is not chosen for its type (:func:`mode`), not
    available, or cannot take them."""
    chosen = mode()
    if chosen == "torch" or (chosen == "auto" and qt.qtype not in AUTO_TYPES):
        return None
    lib = binding()
    if lib is None or qt.data.device.type != "cpu" or not qt.data.is_contiguous():
        return None
    in_perm = None if qt.col_perm is None else torch.argsort(qt.col_perm)
    try:
        return GgmlWeight(qt.data, qt.qtype, qt.n_cols, in_perm, lib, qt.reread)
    except UnsupportedModelError:
        return None


class GgmlExperts:
    """A MoE layer's experts as three 3-D ggml tensors (gate, up: ``[E, I, H]``; down: ``[E, H, I]``) over the
    experts' own blocks, which must lie at one stride from each other (the views of a stacked ``ffn_*_exps``)."""

    def __init__(self, gate: GgmlWeight, up: GgmlWeight, down: GgmlWeight, strides: tuple[int, int, int],
                 num: int, keep: list[GgmlWeight]) -> None:
        self.gate, self.up, self.down, self.strides, self.num = gate, up, down, strides, num
        self.keep = keep  # every expert's weights: the views that hold the stacked blocks alive
        self.hidden = down.n
        self.lib = gate.lib
        self._graphs: dict[int, Graphs] = {}
        # each projection's experts repacked into one 3-D tensor where ggml repacks their type (ggml_repack.py)
        self.packed = [keep[i * num]._repack([w.stored() for w in keep[i * num:(i + 1) * num]], num)
                       for i in range(3)]
        for w in keep:
            if w._packed is None:
                w._packed = False  # multiplied in the stack (or, where the layer does not group them, as stored)

    @classmethod
    def build(cls, gates: list[Any], ups: list[Any], downs: list[Any]) -> "GgmlExperts | None":
        """The stacked experts, or None when the weights are not ggml weights of one type and shape per projection at
        one stride."""
        strides = []
        for ws in (gates, ups, downs):
            if not all(isinstance(w, GgmlWeight) and w.in_perm is None for w in ws):
                return None
            first = ws[0]
            if any(w.qtype != first.qtype or w.blocks.shape != first.blocks.shape for w in ws):
                return None
            base = first.blocks.data_ptr()
            stride = ws[1].blocks.data_ptr() - base if len(ws) > 1 else first.nbytes
            if any(w.blocks.data_ptr() != base + e * stride for e, w in enumerate(ws)) or stride < first.nbytes:
                return None
            strides.append(stride)
        g, u, d = gates[0], ups[0], downs[0]
        if g.k != d.n or u.k != g.k or u.n != g.n or d.k != g.n:
            return None
        return cls(g, u, d, (strides[0], strides[1], strides[2]), len(gates), [*gates, *ups, *downs])

    def weights(self) -> list[GgmlWeight]:
        return self.keep

    def stacked(self, ctx: Any, which: int) -> Any:
        """The experts' gate (0), up (1) or down (2) weights as one 3-D ggml tensor in ``ctx``."""
        if (packed := self.packed[which]) is not None:
            return packed.tensor
        w, stride = (self.gate, self.up, self.down)[which], self.strides[which]
        t = self.lib.ggml_new_tensor_3d(ctx, w.qtype, w.k, w.n, self.num)
        c = t.contents
        c.data = w.blocks.data_ptr()
        c.nb[2] = stride
        c.nb[3] = stride * self.num
        return t

    def _graph(self, k: int) -> Graphs:
        """The graphs for k experts a row (made once per k)."""
        lib = self.lib

        def make(rows: int, threads: int) -> Graph:
            def build(ctx: Any) -> tuple[list[Any], list[Any], list[Any]]:
                x = lib.ggml_new_tensor_3d(ctx, F32, self.hidden, 1, rows)
                ids = lib.ggml_new_tensor_2d(ctx, I32, k, rows)
                gate = lib.ggml_mul_mat_id(ctx, self.stacked(ctx, 0), x, ids)
                up = lib.ggml_mul_mat_id(ctx, self.stacked(ctx, 1), x, ids)
                h = lib.ggml_swiglu_split(ctx, gate, up)
                y = lib.ggml_mul_mat_id(ctx, self.stacked(ctx, 2), h, ids)
                return [x, ids], [y], []

            return Graph(lib, threads, build)

        graphs = self._graphs[k] = Graphs(make)
        return graphs

    def __call__(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """x [N, H] through each row's experts top_i [N, k], summed with weights top_w [N, k]: [N, H] float32."""
        n, k = top_i.shape
        xs = x.float().contiguous()
        ids = top_i.to(torch.int32).contiguous()
        y = torch.empty(n, k, self.hidden)
        (self._graphs.get(k) or self._graph(k)).run(n, [xs, ids], [y])
        return torch.bmm(top_w.float().unsqueeze(1), y).squeeze(1)
