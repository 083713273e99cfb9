"""Bad GGUF input raises typed errors with clear messages."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import LLAMA_Q4KM

from sangama_p2p.errors import CheckpointError, UnsupportedModelError
from sangama_p2p.model.gguf import open_gguf
from sangama_p2p.model.gguf.reader import GGUFFile


def _write(path: Path, arch: str, tensors: dict[str, tuple[np.ndarray, object]], meta: dict | None = None) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for k, v in (meta or {}).items():
        if isinstance(v, int):
            w.add_uint32(k, v)
        else:
            w.add_string(k, v)
    for name, (arr, raw) in tensors.items():
        w.add_tensor(name, arr, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unknown_architecture(tmp_path: Path) -> None:
    p = _write(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(UnsupportedModelError, match="architecture 'gpt2'"):
        open_gguf(p)


def test_unsupported_quant_type(tmp_path: Path) -> None:
    """One error naming the type once by its ggml name, one tensor, how many more share it, and what we read."""
    blocks = np.zeros((2, 66), np.uint8)  # two rows of one IQ2_XXS block each
    iq2 = gguf.GGMLQuantizationType.IQ2_XXS
    tensors = {f"blk.{i}.ffn_up.weight": (blocks, iq2) for i in range(3)}
    tensors["blk.0.attn_norm.weight"] = (np.ones(256, np.float32), None)
    p = _write(tmp_path / "iq.gguf", "llama", tensors)
    with pytest.raises(UnsupportedModelError) as info:
        GGUFFile(p)
    msg = str(info.value)
    assert msg.startswith(
        "IQ2_XXS is not supported (the GGML type of tensor blk.0.ffn_up.weight and 2 more in iq.gguf); supported: "
    )
    assert msg.count("IQ2_XXS") == 1 and "ggml type" not in msg
    assert msg.endswith("F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, BF16")


def test_missing_metadata(tmp_path: Path) -> None:
    p = _write(tmp_path / "bare.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    with pytest.raises(CheckpointError, match="embedding_length"):
        open_gguf(p)


def test_bad_magic_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "junk.gguf"
    p.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GGUFFile(p)
    with pytest.raises(CheckpointError, match="no GGUF file"):
        GGUFFile(tmp_path / "absent.gguf")


@pytest.mark.skipif(not LLAMA_Q4KM.is_file(), reason="GGUF fixtures not found")
@pytest.mark.parametrize("keep", [1000, 5_000_000, 15_080_000])
def test_truncated_file(tmp_path: Path, keep: int) -> None:
    """Cut in the header, in the vocabulary, and in the last tensor."""
    p = tmp_path / "cut.gguf"
    with open(LLAMA_Q4KM, "rb") as src, open(p, "wb") as dst:
        dst.write(src.read(keep))
    with pytest.raises(CheckpointError, match="truncated"):
        GGUFFile(p)


@pytest.mark.skipif(not LLAMA_Q4KM.is_file(), reason="GGUF fixtures not found")
def test_missing_split_part_and_missing_tensor(tmp_path: Path) -> None:
    shutil.copy(LLAMA_Q4KM, tmp_path / "m-00001-of-00002.gguf")
    with pytest.raises(CheckpointError, match="missing m-00002-of-00002.gguf"):
        GGUFFile(tmp_path / "m-00001-of-00002.gguf")
    spec, src, _ = open_gguf(LLAMA_Q4KM)
    with pytest.raises(CheckpointError, match="lacks tensor model.layers.9"):
        src.get("model.layers.9.mlp.up_proj.weight", torch.float32)
    assert not src.has("model.layers.9.mlp.up_proj.weight")


def test_metadata_disagreeing_with_tensors(tmp_path: Path) -> None:
    meta = {"llama.embedding_length": 16, "llama.attention.head_count": 2, "llama.block_count": 1,
            "llama.feed_forward_length": 32}
    w = gguf.GGUFWriter(tmp_path / "bad.gguf", "llama")
    for k, v in meta.items():
        w.add_uint32(k, v)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tensor("token_embd.weight", np.zeros((10, 8), np.float32))  # hidden 8, metadata says 16
    w.add_tensor("blk.0.attn_norm.weight", np.ones(16, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="token_embd.weight has shape"):
        open_gguf(tmp_path / "bad.gguf")


def test_tokenizer_optional_and_unsupported_kinds(tmp_path: Path) -> None:
    from sangama_p2p.model.gguf.tokenizer import tokenizer_from_gguf

    p = _write(tmp_path / "t.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)})
    assert tokenizer_from_gguf(GGUFFile(p)) is None
    p = _write(tmp_path / "spm.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)},
               {"tokenizer.ggml.model": "t5"})
    with pytest.raises(UnsupportedModelError, match=r"model 't5' is not supported \(supported: gpt2, llama\)"):
        tokenizer_from_gguf(GGUFFile(p))
    p = _write(tmp_path / "pre.gguf", "llama", {"token_embd.weight": (np.zeros((4, 8), np.float32), None)},
               {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "no-such"})
    with pytest.raises(UnsupportedModelError, match=r"pre-tokenizer 'no-such' is not supported \(supported: .*smollm"):
        tokenizer_from_gguf(GGUFFile(p))


def test_large_arrays_are_parsed_when_first_asked_for(tmp_path: Path) -> None:
    """Arrays of 4096 elements or more (vocabularies) are checked and skipped at open, and become the same lists on
    first access; a vocabulary whose bytes are not UTF-8 is a CheckpointError then, not at open."""
    from sangama_p2p.model.gguf.reader import _LazyArray

    tokens = [f"tok{i}" for i in range(5000)]
    numbers = list(range(5000))
    p = tmp_path / "big.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("x.numbers", numbers)
    w.add_array("x.small", [1, 2, 3])
    w.add_tensor("t", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta = GGUFFile(p).metadata
    assert isinstance(dict.__getitem__(meta, "tokenizer.ggml.tokens"), _LazyArray)
    assert dict.__getitem__(meta, "x.small") == [1, 2, 3]  # small arrays as before
    assert meta["tokenizer.ggml.tokens"] == tokens and meta.get("x.numbers") == numbers
    assert dict.__getitem__(meta, "x.numbers") == numbers  # kept once parsed
    bad = tmp_path / "bad.gguf"
    raw = bytearray(p.read_bytes())
    at = raw.find(b"tok4999")
    raw[at : at + 3] = b"\xff\xfe\xfd"
    bad.write_bytes(bytes(raw))
    meta = GGUFFile(bad).metadata
    with pytest.raises(CheckpointError, match="UTF-8"):
        meta["tokenizer.ggml.tokens"]
