"""Whole blocks of a decode step as one ggml graph each (model/gguf/ggml_layer.py): a Gated DeltaNet's one-token
step and a MoE layer, against the torch path they replace."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from sangama_p2p.model.gguf import ggml_kernels, open_gguf, write_gguf
from sangama_p2p.model.gguf.ggml_kernels import binding
from sangama_p2p.model.gguf.ggml_layer import DeltaNetStep, LayerStep, MoEStep, rec_region
from sangama_p2p.model.linear import MIN_ROWS
from sangama_p2p.model.make import make_model
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.model.state import Segment

pytestmark = pytest.mark.skipif(binding() is None, reason="ggml-python is not installed or failed its probe")

# The graphs and the torch path multiply alike (ggml's products, the activations quantized per block the same way);
# the rest differs by the order of float32 sums
REL = 1e-5


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("ggml_layer")
    hf = make_model(tmp / "hf", "qwen3_5_moe", "tiny")
    (path,) = write_gguf(hf, tmp / "m.gguf", "Q4_K")
    return path


def _stage(path: Path, monkeypatch, kernels: str = "auto") -> StageModel:
    monkeypatch.setenv(ggml_kernels.KERNELS_ENV, kernels)
    spec, src, _ = open_gguf(path)
    return StageModel.load(spec, src, 0, spec.num_layers)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return float((a - b).abs().max()) <= REL * max(float(b.abs().max()), 1e-6)


def test_a_deltanet_step_equals_the_torch_path(moe_gguf: Path, monkeypatch) -> None:
    """Output, conv window and recurrent state after one token, from the same state, for every Gated DeltaNet layer
    of a prefilled session (the out-projection's columns as llama.cpp reordered them)."""
    stage = _stage(moe_gguf, monkeypatch)
    spec = stage.spec
    nets = [la.mixer for la in stage.layers.values() if la.kind != "full_attention"]
    assert nets and all(isinstance(n.step, DeltaNetStep) for n in nets)
    # as in real files: the out-projection's columns reordered by the converter, and more value than key heads
    assert all(n.out.in_perm is not None for n in nets) and spec.linear_num_value_heads > spec.linear_num_key_heads
    prompt = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    a, b = stage.new_session(16), stage.new_session(16)
    for s in (a, b):
        stage.forward([StepInput(s, 0, tokens=prompt)])
    x = torch.randn(1, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    for net in nets:
        st_a, st_b = a.layers[net.key], b.layers[net.key]
        assert torch.equal(st_a.rec, st_b.rec) and st_a.rec.abs().sum() > 0
        got = net.forward(x, [Segment(a, 9, 1)])
        step, net.step = net.step, None
        try:
            want = net.forward(x, [Segment(b, 9, 1)])
        finally:
            net.step = step
        assert _close(got, want) and _close(st_a.rec, st_b.rec) and torch.equal(st_a.conv, st_b.conv)


@pytest.mark.parametrize("rows", [1, 5, 70])  # 70: a graph built per call, not kept (the layer's torch path)
def test_a_moe_step_equals_the_torch_path(moe_gguf: Path, monkeypatch, rows: int) -> None:
    stage = _stage(moe_gguf, monkeypatch)
    x = torch.randn(rows, stage.spec.hidden_size, generator=torch.Generator().manual_seed(rows))
    for layer in stage.layers.values():
        moe = layer.ffn
        assert isinstance(moe.step, MoEStep)
        got = moe.step(x)  # (the layer takes it for at most MAX_ROWS rows; it takes any)
        step, moe.step = moe.step, None
        try:
            want = moe.forward(x)
        finally:
            moe.step = step
        assert got.shape == want.shape and _close(got, want)


def test_a_moe_steps_rows_do_not_depend_on_their_batch(moe_gguf: Path, monkeypatch) -> None:
    """Each row is its own router, experts and sums in the graph: the batch-invariant mode keeps it."""
    stage = _stage(moe_gguf, monkeypatch)
    moe = next(iter(stage.layers.values())).ffn
    x = torch.randn(40, stage.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    token = MIN_ROWS.set(8)
    try:
        alone = torch.cat([moe.forward(x[i:i + 1]) for i in range(0, 40, 7)])
        assert torch.equal(moe.forward(x)[::7], alone)
    finally:
        MIN_ROWS.reset(token)


def test_the_whole_layer_graph_takes_one_token_of_one_session_and_nothing_else(moe_gguf: Path, monkeypatch) -> None:
    """Two sessions in one step, a prefill and the batch-invariant mode run the layer's blocks apart (the whole-layer
    graph is not called); one token of one session runs every Gated DeltaNet layer as one graph."""
    stage = _stage(moe_gguf, monkeypatch)
    calls = []
    for layer in stage.layers.values():
        assert isinstance(layer.step, LayerStep) and (layer.step.mixer is None) == (layer.kind == "full_attention")
        layer.step = _Spy(layer.step, calls)
    spec = stage.spec
    ids = torch.randint(0, spec.vocab_size, (6,), generator=torch.Generator().manual_seed(4))
    a, b = stage.new_session(16), stage.new_session(16)
    stage.forward([StepInput(a, 0, tokens=ids), StepInput(b, 0, tokens=ids)])
    assert calls == []  # a prefill
    stage.forward([StepInput(a, 6, tokens=ids[:1]), StepInput(b, 6, tokens=ids[:1])])
    assert calls == []  # two sessions
    stage.min_rows = 16  # the batch-invariant mode
    stage.forward([StepInput(a, 7, tokens=ids[:1])])
    stage.min_rows = 0
    assert calls == []
    stage.forward([StepInput(a, 8, tokens=ids[:1])])
    assert len(calls) == sum(la.kind != "full_attention" for la in stage.layers.values())  # one session, one token


class _Spy:
    """A layer's graphs that count the whole-layer calls."""

    def __init__(self, step: LayerStep, calls: list) -> None:
        self.step, self.calls, self.mixer = step, calls, step.mixer

    def __call__(self, *args):
        self.calls.append(1)
        return self.step(*args)

    def ffn(self, x):
        return self.step.ffn(x)


def test_a_layers_graph_equals_its_blocks_apart(moe_gguf: Path, monkeypatch) -> None:
    """Every layer of a prefilled session, one token: the whole-layer graph (DeltaNet layers) or the graph of its
    FFN half (attention layers) against the same layer with its graphs off, from the same state."""
    stage = _stage(moe_gguf, monkeypatch)
    spec = stage.spec
    prompt = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    a, b = stage.new_session(16), stage.new_session(16)
    for s in (a, b):
        stage.forward([StepInput(s, 0, tokens=prompt)])
    x = torch.randn(1, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    cos, sin = stage.rope_rows([Segment(a, 9, 1)], 1)
    for key, layer in stage.layers.items():
        got = layer.forward(x, [Segment(a, 9, 1)], cos, sin)
        saved = (layer.step, layer.ffn.step, getattr(layer.mixer, "step", None))
        layer.step = layer.ffn.step = None
        if hasattr(layer.mixer, "step"):
            layer.mixer.step = None
        try:
            want = layer.forward(x, [Segment(b, 9, 1)], cos, sin)
        finally:
            layer.step, layer.ffn.step = saved[:2]
            if hasattr(layer.mixer, "step"):
                layer.mixer.step = saved[2]
        assert _close(got, want), layer.kind
        for sa, sb in zip(dataclasses.astuple(a.layers[key]), dataclasses.astuple(b.layers[key])):
            assert sa.numel() == 0 or _close(sa, sb)


def test_a_sessions_state_is_written_in_place_and_a_plain_one_is_copied_back(moe_gguf: Path, monkeypatch) -> None:
    """A session's recurrent state has the scratch that ggml's gated delta rule writes a token's outputs into just
    before it (state.rec_layout), so the whole-layer graph writes the new state in place; a state without it takes
    the graph that copies the new state back. Both give the same output, window and state, bit for bit."""
    stage = _stage(moe_gguf, monkeypatch)
    spec = stage.spec
    prompt = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(0))
    session = stage.new_session(16)
    stage.forward([StepInput(session, 0, tokens=prompt)])
    x = torch.randn(1, spec.hidden_size, generator=torch.Generator().manual_seed(1))
    layers = [la for la in stage.layers.values() if la.step is not None and la.step.mixer is not None]
    assert layers
    for layer in layers:
        st = session.layers[layer.mixer.key]
        region = rec_region(st.rec)
        assert region is not None and not region[: region.numel() - st.rec.numel()].any()  # scratch untouched yet
        plain = torch.empty(st.rec.shape[0], st.rec.shape[2], st.rec.shape[1]).transpose(-1, -2).copy_(st.rec)
        assert rec_region(plain) is None
        conv = st.conv.clone()
        got = layer.step(x, st.conv, st.rec)
        want = layer.step(x, conv, plain)
        assert torch.equal(got, want) and torch.equal(st.conv, conv) and torch.equal(st.rec, plain)
        assert region[: region.numel() - st.rec.numel()].any()  # the op's outputs went to the scratch


def test_torchs_kernels_take_no_graphs(moe_gguf: Path, monkeypatch) -> None:
    stage = _stage(moe_gguf, monkeypatch, "torch")
    for layer in stage.layers.values():
        assert layer.step is None and layer.ffn.step is None and getattr(layer.mixer, "step", None) is None
