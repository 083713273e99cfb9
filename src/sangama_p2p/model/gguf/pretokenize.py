"""llama.cpp's BPE pre-tokenizers by ``tokenizer.ggml.pre`` name, as ``tokenizers`` pre-tokenizers.

A GGUF names its pre-tokenizer instead of storing a regex. llama.cpp (``src/llama-vocab.cpp``, the
``llm_tokenizer_bpe`` constructor) maps the name to a LIST of regexes; each one splits every piece left by the one
before (matches and the text between them both become pieces), and the pieces are then byte-encoded GPT-2 style.
``Split(regex, "isolated")`` per regex followed by ``ByteLevel(use_regex=False)`` does the same in ``tokenizers``.

The patterns below are llama.cpp's, with its regex engine's quirks written out so that ``tokenizers``' Oniguruma
gives the same pieces (``src/unicode.cpp``):
- the GPT-2 pattern runs through a hand-written matcher that also has the ``|\\s+`` fallback the listed regex lacks;
- the llama3/qwen2/qwen35 patterns use ``'[sS]`` instead of ``(?i:'s)`` (Oniguruma would also fold ``'ſ``);
- patterns with ``\\p{..}`` run on text where every non-ASCII code point is collapsed to its category, so
  ``\\p{Lu}``, ``\\p{Ll}``, ``\\p{Lt}``, ``\\p{Lm}``, ``\\p{Lo}`` all mean ``\\p{L}`` there;
- patterns without ``\\p{..}`` run with non-ASCII white space replaced by U+000B, so a literal U+3000 in a class
  never matches (deepseek-llm), ``\\d`` is ASCII, and ``$`` is the end of the piece (``\\z`` here).
The tests hold each name's pieces to llama.cpp's own ``unicode_regex_split`` on a stress text set.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["PRE_RULES", "PreRule", "pre_tokenizer"]


@dataclasses.dataclass(frozen=True)
class PreRule:
    """One llama.cpp pre-tokenizer type: its regexes in order and the vocabulary flags it sets."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is itself a token is not merged (llama3 and a few others)
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


_C = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"  # contractions, case-insensitive ASCII
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = _C + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_JAIS2 = (
    _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)"
    r"|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}"
)
_DS_LETTERS = "A-Za-z" + (  # escaped: an editor could normalize these letters (U+1FBE is not U+03B9)
    "\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376"
    "\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f"
    "\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77"
    "\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-"
    "\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec"
    "\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d"
    "\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee"
    "\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb"
    "\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_DS_CJK = r"[[一-龥ࠀ-一가-퟿]&&[^\s]]+"  # U+0800-U+4E00 holds white space, never matched there
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[" + _DS_LETTERS + "]+",
    r"\s?[!-/:-~！-／：-～‘-‟、-。]+",  # llama.cpp writes "　-。": U+3000 is white space, never matched there
    r"\s+\z",
    _DS_CJK,
    r"\p{N}+",
)
_DS3_TAIL = r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
_DEEPSEEK3 = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DS3_TAIL + r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPARK = (r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+", _DS3_TAIL + r"| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+", r"\p{N}")
_YOUTU = (
    r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+" + _C + r"?|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*"
    + _C + r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_POOR = r" ?[^(\s|.,!?…。，、।۔،)]+"
_UPPER, _LOWER = r"((?=[\p{L}])([^a-z]))", r"((?=[\p{L}])([^A-Z]))"
_TEKKEN = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*|\p{{N}}| ?[^\s\p{{L}}\p{{N}}]+"
    r"[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_C}?|\p{{N}}{{1,3}}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER_M, _LOWER_M = r"((?=[\p{L}\p{M}])([^a-z]))", r"((?=[\p{L}\p{M}])([^A-Z]))"
_GRANITE_MULTI = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER_M}*{_LOWER_M}+{_C}?|[^\r\n\p{{L}}\p{{N}}]?{_UPPER_M}+{_LOWER_M}*{_C}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CHAMELEON = (
    r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
    r"[\p{P}!-/:-@\[-`{-~]", _GPT2,
)
_BAILING = (
    r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]"
    r"|\s+(?!\S)|\s+"
)
_SEED_CODER = _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (
    _C + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]"
    r"|\s+(?!\S)|\s+"
)
_MINICPM5 = (r"\p{N}{1,3}", _C + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")

_TYPES: dict[str, tuple[PreRule, tuple[str, ...]]] = {
    # llama.cpp pre type: (rule, the tokenizer.ggml.pre names that select it)
    "default": (PreRule(_DEFAULT), ("default",)),
    "llama3": (PreRule((_LLAMA3,), ignore_merges=True, add_bos=True), (
        "llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano")),
    "dbrx": (PreRule((_LLAMA3,)), ("dbrx", "smaug-bpe")),
    "jais2": (PreRule((_JAIS2,)), ("jais-2",)),
    "deepseek-llm": (PreRule(_DEEPSEEK_LLM), ("deepseek-llm",)),
    "deepseek-coder": (PreRule((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DS_CJK, r"\p{N}")),
                       ("deepseek-coder",)),
    "deepseek-v3": (PreRule(_DEEPSEEK3), ("deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm")),
    "spark2_5": (PreRule(_SPARK), ("spark2_5",)),
    "youtu": (PreRule(_YOUTU, ignore_merges=True), ("youtu",)),
    "falcon": (PreRule((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")), ("falcon",)),
    "starcoder": (PreRule((r"\p{N}", _GPT2)), (
        "starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2")),
    "gpt2": (PreRule((_GPT2,)), (
        "gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
        "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe", "exaone4", "mpt", "olmo", "jais", "trillion",
        "granite-docling")),
    "qwen2": (PreRule((_QWEN2,)), (
        "qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2")),
    "qwen35": (PreRule((_QWEN35,)), ("qwen35",)),
    "poro": (PreRule((_POOR,)), ("poro-chat", "bloom", "gpt3-finnish")),
    "chatglm4": (PreRule((_LLAMA3,)), ("chatglm-bpe",)),
    "glm4": (PreRule((_LLAMA3,), ignore_merges=True), ("glm4", "glm5")),
    "viking": (PreRule((_POOR, r"\p{N}")), ("viking",)),
    "tekken": (PreRule((_TEKKEN,), ignore_merges=True, add_bos=True), ("tekken",)),
    "chameleon": (PreRule(_CHAMELEON, add_bos=True), ("chameleon",)),
    "gpt4o": (PreRule((_GPT4O,)), ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")),
    "granite-emb-multi": (PreRule((_GRANITE_MULTI,), ignore_merges=True), ("granite-embed-multi-97m",)),
    "bailingmoe": (PreRule((_BAILING,)), ("bailingmoe", "bailingmoe2", "llada-moe")),
    "seed-coder": (PreRule((_SEED_CODER,)), ("seed-coder",)),
    "ufakzeka": (PreRule((_UFAKZEKA,)), ("ufakzeka",)),
    "laguna": (PreRule((r"[^\n]+|[\n]+", _QWEN2)), ("laguna",)),
    "exaone-moe": (PreRule((_EXAONE_MOE,)), ("exaone-moe",)),
    "minicpm5": (PreRule(_MINICPM5, ignore_merges=True), ("minicpm5",)),
}
# tokenizer.ggml.pre -> rule; an absent name means "default", as in llama.cpp
PRE_RULES: dict[str, PreRule] = {name: rule for rule, names in _TYPES.values() for name in names}


def pre_tokenizer(rule: PreRule, byte_level: bool = True) -> Any:
    """The ``tokenizers`` pre-tokenizer that splits like llama.cpp and (unless not ``byte_level``) byte-encodes."""
    from tokenizers import Regex, pre_tokenizers

    steps = [pre_tokenizers.Split(Regex(rx), behavior="isolated", invert=False) for rx in rule.regexes]
    if byte_level:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
