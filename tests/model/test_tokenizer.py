"""The byte-level BPE and the Tokenizer wrapper: exact round trips, agreement with transformers, typed errors."""

from __future__ import annotations

import json
import subprocess
import sys
import unicodedata
from pathlib import Path

import pytest
import tokenizers
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import pre_tokenizers

from sangama_p2p.errors import CheckpointError, ModelError
from sangama_p2p.model.tokenizer import (
    EOS_TOKEN,
    PAD_TOKEN,
    IncrementalDecoder,
    SPECIAL_TOKENS,
    Tokenizer,
    corpus_text,
    train_bpe,
    write_tokenizer_files,
)

TRICKY = [
    "",
    " ",
    "  leading and trailing  ",
    "emoji 🎉👨‍👩‍👧‍👦 and flags 🇮🇳🇯🇵",
    "combining e\u0301\u0301\u0301 a\u0308 \u0301 alone, zalgo t\u0336\u0317e\u0337\u0354",
    "nul \x00 bell \x07 bom \ufeff rtl \u202e mark",
    "crlf\r\nlf\ntab\t end",
    "日本語のテキスト 中文 한국어 العربية",
    "private use \ue000 \U0010fffd and noncharacter \uffff",
    "def f(x):\n    return x ** 2  # comment\n",
]


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(train_bpe(1024), d, model_max_length=4096)
    return d


@pytest.fixture(scope="module")
def tok(checkpoint_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(checkpoint_dir)


@pytest.mark.parametrize("text", TRICKY)
def test_round_trip_tricky_strings(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_round_trip_any_unicode(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet=st.characters(categories=["Mn", "Me", "So", "Cf", "Zs", "Lo"]), max_size=40))
def test_round_trip_combining_and_symbols(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


def test_specials_and_eos(tok: Tokenizer) -> None:
    eos = tok.token_id(EOS_TOKEN)
    assert eos is not None and tok.eos_token_ids == (eos,)
    assert tok.encode(EOS_TOKEN) == [eos]
    assert tok.encode("a" + EOS_TOKEN + "b") == tok.encode("a") + [eos] + tok.encode("b")
    assert tok.decode([eos]) == EOS_TOKEN  # specials are kept, so decode inverts encode
    assert [tok.token_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))


def test_vocab_is_exact_and_holds_all_bytes() -> None:
    for size in (300, 1000, 1024):
        t = train_bpe(size)
        assert t.get_vocab_size(with_added_tokens=True) == size
        vocab = t.get_vocab(with_added_tokens=False)
        assert set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab)


def test_reserved_tokens_fill_a_vocab_the_corpus_cannot_reach() -> None:
    t = Tokenizer(train_bpe(6000))
    assert t.vocab_size == 6000
    last = t.token_id("<|reserved_0|>")
    assert last is not None and t.decode([5999]).startswith("<|reserved_")
    assert t.decode(t.encode("hello world")) == "hello world"


def test_training_is_deterministic_across_processes(checkpoint_dir: Path) -> None:
    code = (
        "import sys; from sangama_p2p.model.tokenizer import train_bpe;"
        "sys.stdout.write(train_bpe(1024).to_str())"
    )
    env = {"PYTHONHASHSEED": "999", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(out.stdout) == json.loads((checkpoint_dir / "tokenizer.json").read_text())


def test_bpe_compresses_english_it_has_not_seen(tok: Tokenizer) -> None:
    text = "The engineer measured the time before changing anything, and wrote the numbers down."
    assert text not in corpus_text()
    assert len(tok.encode(text)) < len(text) / 2.5


def test_auto_tokenizer_gives_the_same_ids(checkpoint_dir: Path, tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    auto = transformers.AutoTokenizer.from_pretrained(checkpoint_dir)
    assert auto.eos_token == EOS_TOKEN and auto.pad_token == PAD_TOKEN
    assert auto.eos_token_id == tok.eos_token_ids[0]
    for text in TRICKY + [corpus_text()[:2000]]:
        assert auto(text)["input_ids"] == tok.encode(text), text
        assert auto.decode(tok.encode(text)) == text


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=60))
def test_auto_tokenizer_agrees_on_any_text(checkpoint_dir: Path, tok: Tokenizer, text: str) -> None:
    pytest.importorskip("transformers")
    auto = _auto(checkpoint_dir)
    assert auto(text)["input_ids"] == tok.encode(text)


_AUTO: dict[Path, object] = {}


def _auto(path: Path):
    import transformers

    if path not in _AUTO:
        _AUTO[path] = transformers.AutoTokenizer.from_pretrained(path)
    return _AUTO[path]


def test_wraps_a_tokenizer_built_elsewhere() -> None:
    """e.g. one rebuilt from GGUF metadata: any tokenizers.Tokenizer with explicit eos ids."""
    vocab = {"<eos>": 0, "a": 1, "b": 2, "ab": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.add_special_tokens(["<eos>"])
    t = Tokenizer(backend, eos_ids=[0])
    assert t.vocab_size == 4 and t.eos_token_ids == (0,)
    assert t.encode("abab") == [3, 3]
    assert t.backend is backend


def test_eos_ids_come_from_config_json(tmp_path: Path) -> None:
    write_tokenizer_files(train_bpe(400), tmp_path, model_max_length=64)
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [1, 3]}, "eos_token_id": 2}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids == (2, 1, 3)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [3]}))
    assert Tokenizer.from_dir(tmp_path).eos_token_ids[0] == 3
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="eos_token_id"):
        Tokenizer.from_dir(tmp_path)


def test_eos_falls_back_to_tokenizer_config(tmp_path: Path) -> None:
    write_tokenizer_files(train_bpe(400), tmp_path, model_max_length=64)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = Tokenizer.from_dir(tmp_path)
    assert t.eos_token_ids == (t.token_id("<|im_end|>"),)


def test_missing_or_corrupt_files_raise_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "Nonsense"}}')
    with pytest.raises(CheckpointError, match="corrupt"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes(b"\xff\x00 not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        Tokenizer.from_dir(tmp_path)
    write_tokenizer_files(train_bpe(400), tmp_path, model_max_length=64)
    (tmp_path / "config.json").write_text("{ truncated")
    with pytest.raises(CheckpointError, match="config.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        Tokenizer.from_dir(tmp_path)


def test_bad_ids_raise_typed_errors(tok: Tokenizer) -> None:
    with pytest.raises(ModelError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])
    with pytest.raises(ModelError, match="outside the vocabulary"):
        tok.decode([-1])
    with pytest.raises(CheckpointError, match="eos token ids"):
        Tokenizer(tok.backend, eos_ids=[tok.vocab_size + 5])
    with pytest.raises(ModelError, match="vocab_size"):
        train_bpe(100)


def _stream(tok: Tokenizer, ids: list[int], chunk: int) -> list[str]:
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return pieces + [dec.flush()]


@pytest.mark.parametrize("text", TRICKY[1:])
def test_incremental_decoder_never_splits_a_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    pieces = _stream(tok, ids, 1)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)  # no partial characters leak out mid-stream


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=1023), max_size=40), st.integers(min_value=1, max_value=4))
def test_incremental_decoder_matches_full_decode_for_any_ids(tok: Tokenizer, ids: list[int], chunk: int) -> None:
    """Random models emit arbitrary ids (invalid UTF-8 included): the stream still equals the full decode."""
    assert "".join(_stream(tok, ids, chunk)) == tok.decode(ids)


def test_incremental_decoder_holds_back_a_partial_character(tok: Tokenizer) -> None:
    dec = IncrementalDecoder(tok)
    assert dec.push(tok.encode("ok ")) == "ok "
    emoji = tok.encode("🎉")  # 4 UTF-8 bytes: several byte tokens, none a full character alone
    assert len(emoji) > 1
    assert dec.push(emoji[:1]) == ""
    assert dec.push(emoji[1:]) == "🎉"
    assert dec.push(emoji[:1]) == "" and dec.flush() == "\ufffd"


QWEN_FIXTURE = Path("/work/shared/fixtures/gguf/qwen35moe-h16")


@pytest.mark.skipif(not (QWEN_FIXTURE / "tokenizer.json").is_file(), reason="Qwen3.5 tokenizer fixture not present")
def test_reads_the_real_qwen_tokenizer() -> None:
    """A tokenizer.json made elsewhere (Qwen3.5's, 248k tokens): eos from config.json, exact round trips."""
    t = Tokenizer.from_dir(QWEN_FIXTURE)
    assert t.vocab_size == 248077 and t.eos_token_ids == (248046,)
    for text in TRICKY:  # Qwen's tokenizer NFC-normalizes first, so only NFC text comes back unchanged
        assert t.decode(t.encode(text)) == unicodedata.normalize("NFC", text)
    assert t.encode("<|im_end|>") == [t.token_id("<|im_end|>")]
    assert "".join(_stream(t, t.encode(TRICKY[3]), 1)) == TRICKY[3]
