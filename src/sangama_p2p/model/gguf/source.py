"""A :class:`TensorSource` over a GGUF checkpoint that keeps quantized tensors quantized.

Canonical HF names are mapped to GGUF tensors when the file is opened (no data is read then). ``get`` reads one
tensor: quantized tensors become :class:`QuantTensor` (uint8 blocks; a stage repacks them once with :meth:`repack`
for fused kernels, or dequantizes them per use), dense F32/F16/BF16 tensors are returned as stored (a stage computing
in float32 multiplies F16 weights in fp16, or upcasts them per use, rather than holding a second, wider copy). One expert of a stacked ``ffn_*_exps`` tensor is a view of its slice; the other experts' bytes
are never touched. llama.cpp's transforms are undone here, so values equal the Hugging Face checkpoint's.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from ...errors import CheckpointError
from ..spec import ModelSpec
from ..weights import SafetensorsSource, Weight
from .quants import QuantTensor
from .reader import GGUFFile
from .transforms import GGUF_ARCH_OF, Mapping, folds_norm, hf_name, inverse_col_perm, inverse_dense, inverse_row_perm

__all__ = ["GGUFSource"]

_VALUE_CHANGED = ("linear_attn.A_log", "linear_attn.conv1d.weight", "mlp.shared_expert_gate.weight")


class GGUFSource:
    """Canonical-name access to a GGUF file's tensors; ``reads`` lists the names asked for, ``gguf_reads`` the
    GGUF tensors (with expert index) whose bytes were touched."""

    def __init__(self, file: GGUFFile, spec: ModelSpec, mtp_from: str | Path | None = None) -> None:
        self.file = file
        self.spec = spec
        self.reads: list[str] = []
        self.gguf_reads: list[tuple[str, int | None]] = []
        self._index: dict[str, Mapping] = {}
        arch = GGUF_ARCH_OF[spec.arch]
        for name in file.tensors:
            for hf, mapping in hf_name(arch, name, spec.num_layers, spec.num_experts):
                self._index[hf] = mapping
        self._mtp = SafetensorsSource(mtp_from) if mtp_from is not None else None

    def names(self) -> list[str]:
        own = [n for n in self._index if not (self._mtp is not None and n.startswith("mtp."))]
        extra = [n for n in self._mtp.names() if n.startswith("mtp.")] if self._mtp is not None else []
        return own + extra

    def canonical_names(self) -> dict[str, str]:
        """GGUF tensor name -> one canonical name it answers for (model.fingerprint assigns tensors to layers)."""
        out: dict[str, str] = {}
        for hf, mapping in self._index.items():
            out.setdefault(mapping.gguf, hf)
        return out

    @property
    def mtp_source(self) -> SafetensorsSource | None:
        """The safetensors checkpoint the MTP layer comes from (``mtp_from``), if any."""
        return self._mtp

    def has(self, name: str) -> bool:
        if self._mtp is not None and name.startswith("mtp."):
            return self._mtp.has(name)
        return name in self._index

    def nbytes_in_file(self, name: str) -> int:
        """Bytes the tensor behind ``name`` takes in the file (one expert's share of a stacked tensor)."""
        mapping = self._index[name]
        info = self.file.tensors[mapping.gguf]
        if mapping.expert is None:
            return info.nbytes
        share = info.nbytes // info.shape[0]
        return share // 2 if mapping.fused_half is not None else share

    def get(self, name: str, dtype: torch.dtype) -> Weight:
        if self._mtp is not None and name.startswith("mtp."):
            self.reads.append(name)
            return self._mtp.get(name, dtype)
        mapping = self._index.get(name)
        if mapping is None:
            raise CheckpointError(f"GGUF checkpoint {self.file.path} lacks tensor {name}")
        self.reads.append(name)
        self.gguf_reads.append((mapping.gguf, mapping.expert))
        info = self.file.tensors[mapping.gguf]
        if mapping.expert is not None:
            return self._expert(name, mapping.gguf, mapping.expert, mapping.fused_half, dtype)
        row_perm = inverse_row_perm(self.spec, name)
        col_perm = inverse_col_perm(self.spec, name)
        if info.is_quantized:
            if len(info.shape) != 2:
                raise CheckpointError(f"quantized tensor {mapping.gguf} has shape {info.shape}; expected 2-D")
            if folds_norm(self.spec, name) or name.endswith(_VALUE_CHANGED):
                raise CheckpointError(f"{mapping.gguf} is quantized ({info.type_name}); llama.cpp stores it as F32")
            if row_perm is None:
                return QuantTensor(info.qtype, self.file.view(mapping.gguf), info.shape[-1], col_perm)
            reread = functools.partial(self._reordered, mapping.gguf, row_perm)
            return QuantTensor(info.qtype, reread(), info.shape[-1], col_perm, reread)
        changed = row_perm is not None or col_perm is not None or folds_norm(self.spec, name)
        changed = changed or name.endswith(_VALUE_CHANGED)
        t = self.file.read(mapping.gguf) if changed else self.file.view(mapping.gguf)
        return _narrow(inverse_dense(self.spec, name, t), dtype)

    def _reordered(self, gguf: str, row_perm: torch.Tensor) -> torch.Tensor:
        return self.file.read(gguf).index_select(0, row_perm)

    def _expert(self, name: str, gguf: str, e: int, half: int | None, dtype: torch.dtype) -> Weight:
        info = self.file.tensors[gguf]
        if len(info.shape) != 3 or info.shape[0] != self.spec.num_experts or e >= info.shape[0]:
            raise CheckpointError(
                f"{gguf} has shape {info.shape}; expected [{self.spec.num_experts}, out, in] for {name}"
            )
        full = self.file.view(gguf)
        part = full[e] if info.is_quantized else full.reshape(info.shape)[e]
        if half is not None:
            rows = part.shape[0] // 2
            part = part[:rows] if half == 0 else part[rows:]
        if info.is_quantized:
            return QuantTensor(info.qtype, part, info.shape[-1])
        return _narrow(part, dtype)

    def repack(self, w: Weight, dtype: torch.dtype, device: torch.device | str = "cpu", head: bool = False) -> Weight:
        """The weight in the layout of ``device``'s fused kernel, built once at load (``packed.repack``; ``head``: the
        output head); the mapped pages of the blocks it was built from are dropped as it goes
        (``GGUFFile.release_view``)."""
        from .packed import repack

        return repack(w, dtype, self.file.release_view, device, head)

    def release_view(self, view: torch.Tensor) -> None:
        """Drop the mapped pages under ``view`` (a chunk of blocks read once at load, e.g. for the head's norms)."""
        self.file.release_view(view)

    def release_pages(self) -> None:
        """Forget the mapped pages read so far (the repacked weights hold their own copies), and hand the repacking's
        freed temporaries back to the OS."""
        from .packed import trim_heap

        self.file.release_pages()
        trim_heap()

    def close(self) -> None:
        self.file.close()
        if self._mtp is not None:
            self._mtp.close()


def _narrow(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast only when it makes the tensor smaller; the runtime upcasts per use (``weights.dense``)."""
    if t.dtype != dtype and dtype.is_floating_point and torch.finfo(dtype).bits < torch.finfo(t.dtype).bits:
        return t.to(dtype)
    return t
