"""Repacking a chunk of rows at a time (bounded temporaries) and dropping the mapped pages of what was packed."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from sangama_p2p.model.gguf import packed
from sangama_p2p.model.gguf.quantizer import quantize
from sangama_p2p.model.gguf.quants import QType, QuantTensor
from sangama_p2p.model.gguf.reader import GGUFFile


def _quant(qtype: int, rows: int, cols: int) -> QuantTensor:
    w = np.random.default_rng(3).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return QuantTensor(qtype, torch.from_numpy(quantize(w, qtype)), cols)


@pytest.mark.parametrize("qtype,rows,cols", [(QType.Q8_0, 200, 576), (QType.Q4_K, 100, 512), (QType.Q5_0, 130, 64),
                                             (QType.Q4_0, 300, 96)])
def test_chunked_packing_equals_one_chunk(monkeypatch: pytest.MonkeyPatch, qtype: int, rows: int, cols: int) -> None:
    """Chunks of 64 rows (the last one padded) give the same bytes as one chunk of all rows, and every block is
    handed to ``release`` exactly once, after it was packed."""
    qt = _quant(qtype, rows, cols)
    whole = packed.pack_int4(qt)
    monkeypatch.setattr(packed, "_TEMP_BYTES", 1)
    assert packed.chunk_rows(cols, 2) == 64
    released: list[torch.Tensor] = []
    chunked = packed.pack_int4(qt, released.append)
    assert torch.equal(chunked.packed, whole.packed)
    assert torch.equal(chunked.scales_zeros, whole.scales_zeros)
    assert len(released) == -(-rows // 64)
    assert torch.equal(torch.cat(released), qt.data)


def test_chunk_rows_bound_the_temporaries() -> None:
    for k, planes in [(576, 1), (576, 2), (1536, 2), (8192, 2), (49152, 1)]:
        rows = packed.chunk_rows(k, planes)
        assert rows % 64 == 0
        assert rows == 64 or 32 * rows * k * planes <= packed._TEMP_BYTES


def _smaps_rss(path: Path) -> int:
    """Resident bytes of this process's mappings of ``path``."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_release_view_drops_mapped_pages_and_leaves_owned_memory(tmp_path: Path) -> None:
    path = tmp_path / "one.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = quantize(np.random.default_rng(0).standard_normal((512, 1024)).astype(np.float32), QType.Q8_0)
    writer.add_tensor("big", blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = GGUFFile(path)
    view = f.view("big")
    expect = view.clone()
    assert int(view.sum()) == int(expect.sum())  # every page faulted in
    before = _smaps_rss(path)
    assert before >= view.numel()
    f.release_view(view[: view.shape[0] // 2])
    half = _smaps_rss(path)
    assert before - half >= view.numel() // 2 - 2 * 4096  # the pages wholly inside the first half
    assert half >= view.numel() // 2 - 4096  # ... and not the others
    assert torch.equal(view, expect)  # read again: faulted back in from the file
    owned = f.read("big")
    f.release_view(owned)  # not a view of the map: left alone (dropping anonymous pages would zero them)
    assert torch.equal(owned, expect)
    f.close()


@pytest.mark.parametrize("rows", [15, 16, 512])
def test_fp16_weight_times_many_rows_is_an_fp32_product(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    """16 rows or more (prefill) multiply the exactly upcast fp16 weight in fp32, 64 of its rows at a time here;
    fewer stay an fp16 product (the activations rounded to fp16: ~1e-3 relative)."""
    monkeypatch.setattr(packed, "_TEMP_BYTES", 1)
    w = (torch.randn(200, 96, generator=torch.Generator().manual_seed(0)) * 0.05).half()
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(1)) * 3
    ref = x.double() @ w.double().t()
    got = packed.FloatLinear(w).linear(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 200)
    err = float((got.double() - ref).abs().max() / ref.abs().max())
    assert err < (1e-6 if rows >= 16 else 3e-3), err
    if rows < 16:
        assert err > 1e-5  # the fp16 product really is a different path
