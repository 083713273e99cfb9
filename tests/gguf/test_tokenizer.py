"""The tokenizer rebuilt from GGUF metadata encodes like the checkpoint's own tokenizer.json."""

from __future__ import annotations

import unicodedata

import pytest
from helpers import LLAMA_F16, QWEN_DIR, QWEN_Q4KM
from tokenizers import Tokenizer

from sangama_p2p.model.gguf.reader import GGUFFile
from sangama_p2p.model.gguf.tokenizer import tokenizer_from_gguf

pytestmark = pytest.mark.skipif(not QWEN_Q4KM.is_file(), reason="GGUF fixtures not found")

TEXTS = [
    "Hello world!",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "Привет, мир! Ünïcödé façade naïve café",
    "日本語のテキストと中文混合 123456789 3.14159",
    "emoji 🤖🚀 and combining e\u0301 (NFC) and ﬁ ligature",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "code: def f(x):\n    return x**2  # don't\r\n",
]


@pytest.fixture(scope="module")
def qwen_pair():
    return tokenizer_from_gguf(GGUFFile(QWEN_Q4KM)), Tokenizer.from_file(str(QWEN_DIR / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_qwen_ids_equal_tokenizer_json(qwen_pair, text: str) -> None:
    """Equal up to the NFC normalizer of tokenizer.json, which llama.cpp (and so the GGUF tokenizer) does not apply."""
    ours, theirs = qwen_pair
    assert ours.encode(unicodedata.normalize("NFC", text)).ids == theirs.encode(text).ids
    assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text  # byte-level: exact round trip


def test_qwen_vocabulary_and_specials(qwen_pair) -> None:
    ours, theirs = qwen_pair
    assert ours.get_vocab_size() == theirs.get_vocab_size() == 248077
    assert ours.token_to_id("<|im_end|>") == 248046
    assert ours.encode("<|im_end|>").ids == [248046]


def test_llama_adds_bos_and_round_trips() -> None:
    tok = tokenizer_from_gguf(GGUFFile(LLAMA_F16))
    ids = tok.encode("Hello world, ça va? 123456").ids
    assert ids[0] == 128000 and 128000 not in ids[1:]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world, ça va? 123456"
    # llama-3 splits digits in groups of three
    assert len(tok.encode("123456", add_special_tokens=False).ids) == 2
