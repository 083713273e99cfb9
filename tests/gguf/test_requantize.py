"""GGUF -> GGUF re-quantization: bit-exact round trips, llama-quantize's mix and its bytes for every tensor, gguf-py
reads the output."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import LLAMA_F16, SMOLLM2_Q4_1

from sangama_p2p.errors import CheckpointError, UnsupportedModelError
from sangama_p2p.model.gguf.quants import dequantize_rows, row_bytes
from sangama_p2p.model.gguf.reader import GGUFFile
from sangama_p2p.model.gguf.requantize import requantize_gguf

SMOL = SMOLLM2_Q4_1
LQ_REF = json.loads((Path(__file__).parent / "data" / "smollm2-llama-quantize.json").read_text())
needs_smol = pytest.mark.skipif(not SMOL.is_file(), reason=f"{SMOLLM2_Q4_1} is absent: run .ci/fetch-models")
# sha256 of our outputs (numpy 2.4.6, torch 2.13.0 CPU); a change here means the written bytes changed
SHA256 = {
    "F16": "fea43f3ffef83a020894679eb91b2ab0127287d657a7313b47ba9c411dd4d47f",
    "Q8_0": "0c1d3326cd9793cfb7296113c063dd5c24e2bd734b48ec1a3d01b7158eca9387",
    "Q4_K_M": "da968877e487912744f2c999dd292001ec4135dbad38bcac528f7c81f157a756",
}


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_f16_fixture_round_trip_is_bit_exact(tmp_path: Path) -> None:
    out = tmp_path / "rt.gguf"
    report = requantize_gguf(LLAMA_F16, out, "F16")
    assert out.read_bytes() == LLAMA_F16.read_bytes()
    assert report.types == {"F16": 30, "F32": 9} and report.nbytes == LLAMA_F16.stat().st_size


def test_metadata_kept_except_file_type(tmp_path: Path) -> None:
    out = tmp_path / "q8.gguf"
    requantize_gguf(LLAMA_F16, out, "Q8_0")
    a, b = GGUFFile(LLAMA_F16), GGUFFile(out)
    assert list(a.metadata) == list(b.metadata)
    assert {k: v for k, v in a.metadata.items() if k != "general.file_type"} == {
        k: v for k, v in b.metadata.items() if k != "general.file_type"
    }
    assert b.metadata["general.file_type"] == 7
    assert list(a.tensors) == list(b.tensors)


def _check_against_llama_quantize(out: Path, preset: str) -> None:
    ref = LQ_REF["presets"][preset]
    f = GGUFFile(out)
    assert {n: i.type_name for n, i in f.tensors.items()} == {n: t for n, (t, _) in ref.items()}
    for name, (_, digest) in ref.items():  # every tensor, K-quants included, holds llama-quantize's bytes
        assert hashlib.sha256(f.raw(name).tobytes()).hexdigest()[:16] == digest, name


def _check_gguf_py_reads(out: Path, names: int = 40) -> None:
    """gguf-py's own reader opens the file; its dequantized tensors equal ours (one tensor of each kind)."""
    reader = gguf.GGUFReader(out)
    ours = GGUFFile(out)
    assert [t.name for t in reader.tensors] == list(ours.tensors)
    for t in reader.tensors[:names]:
        info = ours.tensors[t.name]
        theirs = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(info.shape)
        raw = ours.view(t.name)
        if info.is_quantized:
            mine = dequantize_rows(info.qtype, raw.reshape(-1, row_bytes(info.qtype, info.shape[-1])), info.shape[-1])
        else:
            mine = raw.to(torch.float32)
        assert np.array_equal(mine.reshape(info.shape).numpy(), theirs.astype(np.float32)), t.name


@needs_smol
def test_smollm2_q4_k_m(tmp_path: Path) -> None:
    assert _sha(SMOL) == LQ_REF["source_sha256"]
    out = tmp_path / "smollm2-Q4_K_M.gguf"
    report = requantize_gguf(SMOL, out, "Q4_K_M")
    assert report.types == {"F32": 61, "Q4_K": 16, "Q5_0": 166, "Q6_K": 14, "Q8_0": 15}
    _check_against_llama_quantize(out, "Q4_K_M")
    _check_gguf_py_reads(out)
    assert _sha(out) == SHA256["Q4_K_M"]


@needs_smol
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["F16", "Q8_0"])
def test_smollm2_f16_and_q8_0_equal_llama_quantize(tmp_path: Path, preset: str) -> None:
    out = tmp_path / f"smollm2-{preset}.gguf"
    requantize_gguf(SMOL, out, preset)
    _check_against_llama_quantize(out, preset)
    _check_gguf_py_reads(out, names=12)
    assert _sha(out) == SHA256[preset]


def test_deterministic(tmp_path: Path) -> None:
    """Two runs give the same bytes (Q4_K_M of the fixture: Q4_K, Q6_K, Q5_0 and Q8_0 tensors)."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    ra = requantize_gguf(LLAMA_F16, a, "Q4_K_M")
    requantize_gguf(LLAMA_F16, b, "Q4_K_M")
    assert ra.types == {"F32": 9, "Q4_K": 2, "Q5_0": 23, "Q6_K": 2, "Q8_0": 3}
    assert a.read_bytes() == b.read_bytes()


def test_errors(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="preset 'Q4_K_S'"):
        requantize_gguf(LLAMA_F16, tmp_path / "x.gguf", "Q4_K_S")
    with pytest.raises(CheckpointError, match="onto itself"):
        requantize_gguf(LLAMA_F16, LLAMA_F16, "F16")
    with pytest.raises(CheckpointError, match="no GGUF file"):
        requantize_gguf(tmp_path / "missing.gguf", tmp_path / "x.gguf", "F16")
    assert not (tmp_path / "x.gguf").exists()


def test_failed_write_leaves_no_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A destination that cannot be created is a typed error; a failure while writing the tensors leaves neither
    DST nor its .part file behind."""
    with pytest.raises(CheckpointError, match="cannot write"):
        requantize_gguf(LLAMA_F16, tmp_path / "no" / "dir" / "x.gguf", "Q8_0")
    import sangama_p2p.model.gguf.requantize as rq

    def fail(x: np.ndarray, qtype: int) -> np.ndarray:
        raise UnsupportedModelError("cannot quantize (test)")

    monkeypatch.setattr(rq, "_encode", fail)
    with pytest.raises(UnsupportedModelError, match="test"):
        requantize_gguf(LLAMA_F16, tmp_path / "x.gguf", "Q8_0")
    assert list(tmp_path.iterdir()) == []
