"""Opening a checkpoint: a Hugging Face safetensors directory or a GGUF file, behind one interface."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import CheckpointError
from .spec import ModelSpec
from .weights import SafetensorsSource, TensorSource

__all__ = ["Checkpoint", "open_checkpoint"]


@dataclasses.dataclass
class Checkpoint:
    path: Path
    spec: ModelSpec
    source: TensorSource
    tokenizer: Any | None  # model.tokenizer.Tokenizer, or None when the checkpoint ships none

    def close(self) -> None:
        self.source.close()


def open_checkpoint(path: str | Path, *, mtp_from: str | Path | None = None, tokenizer: bool = True,
                    need_tokenizer: bool = True) -> Checkpoint:
    """Open ``path`` (a directory with config.json + safetensors, or a ``.gguf`` file); reads no tensor yet.

    ``tokenizer=False`` opens the weights without building a tokenizer (``Checkpoint.tokenizer`` is then None).
    ``need_tokenizer=False``: a GGUF tokenizer we cannot rebuild leaves ``tokenizer`` None instead of failing.
    """
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if p.is_file() and p.suffix == ".gguf":
        from .gguf import open_gguf  # GGUF support lives in its own subpackage
        from .tokenizer import Tokenizer

        spec, source, tok = open_gguf(p, mtp_from=mtp_from, tokenizer=tokenizer, need_tokenizer=need_tokenizer)
        return Checkpoint(p, spec, source, Tokenizer(tok, spec.eos_token_ids) if tok is not None else None)
    if not p.is_dir():
        raise CheckpointError(f"{p} is neither a checkpoint directory nor a .gguf file")
    spec = ModelSpec.from_dir(p)
    source = SafetensorsSource(p)
    tok_dir = None
    if tokenizer and (p / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer

        tok_dir = Tokenizer.from_dir(p)
    return Checkpoint(p, spec, source, tok_dir)
