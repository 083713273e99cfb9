"""``open_gguf``: the file, its spec, its tensor source and its tokenizer in one call."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path
from typing import Any

from ...errors import CheckpointError, UnsupportedModelError
from ..spec import ModelSpec
from .config import spec_from_gguf
from .reader import GGUFFile
from .source import GGUFSource
from .tokenizer import tokenizer_from_gguf

__all__ = ["open_gguf"]

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.")
_log = logging.getLogger(__name__)


def open_gguf(
    path: str | Path, mtp_from: str | Path | None = None, *, tokenizer: bool = True, need_tokenizer: bool = True
) -> tuple[ModelSpec, GGUFSource, Any]:
    """(spec, source, tokenizer or None); see :func:`sangama_p2p.model.gguf.open_gguf`."""
    f = GGUFFile(path)
    try:
        spec = spec_from_gguf(f)
        _check_shapes(f, spec)
        if mtp_from is not None:
            _check_mtp_from(Path(mtp_from), spec)
        source = GGUFSource(f, spec, mtp_from)
        spec = dataclasses.replace(spec, mtp_num_layers=_mtp_layers(source, spec))
        source.spec = spec
        tok = _tokenizer(f, need_tokenizer) if tokenizer else None
    except BaseException:
        f.close()
        raise
    if tok is not None and tok.get_vocab_size() > spec.vocab_size:
        f.close()
        raise CheckpointError(f"{path}: tokenizer has {tok.get_vocab_size()} tokens, model {spec.vocab_size}")
    return spec, source, tok


def _tokenizer(f: GGUFFile, needed: bool) -> Any:
    """The file's tokenizer; an unsupported one is an error only when it is ``needed`` (text, not token ids)."""
    try:
        return tokenizer_from_gguf(f)
    except UnsupportedModelError as exc:
        if needed:
            raise
        _log.warning("%s: opened without its tokenizer: %s", f.path, exc)
        return None


def _check_mtp_from(path: Path, spec: ModelSpec) -> None:
    """``mtp_from`` must be a checkpoint of the same model, or its MTP head would not fit the GGUF's layers."""
    other = ModelSpec.from_dir(path)
    mine = (spec.arch, spec.hidden_size, spec.vocab_size, spec.num_experts)
    theirs = (other.arch, other.hidden_size, other.vocab_size, other.num_experts)
    if mine != theirs:
        raise CheckpointError(
            f"mtp_from {path} does not match the GGUF model: (arch, hidden, vocab, experts) {theirs} != {mine}"
        )


def _check_shapes(f: GGUFFile, spec: ModelSpec) -> None:
    """The metadata and the tensors must agree on the basic sizes (else the first matmul would fail obscurely)."""
    for name in ("token_embd.weight", "output.weight"):
        info = f.tensors.get(name)
        if info is not None and info.shape != (spec.vocab_size, spec.hidden_size):
            raise CheckpointError(
                f"{f.path}: {name} has shape {list(info.shape)} but the metadata says vocab {spec.vocab_size}, "
                f"hidden {spec.hidden_size}"
            )
    for i in range(spec.num_layers):
        if not any(n.startswith(f"blk.{i}.") for n in f.tensors):
            raise CheckpointError(f"{f.path}: block {i} of {spec.num_layers} has no tensors")


def _mtp_layers(source: GGUFSource, spec: ModelSpec) -> int:
    """MTP layers actually present (GGUF files often declare nextn layers but drop their tensors)."""
    if spec.arch != "qwen3_5_moe" or not source.has("mtp.fc.weight"):
        return 0
    layers = {int(m.group(1)) for n in source.names() if (m := _MTP_LAYER.match(n))}
    return len(layers)
