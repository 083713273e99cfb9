"""A ``tokenizers.Tokenizer`` rebuilt from a GGUF file's ``tokenizer.ggml.*`` metadata (byte-level BPE only).

llama.cpp keeps the vocabulary, the merges and the token types, and names the pre-tokenizer (``tokenizer.ggml.pre``)
instead of storing its regex; the regexes below are the ones the Hugging Face tokenizers of those models use.
"""

from __future__ import annotations

import json
from typing import Any

from ...errors import CheckpointError, UnsupportedModelError
from .reader import GGUFFile

__all__ = ["PRE_TOKENIZERS", "tokenizer_from_gguf", "gguf_tokenizer_fields"]

_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> (split regex, NFC normalizer, ignore_merges); "" = GPT-2's own ByteLevel regex
PRE_TOKENIZERS: dict[str, tuple[str, bool, bool]] = {
    "gpt-2": ("", False, False),
    "qwen35": (_QWEN35, True, False),
    "qwen2": (_QWEN2, True, False),
    "llama-bpe": (_LLAMA3, False, True),
}
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def tokenizer_from_gguf(f: GGUFFile) -> Any:
    """Build the tokenizer (None when the file carries none); raises :class:`UnsupportedModelError` for
    vocabularies other than gpt2-style BPE."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    kind = f.get("tokenizer.ggml.model")
    if kind is None:
        return None  # a GGUF may carry no tokenizer; the caller decides whether it needs one
    if kind != "gpt2":
        raise UnsupportedModelError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = str(f.get("tokenizer.ggml.pre", "default"))
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(sorted(PRE_TOKENIZERS))})"
        )
    regex, nfc, ignore_merges = PRE_TOKENIZERS[pre]
    tokens = f.array_field("tokenizer.ggml.tokens")
    merges = f.array_field("tokenizer.ggml.merges")
    types = f.array_field("tokenizer.ggml.token_type")
    if not tokens or merges is None:
        raise CheckpointError(f"{f.path} lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    types = list(types) if types is not None else [_NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise CheckpointError(f"{f.path}: {len(tokens)} tokens but {len(types)} token types")
    vocab: dict[str, int] = {}
    added: list[tuple[int, str, bool]] = []
    for i, (tok, typ) in enumerate(zip(tokens, types)):
        vocab.setdefault(tok, i)  # every id in the model vocabulary, so added tokens keep theirs wherever they sit
        if typ in (_CONTROL, _USER_DEFINED):
            added.append((i, tok, typ == _CONTROL))
    try:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
        model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, fuse_unk=False, byte_fallback=False)
    except Exception as exc:
        raise CheckpointError(f"{f.path}: bad BPE vocabulary or merges: {exc}") from exc
    tok = Tokenizer(model)
    if nfc:
        tok.normalizer = normalizers.NFC()
    if regex:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    # added tokens are matched whole before BPE; they are already in the vocabulary, so they keep their ids
    for i, content, special in sorted(added):
        if special:
            tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
        else:
            tok.add_tokens([AddedToken(content, special=False, normalized=False)])
        if tok.token_to_id(content) != i:
            raise CheckpointError(f"{f.path}: added token {content!r} should have id {i}")
    bos = f.get("tokenizer.ggml.bos_token_id")
    if f.get("tokenizer.ggml.add_bos_token") and bos is not None:
        name = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{name}:0 $A:0", pair=f"{name}:0 $A:0 {name}:1 $B:1", special_tokens=[(name, int(bos))]
        )
    else:
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tok


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
    types = [5] * size  # UNUSED until filled
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
        pre = next((name for name, (rx, _, _) in PRE_TOKENIZERS.items() if rx and json.dumps(rx)[1:-1] in text), None)
        if pre is None:
            raise UnsupportedModelError(
                "the tokenizer's pre-tokenizer matches none that GGUF names (gpt-2, qwen2, qwen35, llama-bpe)"
            )
    return {"tokens": tokens, "types": types, "merges": merges, "pre": pre}
