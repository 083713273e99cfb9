"""GGUF weights repacked as llama.cpp's CPU backend repacks them (its ``CPU_REPACK`` buffer type; on x86 Q4_0, Q4_K,
Q2_K and IQ4_NL): rows interleaved eight at a time, multiplied by ggml's own GEMV/GEMM for that layout.

Why, measured (docs/benchmarks.md, "Repacked weights"): llama.cpp repacks at load by default, and that was the
difference between it and us (llama-bench on the mid-size made MoE 5.5-5.7 tok/s repacked, 4.7-4.8 as stored, ours
4.75 as stored); repacked, our decode of it is at 0.95-0.96 of llama.cpp's, 1.01-1.03 with the DeltaNet state
written in place. The layout is ggml's, reached through the binding's backend API
(``ggml_backend_dev_get_extra_bufts``), so our graphs multiply it with ggml's kernels as llama.cpp does.

Memory: a repacked weight is a copy, so it replaces the file's pages instead of adding to them - a stage repacks a
layer's weights once the layer is built (``FusedWeight.settle``) and then drops the mapped pages that layer read
(``GGUFSource.release_pages``: reading them again faults them back in from the page cache); blocks that were a
reordered copy of the file's rows are dropped too and read again only for a rare ``dequantize``. A joined weight
(q/k/v, gate/up) is repacked part by part into its slice of one buffer (the parts' rows are multiples of 8, so no
group of eight straddles two parts), not joined first; a MoE layer's experts are repacked expert by expert into one
3-D tensor that ``ggml_mul_mat_id`` takes. ``SANGAMA_REPACK=0`` keeps every weight as the file stores it.
"""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

__all__ = ["REPACK_ENV", "Repacked", "repack_buffer_type"]

REPACK_ENV = "SANGAMA_REPACK"


def repack_buffer_type(lib: Any) -> Any | None:
    """ggml's CPU backend's ``CPU_REPACK`` buffer type, or None (not built in, or ``SANGAMA_REPACK=0``)."""
    return None if os.environ.get(REPACK_ENV, "1").strip() == "0" else _buffer_type(lib)


@functools.cache
def _buffer_type(lib: Any) -> Any | None:
    reg = lib.ggml_backend_cpu_reg()
    fn_p = lib.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts") if reg else None
    if not fn_p:
        return None
    bufts = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(fn_p)(
        lib.ggml_backend_reg_dev_get(reg, 0))
    i = 0
    while bufts and bufts[i]:
        if lib.ggml_backend_buft_name(bufts[i]) == b"CPU_REPACK":
            return bufts[i]
        i += 1
    return None


class Repacked:
    """Rows of one weight (``parts``: uint8 ``[rows, row_bytes]`` blocks of one type, in order) repacked into one
    ggml buffer; ``tensor`` is the ggml tensor over it that graphs multiply: 2-D ``[k, rows]``, or with ``experts``
    3-D ``[k, rows / experts, experts]`` (one part an expert). Raises ValueError where ggml does not repack this type
    or shape (the caller keeps the blocks)."""

    def __init__(self, lib: Any, buft: Any, qtype: int, k: int, parts: list[torch.Tensor], experts: int = 0) -> None:
        self.lib, self.ctx, self.buffer = lib, None, None
        rows = [int(p.shape[0]) for p in parts]
        row_bytes = lib.ggml_row_size(qtype, k)
        if any(r % 8 for r in rows) or any(p.shape[1] != row_bytes or not p.is_contiguous() for p in parts):
            raise ValueError("rows of whole groups of 8, contiguous")
        if experts and (len(parts) != experts or len(set(rows)) != 1):
            raise ValueError("one part an expert, of equal rows")
        self.ctx = lib.ggml_init(lib.ggml_init_params(mem_size=lib.ggml_tensor_overhead() * (len(parts) + 1),
                                                      mem_buffer=None, no_alloc=True))
        whole = lib.ggml_new_tensor_3d(self.ctx, qtype, k, rows[0], experts) if experts else \
            lib.ggml_new_tensor_2d(self.ctx, qtype, k, sum(rows))
        size = lib.ggml_backend_buft_get_alloc_size(buft, whole)
        if size != sum(rows) * row_bytes:
            raise ValueError(f"a repacked size of {size} bytes")
        self.buffer = lib.ggml_backend_buft_alloc_buffer(buft, size)
        if not self.buffer:
            raise MemoryError(f"could not allocate {size} bytes to repack a weight")
        base = lib.ggml_backend_buffer_get_base(self.buffer)
        if lib.ggml_backend_tensor_alloc(self.buffer, whole, base) != 0 or not whole.contents.extra:
            raise ValueError("no repacked layout for this type and shape")
        at = 0
        for p in parts:
            t = lib.ggml_new_tensor_2d(self.ctx, qtype, k, p.shape[0])
            if lib.ggml_backend_tensor_alloc(self.buffer, t, base + at) != 0 or not t.contents.extra:
                raise ValueError("no repacked layout for a part")
            lib.ggml_backend_tensor_set(t, p.data_ptr(), 0, p.numel())  # repacks as it copies
            at += p.numel()
        self.tensor = whole
        self.nbytes = size

    def __del__(self) -> None:
        buffer, self.buffer = getattr(self, "buffer", None), None
        if buffer:
            self.lib.ggml_backend_buffer_free(buffer)
        ctx, self.ctx = getattr(self, "ctx", None), None
        if ctx:
            self.lib.ggml_free(ctx)
