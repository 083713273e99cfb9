"""Text <-> token ids, and the byte-level BPE the project's own tiny models use.

:class:`Tokenizer` is a thin wrapper over a ``tokenizers.Tokenizer`` (read from ``tokenizer.json``, or built
elsewhere, e.g. from GGUF metadata) that knows which ids end a generation. Encoding never adds special tokens and
decoding never drops them, so ``decode(encode(s)) == s`` for any string with a byte-level tokenizer.

:func:`train_bpe` trains a byte-level BPE deterministically on the small embedded corpus (``corpus.txt``): the same
vocabulary size always gives the same ``tokenizer.json``. The 256 byte tokens are always in the vocabulary, so any
UTF-8 text encodes; when the corpus runs out of merges, ``<|reserved_N|>`` special tokens fill the vocabulary so that
every id the model can emit decodes.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from ..errors import CheckpointError, ModelError, translate

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "IncrementalDecoder",
    "Tokenizer",
    "atomic_write",
    "corpus_text",
    "train_bpe",
    "write_tokenizer_files",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Specials get the first ids (0..3); the chat markers are there so a chat template has something to use.
SPECIAL_TOKENS = (EOS_TOKEN, PAD_TOKEN, "<|im_start|>", "<|im_end|>")


class Tokenizer:
    """Encode/decode with a ``tokenizers.Tokenizer``; ``eos_token_ids`` are the ids that end a generation."""

    def __init__(self, tok: tokenizers.Tokenizer, eos_ids: Iterable[int] = ()) -> None:
        self._tok = tok
        self._vocab_size = int(tok.get_vocab_size(with_added_tokens=True))
        self.eos_token_ids: tuple[int, ...] = tuple(int(i) for i in eos_ids)
        bad = [i for i in self.eos_token_ids if not 0 <= i < self._vocab_size]
        if bad:
            raise CheckpointError(f"eos token ids {bad} lie outside the vocabulary of {self._vocab_size} tokens")

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added/special tokens included."""
        return self._vocab_size

    @property
    def backend(self) -> tokenizers.Tokenizer:
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no BOS/EOS is added (the caller decides)."""
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens kept, so that decoding is the inverse of :meth:`encode`."""
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise ModelError(f"token ids {bad[:8]} lie outside the vocabulary of {self._vocab_size} tokens")
        return self._tok.decode(ids, skip_special_tokens=False)

    def token_id(self, token: str) -> int | None:
        """The id of a token string (e.g. a special token), or None."""
        return self._tok.token_to_id(token)

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer":
        """Read ``tokenizer.json`` from a checkpoint directory; eos ids come from config/generation/tokenizer config."""
        path = Path(path)
        tok_path = path / "tokenizer.json"
        if not tok_path.is_file():
            raise CheckpointError(f"no tokenizer.json in {path}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as exc:  # tokenizers raises plain Exception subclasses
            raise translate(exc, CheckpointError, f"corrupt tokenizer file {tok_path}")
        return cls(tok, _eos_ids_from_dir(path, tok))


class IncrementalDecoder:
    """Turns a stream of token ids into text pieces for streaming output.

    A byte-level token can end inside a UTF-8 character, and some decoders treat the first token specially (e.g.
    strip a leading space), so tokens cannot be decoded one at a time. As vLLM's detokenizer does, this keeps a short
    window of already-emitted ids as context, decodes the window with and without the new ids, and emits the
    difference - holding it back while it ends in U+FFFD (an incomplete character). The concatenated pieces plus
    :meth:`flush` equal ``tokenizer.decode(all_ids)`` for prefix-stable decoders such as byte-level BPE.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # window start: context ids already emitted
        self._read = 0  # ids before this index have been emitted

    def push(self, ids: Sequence[int]) -> str:
        """Add ids; return the text that is now complete (possibly empty)."""
        self._ids.extend(int(i) for i in ids)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        if len(text) <= len(prefix_text) or text.endswith("\ufffd"):
            return ""
        del self._ids[: self._read]  # keep only the emitted ids still needed as context
        self._prefix, self._read = 0, len(self._ids)
        return text[len(prefix_text) :]

    def flush(self) -> str:
        """Whatever is still held back (a truncated character comes out as U+FFFD)."""
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        text = self._tok.decode(self._ids[self._prefix :])
        del self._ids[: self._read]
        self._prefix, self._read = 0, len(self._ids)
        return text[len(prefix_text) :]


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise translate(exc, CheckpointError, f"cannot read {path}")
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} does not hold a JSON object")
    return data


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _eos_ids_from_dir(path: Path, tok: tokenizers.Tokenizer) -> list[int]:
    """Union of eos ids named by generation_config.json and config.json (text_config too); else the eos token."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        cfg = _read_json(path / name)
        if cfg is None:
            continue
        sub = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
        for source in (cfg, sub):
            try:
                found = _as_ids(source.get("eos_token_id"))
            except (TypeError, ValueError) as exc:
                raise translate(exc, CheckpointError, f"bad eos_token_id in {path / name}")
            ids.extend(i for i in found if i not in ids)
    if ids:
        return ids
    tcfg = _read_json(path / "tokenizer_config.json") or {}
    eos = tcfg.get("eos_token")
    if isinstance(eos, dict):
        eos = eos.get("content")
    for token in (eos, EOS_TOKEN):
        if isinstance(token, str) and tok.token_to_id(token) is not None:
            return [int(tok.token_to_id(token))]
    return []


# ---- training ---------------------------------------------------------------------------------------------------
def corpus_text() -> str:
    """The small embedded corpus (English prose and Python) the BPE is trained on."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


@functools.lru_cache(maxsize=8)
def _trained_json(vocab_size: int) -> str:
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ModelError(f"vocab_size {vocab_size} is below the 256 byte tokens + {len(SPECIAL_TOKENS)} specials")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([corpus_text()], trainer=trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:  # the corpus ran out of merges: fill with reserved specials so every id decodes
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    return tok.to_str()


def train_bpe(vocab_size: int) -> tokenizers.Tokenizer:
    """A byte-level BPE with exactly ``vocab_size`` ids, trained on the embedded corpus (deterministic)."""
    return tokenizers.Tokenizer.from_str(_trained_json(vocab_size))


def atomic_write(path: Path, data: str | bytes) -> None:
    """Write via a per-process temporary file and rename, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    if isinstance(data, str):
        tmp.write_text(data, encoding="utf-8")
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def _json_text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def write_tokenizer_files(tok: tokenizers.Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json (loadable by AutoTokenizer)."""
    out_dir = Path(out_dir)
    atomic_write(out_dir / "tokenizer.json", tok.to_str(pretty=True))
    config = {
        "backend": "tokenizers",
        "eos_token": EOS_TOKEN,
        "model_max_length": model_max_length,
        "pad_token": PAD_TOKEN,
        "tokenizer_class": "TokenizersBackend",
    }
    atomic_write(out_dir / "tokenizer_config.json", _json_text(config))
    atomic_write(out_dir / "special_tokens_map.json", _json_text({"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}))
