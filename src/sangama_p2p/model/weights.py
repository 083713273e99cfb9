"""Where a stage's tensors come from: a :class:`TensorSource` maps canonical names to tensors.

Canonical names are the Hugging Face ones of a text-only causal LM: ``model.embed_tokens.weight``,
``model.layers.{i}.<...>``, ``model.norm.weight``, ``lm_head.weight`` and ``mtp.<...>``. Experts are always asked
for one at a time (``model.layers.{i}.mlp.experts.{e}.gate_proj.weight``); a source whose file fuses them
(``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I], or GGUF ``ffn_*_exps``) answers with a view.

A source returns either a dense ``torch.Tensor`` or a quantized weight (:class:`QuantWeight`). A stage loaded with
``fused=True`` (the default) repacks quantized weights once into a :class:`FusedWeight` that multiplies without being
dequantized (``model/gguf/packed.py``); with ``fused=False`` the runtime dequantizes them per use. Every source
records which names it has read (``reads``), so tests can prove a stage touched nothing outside its layers.
"""

from __future__ import annotations

import abc
import json
import re
from pathlib import Path
from typing import ClassVar, Iterable, Protocol, Union, runtime_checkable

import torch

from ..errors import CheckpointError, UnsupportedModelError, translate

__all__ = [
    "FusedWeight",
    "GroupedExperts",
    "QuantWeight",
    "SafetensorsSource",
    "TensorSource",
    "Weight",
    "dense",
    "layer_of",
    "weight_nbytes",
]


@runtime_checkable
class QuantWeight(Protocol):
    """A weight kept quantized in memory; dequantized per use."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def nbytes(self) -> int: ...

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor: ...


class FusedWeight(abc.ABC):
    """A weight repacked at load for a fused kernel: ``linear`` multiplies by it without dequantizing it.

    Subclasses also give ``shape``, ``nbytes`` and ``dequantize`` (so :func:`dense` still works for the rare dense
    use), ``to(device)``, and ``concat(parts)``: the parts stacked along the output dimension as one weight, or None.
    """

    shape: tuple[int, ...]
    nbytes: int
    # the dtype :meth:`product` returns and takes without a cast (None: the input's)
    product_dtype: ClassVar[torch.dtype | None] = None

    @abc.abstractmethod
    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x [..., in] -> [..., out]`` in ``x``'s dtype."""

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, in] -> [M, out]`` in the kernel's own output dtype (``x``'s unless a subclass says otherwise), for
        callers that pass the result straight to another product or add it to a wider residual."""
        return self.linear(x)

    @abc.abstractmethod
    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a dense tensor (what the kernel multiplies by)."""

    def settle(self) -> None:
        """Take the final layout, once nothing will join this weight to others (a stage calls it when the layer
        holding it is built, before dropping the mapped pages the layer read). Default: the layout it has."""

    @staticmethod
    def joinable(parts: list["FusedWeight"]) -> bool:
        """Whether :meth:`concat` would join ``parts`` (checked without building the joined weight)."""
        return False

    @staticmethod
    def concat(parts: list["FusedWeight"]) -> "FusedWeight | None":
        return None

    @staticmethod
    def group_experts(gates: list[Weight], ups: list[Weight], downs: list[Weight]) -> "GroupedExperts | None":
        """A MoE layer's experts (one weight per expert and projection) as one grouped product, or None (the layer
        then runs each expert's own products)."""
        return None


class GroupedExperts(Protocol):
    """A MoE layer's experts run together: ``x [N, H]`` through each row's experts ``top_i [N, k]``, summed with
    the weights ``top_w [N, k]``, as ``[N, H]`` (any float dtype)."""

    def weights(self) -> list["Weight"]: ...

    def __call__(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor: ...


Weight = Union[torch.Tensor, QuantWeight, FusedWeight]


def dense(w: Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight as a dense tensor of ``dtype`` (free for dense weights already in ``dtype``)."""
    if isinstance(w, torch.Tensor):
        return w if w.dtype == dtype else w.to(dtype)
    return w.dequantize(dtype)


def weight_nbytes(w: Weight) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    return int(w.nbytes)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a canonical tensor name belongs to, or None for embeddings/norm/head/MTP."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


class TensorSource(Protocol):
    """What a stage loads its weights from."""

    reads: list[str]

    def has(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype) -> Weight: ...

    def close(self) -> None: ...


# Prefixes found in real checkpoints, mapped to canonical ones (longest first).
_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.mtp.", "mtp."),
)
_FLOAT_DTYPES = {torch.float32, torch.float16, torch.bfloat16}
_FUSED_RE = re.compile(r"^(?P<pre>.*\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def _canonical(name: str) -> str:
    for old, new in _PREFIXES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class SafetensorsSource:
    """Memory-mapped safetensors, single file or sharded with ``model.safetensors.index.json``."""

    def __init__(self, path: str | Path) -> None:
        from safetensors import safe_open  # local: keeps import of this module cheap

        self.path = Path(path)
        self.reads: list[str] = []
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        files: dict[str, str] = {}  # raw name -> file name
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise translate(exc, CheckpointError, f"corrupt shard index {index}")
            files = {str(k): str(v) for k, v in weight_map.items()}
        elif single.is_file():
            files = {}
        else:
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {self.path}")
        self._handles: dict[str, object] = {}
        self._where: dict[str, tuple[str, str]] = {}  # canonical -> (file, raw name)

        def handle(fname: str):
            if fname not in self._handles:
                fpath = self.path / fname
                if not fpath.is_file():
                    raise CheckpointError(f"missing checkpoint shard {fpath}")
                try:
                    self._handles[fname] = safe_open(str(fpath), framework="pt")
                except Exception as exc:  # safetensors raises its own error types
                    raise translate(exc, CheckpointError, f"corrupt safetensors file {fpath}")
            return self._handles[fname]

        if files:
            for raw, fname in files.items():
                self._where[_canonical(raw)] = (fname, raw)
            for fname in sorted(set(files.values())):
                handle(fname)
        else:
            h = handle(single.name)
            for raw in h.keys():  # type: ignore[attr-defined]
                self._where[_canonical(raw)] = (single.name, raw)
        self._handle = handle

    def names(self) -> Iterable[str]:
        return self._where.keys()

    def tensor_files(self) -> dict[str, tuple[str, str]]:
        """Canonical name -> (file name in ``path``, name stored in that file), for every tensor (model.fingerprint)."""
        return dict(self._where)

    def has(self, name: str) -> bool:
        if name in self._where:
            return True
        m = _FUSED_RE.match(name)
        return bool(m) and self._fused_name(m) in self._where

    @staticmethod
    def _fused_name(m: re.Match) -> str:
        proj = m.group("proj")
        return f"{m.group('pre')}.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"

    def _raw(self, name: str) -> torch.Tensor:
        fname, raw = self._where[name]
        self.reads.append(name)
        try:
            return self._handle(fname).get_tensor(raw)  # type: ignore[attr-defined]
        except Exception as exc:  # safetensors' own error types (a truncated or corrupt file)
            raise translate(exc, CheckpointError, f"cannot read tensor {raw} from {self.path / fname}")

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        if name in self._where:
            t = self._raw(name)
        else:
            m = _FUSED_RE.match(name)
            if not m or self._fused_name(m) not in self._where:
                raise CheckpointError(f"checkpoint {self.path} lacks tensor {name}")
            t = self._fused_expert(m)
        if t.dtype not in _FLOAT_DTYPES:
            raise UnsupportedModelError(f"tensor {name} has dtype {t.dtype}; supported: float32, float16, bfloat16")
        return t.to(dtype).contiguous()

    def _fused_expert(self, m: re.Match) -> torch.Tensor:
        """Expert e of a fused [E, 2I, H] gate_up / [E, H, I] down tensor (read once, cached per layer)."""
        fused = self._fused_name(m)
        cache = self.__dict__.setdefault("_fused_cache", {})
        if fused not in cache:
            cache.clear()  # experts are loaded layer by layer; keep one fused tensor alive at a time
            cache[fused] = self._raw(fused)
        full = cache[fused]
        e = int(m.group("e"))
        if m.group("proj") == "down_proj":
            return full[e]
        inter = full.shape[1] // 2
        return full[e, :inter] if m.group("proj") == "gate_proj" else full[e, inter:]

    def close(self) -> None:
        self._handles.clear()
        self.__dict__.pop("_fused_cache", None)
