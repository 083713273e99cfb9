"""GGUF weights repacked as llama.cpp's CPU backend repacks them (model/gguf/ggml_repack.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from test_packed import _blocks

from sangama_p2p.model.gguf import ggml_kernels
from sangama_p2p.model.gguf.ggml_kernels import GgmlExperts, GgmlWeight, binding, ggml_weight
from sangama_p2p.model.gguf.ggml_repack import REPACK_ENV, repack_buffer_type
from sangama_p2p.model.gguf.quants import QType, QuantTensor

pytestmark = pytest.mark.skipif(binding() is None or repack_buffer_type(binding()) is None,
                                reason="ggml-python is not installed, failed its probe, or has no CPU_REPACK")


@pytest.fixture(autouse=True)
def _every_type(monkeypatch) -> None:
    monkeypatch.setenv(ggml_kernels.KERNELS_ENV, "ggml")


def _weight(qtype: int, rows: int, cols: int, seed: int = 0, reread: bool = False) -> GgmlWeight:
    blocks = torch.from_numpy(_blocks(qtype, rows, cols, seed=seed))
    w = ggml_weight(QuantTensor(qtype, blocks.clone(), cols, reread=(lambda: blocks) if reread else None))
    assert isinstance(w, GgmlWeight)
    return w


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal to float32 rounding: the same integer dot products, summed in another order."""
    assert float((got - want).abs().max()) <= 1e-5 * float(want.abs().max())


@pytest.mark.parametrize("qtype", [QType.Q4_K, QType.Q4_0], ids=["Q4_K", "Q4_0"])
def test_a_repacked_weight_multiplies_as_the_stored_one(qtype: int, monkeypatch) -> None:
    """ggml's repacked layout and kernels give the stored blocks' products, one row and many; a weight whose blocks
    were a copy of the file's rows drops them and reads them again to dequantize."""
    w = _weight(qtype, 64, 512, reread=True)
    w.settle()
    assert w._packed and w.blocks.is_meta and w.nbytes == 64 * w.lib.ggml_row_size(qtype, 512)
    x = torch.randn(21, 512, generator=torch.Generator().manual_seed(1))
    monkeypatch.setenv(REPACK_ENV, "0")
    stored = _weight(qtype, 64, 512)
    want = stored.product(x)
    assert stored._packed is False and not stored.blocks.is_meta
    _close(w.product(x), want)
    _close(w.product(x[:1]), want[:1])
    assert torch.equal(w.dequantize(), stored.dequantize())


def test_a_joined_weight_is_repacked_part_by_part_without_a_copy() -> None:
    """q/k/v-like parts joined: one repacked buffer, no joined copy of their blocks; the parts' copies of the file's
    rows are dropped (read again to dequantize); its products are the parts' side by side."""
    parts = [_weight(QType.Q4_K, r, 256, seed=r, reread=r == 8) for r in (32, 8, 40)]
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    want = torch.cat([p.product(x) for p in parts], dim=1)  # (repacks each part for itself: not what a stage does)
    parts = [_weight(QType.Q4_K, r, 256, seed=r, reread=r == 8) for r in (32, 8, 40)]
    dense = torch.cat([p.dequantize() for p in parts])
    one = GgmlWeight.concat(parts)
    assert one is not None and one.blocks.is_meta and one.shape == (80, 256)
    assert one.nbytes == sum(p.nbytes for p in parts)
    assert [p.blocks.is_meta for p in parts] == [False, True, False] and all(p._packed is False for p in parts)
    assert torch.equal(one.product(x), want)
    assert torch.equal(one.dequantize(), dense)


def test_what_ggml_does_not_repack_keeps_its_blocks() -> None:
    """Types without a repacked layout here (Q6_K, Q8_0), and rows that are not whole groups of 8, are multiplied as
    stored; a join of them is a copy of their blocks, as before."""
    for w in (_weight(QType.Q6_K, 64, 256), _weight(QType.Q8_0, 64, 256), _weight(QType.Q4_K, 12, 256)):
        w.product(torch.randn(2, 256))
        assert w._packed is False and not w.blocks.is_meta
    odd = GgmlWeight.concat([_weight(QType.Q4_K, 12, 256), _weight(QType.Q4_K, 20, 256, seed=1)])
    assert odd is not None and not odd.blocks.is_meta and odd.blocks.shape[0] == 32


def _experts(qtype: int, down_type: int, num: int, inter: int, hidden: int) -> GgmlExperts:
    def stack(t: int, rows: int, cols: int, seed: int) -> list[GgmlWeight]:
        blocks = torch.from_numpy(_blocks(t, num * rows, cols, seed=seed)).reshape(num, rows, -1)
        return [GgmlWeight(blocks[e], t, cols) for e in range(num)]

    grouped = GgmlExperts.build(stack(qtype, inter, hidden, 1), stack(qtype, inter, hidden, 2),
                                stack(down_type, hidden, inter, 3))
    assert grouped is not None
    return grouped


def test_experts_are_repacked_into_one_stack_per_projection(monkeypatch) -> None:
    """A MoE layer's Q4_K gate and up experts become one repacked 3-D tensor each (its Q8_0 down stays as stored);
    the grouped product - one row and a batch, each row through its own experts - equals the stored experts'."""
    gen = torch.Generator().manual_seed(5)
    x, top_i, top_w = torch.randn(7, 256, generator=gen), torch.randint(0, 6, (7, 2), generator=gen), torch.rand(7, 2)
    monkeypatch.setenv(REPACK_ENV, "0")
    stored = _experts(QType.Q4_K, QType.Q8_0, 6, 64, 256)
    assert stored.packed == [None, None, None]
    want = stored(x, top_i, top_w)
    monkeypatch.setenv(REPACK_ENV, "1")
    grouped = _experts(QType.Q4_K, QType.Q8_0, 6, 64, 256)
    assert grouped.packed[0] is not None and grouped.packed[1] is not None and grouped.packed[2] is None
    assert all(w._packed is False for w in grouped.weights())
    _close(grouped(x, top_i, top_w), want)
    _close(grouped(x[:1], top_i[:1], top_w[:1]), want[:1])


def test_graphs_built_at_once_in_threads_repack_a_weight_once(monkeypatch) -> None:
    """Graphs of different owners (the weight's own product, a layer's graph) built at once in several threads, for a
    weight a stage did not settle at load, repack it once: a second repacking would free the buffer that a graph
    built first multiplies."""
    w = _weight(QType.Q4_K, 256, 512)
    lib, calls = w.lib, []
    repack = GgmlWeight._repack

    def counted(self, *args, **kw):
        calls.append(1)
        time.sleep(0.05)  # a slow repacking: the other threads reach their graph meanwhile
        return repack(self, *args, **kw)

    monkeypatch.setattr(GgmlWeight, "_repack", counted)
    start, data = threading.Barrier(4), []

    def build() -> None:
        ctx = lib.ggml_init(lib.ggml_init_params(mem_size=lib.ggml_tensor_overhead() * 4, mem_buffer=None,
                                                 no_alloc=True))
        try:
            start.wait()
            data.append(w.tensor(ctx).contents.data)
        finally:
            lib.ggml_free(ctx)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and w._packed and len(data) == 4 and len(set(data)) == 1
