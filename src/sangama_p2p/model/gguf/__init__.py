"""GGUF checkpoints (llama.cpp's format), kept quantized in memory.

``open_gguf(path)`` gives the model's :class:`ModelSpec`, a :class:`TensorSource` with canonical Hugging Face names
(llama.cpp's transforms undone, quantized tensors as :class:`QuantTensor`) and the tokenizer. ``write_gguf`` writes
a Hugging Face checkpoint the way llama.cpp's converter does (F16, Q8_0, Q4_K, Q6_K); ``requantize_gguf`` rewrites a
GGUF file with one of llama-quantize's presets (F16, Q8_0, Q4_K_M, ...).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..spec import ModelSpec
    from .requantize import RequantizeReport
    from .source import GGUFSource

__all__ = ["open_gguf", "requantize_gguf", "write_gguf"]


def open_gguf(
    path: str | Path, mtp_from: str | Path | None = None, *, tokenizer: bool = True, need_tokenizer: bool = True
) -> "tuple[ModelSpec, GGUFSource, Any]":
    """Open a GGUF file (or the first of ``-0000K-of-0000N.gguf`` splits): ``(spec, source, tokenizer)``.

    ``mtp_from`` names a safetensors checkpoint directory whose ``mtp.*`` tensors replace (or supply, since GGUF files
    usually lack them) the multi-token-prediction head. ``tokenizer=False`` skips building the tokenizer (the third
    item is then None): for callers that only need the weights. With ``need_tokenizer=False`` (prompts given as token
    ids) an unsupported tokenizer is logged and the third item is None instead of raising
    :class:`UnsupportedModelError`.
    """
    from .open import open_gguf as _open

    return _open(path, mtp_from, tokenizer=tokenizer, need_tokenizer=need_tokenizer)


def write_gguf(hf_dir: str | Path, out_path: str | Path, qtype: str = "F16", **kwargs: Any) -> list[Path]:
    """Write the HF checkpoint in ``hf_dir`` as GGUF with llama.cpp's conventions; returns the files written."""
    from .writer import write_gguf as _write

    return _write(hf_dir, out_path, qtype, **kwargs)


def requantize_gguf(src: str | Path, dst: str | Path, preset: str) -> "RequantizeReport":
    """Write the GGUF file ``src`` as ``dst`` with llama-quantize's per-tensor mix for ``preset`` (F32, F16, BF16,
    Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q6_K, Q4_K_M); deterministic; metadata kept except ``general.file_type``."""
    from .requantize import requantize_gguf as _requantize

    return _requantize(src, dst, preset)
