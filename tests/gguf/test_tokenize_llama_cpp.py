"""The GGUF tokenizer against llama.cpp's own output on a stress text set (``data/tokenize_stress.json``).

The references come from ``data/make_tokenize_refs.py`` (llama.cpp's ``unicode_regex_split`` and ``llama-tokenize``);
see its docstring to regenerate them. Pieces and the small vocabularies need no model file; the real files are
checked when present.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import unicodedata
from pathlib import Path

import pytest
from helpers import LLAMA_F16, QWEN_F32

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.gguf.pretokenize import PRE_RULES, pre_tokenizer
from sangama_p2p.model.gguf.reader import read_metadata
from sangama_p2p.model.gguf.tokenizer import spm_merges, tokenizer_from_gguf, tokenizer_from_metadata

DATA = Path(__file__).parent / "data"
REFS = json.loads((DATA / "tokenize_stress.json").read_text(encoding="utf-8"))
VOCABS = json.loads((DATA / "tokenize_vocabs.json").read_text(encoding="utf-8"))
TEXTS: list[str] = REFS["texts"]

_spec = importlib.util.spec_from_file_location("make_tokenize_refs", DATA / "make_tokenize_refs.py")
make_refs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_refs)


def test_stored_texts_are_the_generators() -> None:
    assert TEXTS == make_refs.STRESS, "tokenize_stress.json is stale: rerun data/make_tokenize_refs.py"


def test_every_llama_cpp_name_is_covered_with_its_flags() -> None:
    names = REFS["names"]
    assert set(PRE_RULES) == set(names) - make_refs.NOT_SUPPORTED
    for name, rule in PRE_RULES.items():
        assert (rule.ignore_merges, rule.add_bos) == (names[name]["ignore_merges"], names[name]["add_bos"]), name


@pytest.mark.parametrize("name", sorted(PRE_RULES))
def test_pieces_equal_llama_cpp_regex_split(name: str) -> None:
    """The vocabulary-independent part: each rule's regex sequence cuts every text where llama.cpp does."""
    split = pre_tokenizer(PRE_RULES[name], byte_level=False)
    expected = REFS["splits"][REFS["names"][name]["type"]]
    for text, pieces in zip(TEXTS, expected):
        assert [p for p, _ in split.pre_tokenize_str(text)] == pieces, (name, text)


def test_smollm_splits_digits_first() -> None:
    """The case a single combined regex got wrong: digits are cut out before the GPT-2 rule sees the spaces."""
    split = pre_tokenizer(PRE_RULES["smollm"], byte_level=False)
    assert [p for p, _ in split.pre_tokenize_str("x  1 and  \n\n  y")] == ["x", "  ", "1", " and", "  \n\n ", " y"]


@pytest.fixture(scope="module")
def bpe_tokenizers():
    cache: dict[str, object] = {}

    def get(pre: str):
        if pre not in cache:
            cache[pre] = tokenizer_from_metadata(make_refs.bpe_fields(VOCABS, pre), f"bpe vocab, pre {pre}")
        return cache[pre]

    return get


@pytest.mark.parametrize("pre", sorted(REFS["pre_ids"]))
def test_ids_equal_llama_tokenize_per_pre_name(bpe_tokenizers, pre: str) -> None:
    tok = bpe_tokenizers(pre)
    for text, ids in zip(TEXTS, REFS["pre_ids"][pre]):
        assert tok.encode(text).ids == ids, (pre, text)


@pytest.mark.parametrize("variant", sorted(REFS["bpe_variant_ids"]))
def test_bpe_flag_variants_equal_llama_tokenize(variant: str) -> None:
    tok = tokenizer_from_metadata(make_refs.bpe_variant_fields(VOCABS, variant), variant)
    for text, ids in zip(TEXTS, REFS["bpe_variant_ids"][variant]):
        assert tok.encode(text).ids == ids, (variant, text)


@pytest.mark.parametrize("variant", sorted(REFS["spm_ids"]))
def test_sentencepiece_ids_equal_llama_tokenize(variant: str) -> None:
    tok = tokenizer_from_metadata(make_refs.spm_fields(VOCABS, variant), f"spm vocab {variant}")
    for text, ids in zip(TEXTS, REFS["spm_ids"][variant]):
        assert tok.encode(text).ids == ids, (variant, text)


def test_real_sentencepiece_vocabulary_ids_equal_llama_tokenize() -> None:
    """Mistral 7B v0.1's 32000-piece vocabulary (scores, byte tokens, <unk>/<s>/</s>) with llama.cpp's defaults."""
    ref = REFS["real_spm_ids"]
    with gzip.open(DATA / "spm_real_vocab.json.gz", "rt", encoding="utf-8") as fh:
        vocab = json.load(fh)
    assert vocab["source"] == ref["source"] and len(vocab["tokens"]) == 32000
    tok = tokenizer_from_metadata(make_refs.spm_fields({"spm": vocab}, "defaults"), ref["source"])
    for text, ids in zip(TEXTS, ref["ids"]):
        assert tok.encode(text).ids == ids, text


def test_sentencepiece_decodes_back_and_bytes_fall_back() -> None:
    tok = tokenizer_from_metadata(make_refs.spm_fields(VOCABS, "defaults"), "spm vocab")
    for text in TEXTS:
        if "<" not in text:  # a text piece after a special token gets its own leading space
            assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
    ids = tok.encode("漢", add_special_tokens=False).ids  # not in the vocabulary: its three UTF-8 bytes
    assert [tok.id_to_token(i) for i in ids] == ["\u2581", "<0xE6>", "<0xBC>", "<0xA2>"]


def test_spm_merges_rank_by_score() -> None:
    tokens, scores = ["a", "b", "c", "ab", "bc", "abc"], [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    assert spm_merges(tokens, scores) == [("b", "c"), ("a", "b"), ("a", "bc"), ("ab", "c")]


def _file_case(key: str, path: Path) -> None:
    ref = REFS["file_ids"].get(key)
    if ref is None:
        pytest.skip(f"tokenize_stress.json has no ids for {key}")
    assert path.name == ref["file"]
    tok = tokenizer_from_gguf(read_metadata(path))
    for text, ids in zip(TEXTS, ref["ids"]):
        assert tok.encode(text).ids == ids, (key, text)


def test_smollm2_file(smollm2_gguf: Path) -> None:
    _file_case("smollm2", smollm2_gguf)


@pytest.mark.parametrize("key, path", [("llama-h32", LLAMA_F16), ("qwen35moe-h16", QWEN_F32)])
def test_fixture_files(key: str, path: Path) -> None:
    if not path.is_file():
        pytest.skip(f"GGUF fixture {path} not found")
    _file_case(key, path)


def test_no_unicode_normalization() -> None:
    """llama.cpp applies none (Qwen's tokenizer.json has NFC): a decomposed é stays two code points."""
    tok = tokenizer_from_metadata(make_refs.bpe_fields(VOCABS, "qwen35"), "bpe vocab")
    text = "e\u0301"
    assert tok.decode(tok.encode(text).ids) == text != unicodedata.normalize("NFC", text)


def test_unknown_names_list_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError, match=r"pre-tokenizer 'kimi-k2' is not supported \(supported: .*smollm"):
        tokenizer_from_metadata(make_refs.bpe_fields(VOCABS, "kimi-k2"))
    with pytest.raises(UnsupportedModelError, match=r"model 'bert' is not supported \(supported: gpt2, llama\)"):
        tokenizer_from_metadata({**make_refs.bpe_fields(VOCABS, "gpt-2"), "tokenizer.ggml.model": "bert"})
