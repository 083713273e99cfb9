"""GGUF -> GGUF re-quantization, like ``llama-quantize --allow-requantize SRC DST PRESET``.

Each tensor's type comes from :func:`mix.plan_types` (llama.cpp's per-tensor rules). A tensor whose type does not
change is copied byte for byte; the others are dequantized to float32 with our torch kernels and quantized again
(gguf-py's quantizers for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/BF16, ours for Q4_K/Q5_K/Q6_K, numpy for F16). The header is
written here rather than with ``gguf.GGUFWriter`` so that the metadata stays exactly as stored: every key/value entry
is copied as raw bytes, in order, except ``general.file_type`` (set to the preset's LlamaFileType, as llama-quantize
does, as is ``general.quantization_version`` = 2) and the ``split.*`` keys (a split source is written as one file).
Tensors keep the source's order and alignment; the output is the same bytes on every run for the same input.
"""

from __future__ import annotations

import dataclasses
import os
import struct
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ...errors import CheckpointError, UnsupportedModelError, translate
from .mix import PRESETS, TensorPlan, plan_types
from .quantizer import quantize
from .quants import QType, dequantize_rows, row_bytes, type_name
from .reader import GGUFFile

__all__ = ["RequantizeReport", "requantize_gguf"]

_U32, _STRING = 4, 8
_DROPPED = ("split.no", "split.count", "split.tensors.count")


@dataclasses.dataclass(frozen=True)
class RequantizeReport:
    path: Path
    types: dict[str, int]  # ggml type name -> number of tensors
    seconds: float
    nbytes: int


def _string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def _u32_kv(key: str, value: int) -> bytes:
    return _string(key) + struct.pack("<II", _U32, value)


def _header_kv(f: GGUFFile, file_type: int) -> list[bytes]:
    """The key/value entries to write: the source's, raw, with file_type and quantization_version set."""
    entries, seen = [], set()
    for key in f.kv_spans:
        if key in _DROPPED:
            continue
        seen.add(key)
        if key == "general.file_type":
            entries.append(_u32_kv(key, file_type))
        elif key == "general.quantization_version":
            entries.append(_u32_kv(key, 2))
        else:
            entries.append(f.raw_kv(key))
    for key, value in (("general.quantization_version", 2), ("general.file_type", file_type)):
        if key not in seen:
            entries.append(_u32_kv(key, value))
    return entries


def _float32(f: GGUFFile, name: str) -> np.ndarray:
    """The tensor as float32 ``[rows, cols]`` (2-D even for 3-D expert stacks: rows are independent)."""
    info = f.tensors[name]
    cols = info.shape[-1]
    if info.qtype == QType.F32:
        return f.view(name).reshape(-1, cols).numpy()
    if info.qtype in (QType.F16, QType.BF16):
        return f.view(name).reshape(-1, cols).to(torch.float32).numpy()
    return dequantize_rows(info.qtype, f.view(name).reshape(-1, row_bytes(info.qtype, cols)), cols).numpy()


def _encode(x: np.ndarray, qtype: int) -> np.ndarray:
    """float32 ``[rows, cols]`` -> the stored bytes of ``qtype``, uint8 ``[rows, row_bytes]``."""
    if qtype == QType.F32:
        return np.ascontiguousarray(x, np.float32).view(np.uint8)
    if qtype == QType.F16:
        return x.astype(np.float16).view(np.uint8)  # round to nearest even, as ggml's fp32 -> fp16
    if qtype == QType.BF16:
        import gguf

        return gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint8)
    return quantize(x, qtype)


def plan_file(f: GGUFFile, preset: str) -> dict[str, int]:
    """{tensor name: ggml type} that ``preset`` gives the tensors of an open GGUF file (``mix.plan_types`` fed from
    its tensor table and metadata)."""
    arch = f.architecture
    return plan_types(
        [TensorPlan(i.name, i.shape, i.qtype) for i in f.tensors.values()],
        preset,
        arch=arch,
        n_layer=int(f.require(f"{arch}.block_count")),
        n_expert=int(f.get(f"{arch}.expert_count", 0)),
        n_head=int(f.get(f"{arch}.attention.head_count", 0)),
        n_head_kv=int(f.get(f"{arch}.attention.head_count_kv", 0)),
    )


def requantize_gguf(src: str | Path, dst: str | Path, preset: str) -> RequantizeReport:
    """Write ``src`` (a GGUF file, or the first of its splits) as ``dst`` with llama-quantize's ``preset`` mix
    (a key of ``mix.PRESETS``: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_K, Q4_K_M)."""
    if preset not in PRESETS:
        raise UnsupportedModelError(f"unknown quantization preset {preset!r}; supported: {', '.join(PRESETS)}")
    src, dst = Path(src), Path(dst)
    if dst.resolve() == src.resolve():
        raise CheckpointError(f"re-quantizing {src} onto itself")
    t0 = time.perf_counter()
    f = GGUFFile(src)
    try:
        types = plan_file(f, preset)
        nbytes = _write(f, dst, types, PRESETS[preset].file_type)
    except OSError as exc:
        raise translate(exc, CheckpointError, f"cannot write GGUF {dst}")
    finally:
        f.close()
    counts = Counter(type_name(t) for t in types.values())
    return RequantizeReport(dst, dict(sorted(counts.items())), time.perf_counter() - t0, nbytes)


def _write(f: GGUFFile, dst: Path, types: dict[str, int], file_type: int) -> int:
    align = int(f.get("general.alignment", 32))
    kv = _header_kv(f, file_type)
    infos, offset = [], 0
    for name, info in f.tensors.items():
        ne = tuple(reversed(info.shape))
        size = row_bytes(types[name], info.shape[-1]) * int(np.prod(info.shape[:-1], dtype=np.int64))
        entry = _string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
        infos.append(entry + struct.pack("<IQ", types[name], offset))
        offset += -(-size // align) * align
    head = struct.pack("<4sIQQ", b"GGUF", 3, len(infos), len(kv)) + b"".join(kv) + b"".join(infos)
    head += bytes(-len(head) % align)
    tmp = dst.with_name(dst.name + ".part")  # dst appears only when complete
    try:
        with open(tmp, "wb") as out:
            out.write(head)
            for name, info in f.tensors.items():
                qtype = types[name]
                data = f.raw(name) if qtype == info.qtype else _encode(_float32(f, name), qtype)
                out.write(memoryview(np.ascontiguousarray(data)).cast("B"))
                out.write(bytes(-data.nbytes % align))
            size = out.tell()
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size
