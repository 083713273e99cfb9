"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata, encoding as llama.cpp does.

Two vocabulary kinds (``tokenizer.ggml.model``):
- ``gpt2``: byte-level BPE with stored merges; ``tokenizer.ggml.pre`` names llama.cpp's split rules
  (:mod:`.pretokenize`). As llama.cpp, no Unicode normalization is applied (Qwen's ``tokenizer.json`` has NFC).
- ``llama``: SentencePiece. llama.cpp's ``llm_tokenizer_spm`` escapes spaces as U+2581, prepends one to every text
  piece (``add_space_prefix``, default on), then repeatedly merges the adjacent pair whose concatenation is the
  highest-scoring token, and spells pieces that are no token as ``<0xNN>`` byte tokens. That is a BPE whose merges
  are every (left, right) split of every token, ranked by the token's score: ``models.BPE(byte_fallback=True)``.
  Equal scores are ranked by token id (llama.cpp takes the leftmost pair instead); real vocabularies have distinct
  scores for merged pieces.
Control, user-defined and unknown tokens (and the end-of-generation names llama.cpp forces to control) are matched
whole before anything else. ``encode(text)`` adds BOS/EOS as llama.cpp's ``llama_tokenize(add_special=true)`` does:
BOS when ``tokenizer.ggml.add_bos_token`` (default: on for SPM and the llama3-family pre-tokenizers), EOS when
``tokenizer.ggml.add_eos_token``. (``llama-tokenize`` passes ``add_special`` only when the model adds BOS.)
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from ...errors import CheckpointError, UnsupportedModelError, translate
from .pretokenize import PRE_RULES, pre_tokenizer
from .reader import GGUFFile, GGUFMetadata

__all__ = [
    "PRE_RULES", "VOCAB_KINDS", "gguf_tokenizer_fields", "spm_merges", "tokenizer_from_gguf", "tokenizer_from_metadata",
]

VOCAB_KINDS = ("gpt2", "llama")  # tokenizer.ggml.model values we rebuild
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED = 1, 2, 3, 4, 5  # llama.cpp token types (6 = BYTE)
# llama.cpp marks these end-of-generation tokens CONTROL whatever their stored type (llama-vocab.cpp, load)
_EOG_NAMES = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
))
_SPACE = "\u2581"


def tokenizer_from_gguf(f: GGUFFile | GGUFMetadata) -> Any:
    """Build the tokenizer of an open GGUF file, or of its metadata alone (None when it carries none)."""
    return tokenizer_from_metadata(f.metadata, str(f.path))


def tokenizer_from_metadata(meta: Mapping[str, Any], where: str = "GGUF metadata") -> Any:
    """Build the tokenizer from ``tokenizer.ggml.*`` fields (None without ``tokenizer.ggml.model``).

    Raises :class:`UnsupportedModelError` for other vocabulary kinds or pre-tokenizer names (the message lists the
    supported ones) and :class:`CheckpointError` for inconsistent fields.
    """
    from tokenizers import Tokenizer

    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None  # a GGUF may carry no tokenizer; the caller decides whether it needs one
    if kind not in VOCAB_KINDS:
        raise UnsupportedModelError(
            f"GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(VOCAB_KINDS)})"
        )
    pre = str(meta.get("tokenizer.ggml.pre") or "default")
    if kind == "gpt2" and pre not in PRE_RULES:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_RULES))})"
        )
    tokens = _array(meta, "tokenizer.ggml.tokens", where)
    if not tokens:
        raise CheckpointError(f"{where} lacks tokenizer.ggml.tokens")
    types = _array(meta, "tokenizer.ggml.token_type", where)
    types = list(types) if types is not None else [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{where}: {len(tokens)} tokens but {len(types)} token types")
    if len(set(tokens)) != len(tokens):
        raise CheckpointError(f"{where}: tokenizer.ggml.tokens holds the same text twice")
    vocab = {t: i for i, t in enumerate(tokens)}
    if kind == "gpt2":
        rule = PRE_RULES[pre]
        tok = Tokenizer(_bpe_model(meta, vocab, rule.ignore_merges, where))
        tok.pre_tokenizer = pre_tokenizer(rule)
        _byte_level_decoder(tok)
        add_bos, default_bos = rule.add_bos, 11  # llama.cpp's defaults for BPE vocabularies
    else:  # "llama", SentencePiece
        tok = Tokenizer(_spm_model(meta, tokens, vocab, where))
        _spm_normalizer_decoder(tok, bool(meta.get("tokenizer.ggml.add_space_prefix", True)))
        add_bos, default_bos = True, 1
    _add_whole_tokens(tok, tokens, types, where)
    bos = _special_id(meta, "tokenizer.ggml.bos_token_id", default_bos, len(tokens))
    eos = _special_id(meta, "tokenizer.ggml.eos_token_id", 2 if kind == "llama" else 11, len(tokens))
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if (add_bos and bos < 0) or (add_eos and eos < 0):
        raise CheckpointError(f"{where} asks for a BOS or EOS token but names none in its vocabulary")
    _post_processor(tok, tokens, bos if add_bos else -1, eos if add_eos else -1, kind, where)
    return tok


def _array(meta: Mapping[str, Any], key: str, where: str) -> list[Any] | None:
    value = meta.get(key)
    if value is not None and not isinstance(value, list):
        raise CheckpointError(f"{where}: metadata {key} is not an array")
    return value


def _bpe_model(meta: Mapping[str, Any], vocab: dict[str, int], ignore_merges: bool, where: str) -> Any:
    from tokenizers import models

    merges = _array(meta, "tokenizer.ggml.merges", where)
    if merges is None:
        raise CheckpointError(f"{where} lacks tokenizer.ggml.merges")
    try:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        return models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False)
    except Exception as exc:  # tokenizers raises plain Exceptions for merges naming unknown tokens
        raise translate(exc, CheckpointError, f"{where}: bad BPE vocabulary or merges")


def spm_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every (left, right) split of every token whose halves are tokens, best score first (ties by token id)."""
    vocab = set(tokens)
    ranked = []
    for i, text in enumerate(tokens):
        for k in range(1, len(text)):
            left, right = text[:k], text[k:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, k, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _spm_model(meta: Mapping[str, Any], tokens: list[str], vocab: dict[str, int], where: str) -> Any:
    from tokenizers import models

    scores = _array(meta, "tokenizer.ggml.scores", where)
    scores = [float(s) for s in scores] if scores is not None else [0.0] * len(tokens)
    if len(scores) < len(tokens):
        raise CheckpointError(f"{where}: {len(tokens)} tokens but {len(scores)} scores")
    try:
        return models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), fuse_unk=False, byte_fallback=True)
    except Exception as exc:  # tokenizers raises plain Exceptions
        raise translate(exc, CheckpointError, f"{where}: bad SentencePiece vocabulary")


def _byte_level_decoder(tok: Any) -> None:
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)


def _spm_normalizer_decoder(tok: Any, add_space_prefix: bool) -> None:
    """Spaces become U+2581; each text piece (the text, or a stretch between special tokens) gets one in front."""
    from tokenizers import decoders, normalizers

    steps = [normalizers.Prepend(_SPACE)] if add_space_prefix else []
    tok.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", _SPACE)])
    back = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(back + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))


def _add_whole_tokens(tok: Any, tokens: list[str], types: list[int], where: str) -> None:
    """Tokens llama.cpp matches in the raw text before splitting; they keep their ids (already in the vocab)."""
    from tokenizers import AddedToken

    specials, others = [], []
    for text, typ in zip(tokens, types):
        if typ in (_CONTROL, _UNKNOWN) or text in _EOG_NAMES:
            specials.append(AddedToken(text, special=True, normalized=False))
        elif typ == _USER_DEFINED:
            others.append(AddedToken(text, special=False, normalized=False))
    tok.add_special_tokens(specials)
    tok.add_tokens(others)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise CheckpointError(f"{where}: special tokens did not keep their ids")


def _special_id(meta: Mapping[str, Any], key: str, default: int, n_tokens: int) -> int:
    """llama.cpp's rule: the stored id if in range, else the vocabulary kind's default if in range, else none."""
    value = meta.get(key)
    if value is not None and 0 <= int(value) < n_tokens:
        return int(value)
    return default if default < n_tokens else -1


def _post_processor(tok: Any, tokens: list[str], bos: int, eos: int, kind: str, where: str) -> None:
    from tokenizers import processors

    if bos < 0 and eos < 0:
        if kind == "gpt2":
            tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        return
    specials = [(tokens[i], i) for i in sorted({i for i in (bos, eos) if i >= 0})]

    def seq(name: str, seg: int) -> str:
        parts = [tokens[bos]] * (bos >= 0) + [name] + [tokens[eos]] * (eos >= 0)
        return " ".join(f"{p}:{seg}" for p in parts)

    try:
        tok.post_processor = processors.TemplateProcessing(
            single=seq("$A", 0), pair=f"{seq('$A', 0)} {seq('$B', 1)}", special_tokens=specials
        )
    except Exception as exc:  # tokenizers raises plain Exceptions
        raise translate(exc, CheckpointError, f"{where}: cannot use BOS/EOS tokens {specials}")


# ---- the writer's side: tokenizer.json -> tokenizer.ggml.* -------------------------------------------------------
# the pre-tokenizer regexes of the Hugging Face tokenizers that llama.cpp's converter names qwen35, qwen2, llama-bpe
_HF_REGEXES = {
    "qwen35": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def _looks_special(text: str) -> bool:
    """llama.cpp's converter also marks these non-special added tokens CONTROL (``does_token_look_special``)."""
    return text in ("<pad>", "<mask>", "<2mass>", "[@BOS@]") or (text.startswith("<|") and text.endswith("|>")) or (
        text.startswith("<\uff5c") and text.endswith("\uff5c>")
    )


def gguf_tokenizer_fields(tokenizer_json: dict[str, Any]) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields for an HF ``tokenizer.json`` (byte-level BPE), for the writer.

    Returns tokens (by id), token types, merges (``"a b"``) and the pre-tokenizer name guessed from the regex.
    """
    model = tokenizer_json.get("model", {})
    if model.get("type") != "BPE":
        raise UnsupportedModelError("only byte-level BPE tokenizers can be written to GGUF")
    vocab: dict[str, int] = dict(model["vocab"])
    added = {int(t["id"]): t for t in tokenizer_json.get("added_tokens", [])}
    size = max([*vocab.values(), *added.keys()]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [_UNUSED] * size  # until filled
    for tok, i in vocab.items():
        tokens[i], types[i] = tok, _NORMAL
    for i, t in added.items():
        control = t.get("special") or _looks_special(t["content"])
        tokens[i], types[i] = t["content"], _CONTROL if control else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    pre_tok = tokenizer_json.get("pre_tokenizer") or {}
    if pre_tok.get("type") == "ByteLevel" and pre_tok.get("use_regex", True):
        pre = "gpt-2"
    else:
        text = json.dumps(pre_tok)
        pre = next((name for name, rx in _HF_REGEXES.items() if json.dumps(rx)[1:-1] in text), None)
        if pre is None:
            raise UnsupportedModelError(
                "the tokenizer's pre-tokenizer matches none that GGUF names (gpt-2, qwen2, qwen35, llama-bpe)"
            )
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre}
