"""What a client needs to talk to a model without its weights: tokenizer, chat template, end-of-sequence ids and
context length, from a checkpoint directory or a ``.gguf`` file (the file's metadata only; no tensor is indexed)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, SangamaError
from .chat import ChatTemplate, load_chat_template
from .tokenizer import Tokenizer

__all__ = ["ChatModel", "open_chat_model"]


@dataclass(frozen=True)
class ChatModel:
    tokenizer: Tokenizer
    template: ChatTemplate
    eos_ids: tuple[int, ...]
    context: int | None  # the checkpoint's context length, when it says


def open_chat_model(path: str | Path) -> ChatModel:
    """The chat-facing parts of the checkpoint at ``path``; :class:`CheckpointError` when it carries no tokenizer."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        from .gguf.reader import read_metadata
        from .gguf.tokenizer import tokenizer_from_gguf

        meta = read_metadata(p)
        tok: Any = tokenizer_from_gguf(meta)
        if tok is None:
            raise CheckpointError(f"{p} carries no tokenizer (tokenizer.ggml.model): pass --tokenizer DIR")
        eos = meta.get("tokenizer.ggml.eos_token_id")
        ids = (int(eos),) if eos is not None else ()
        context = meta.get(f"{meta.get('general.architecture')}.context_length")
        return ChatModel(Tokenizer(tok, ids), ChatTemplate.from_gguf_metadata(meta.metadata, p.name), ids,
                         int(context) if context else None)
    if not p.is_dir():
        raise CheckpointError(f"{p} is neither a checkpoint directory nor a .gguf file")
    tokenizer = Tokenizer.from_dir(p)
    try:
        from .spec import ModelSpec

        spec = ModelSpec.from_dir(p)
        eos_ids, context = tuple(spec.eos_token_ids), spec.max_position_embeddings
    except SangamaError:  # a directory with only the tokenizer
        eos_ids, context = tuple(tokenizer.eos_token_ids), None
    return ChatModel(tokenizer, load_chat_template(p), eos_ids, context)
