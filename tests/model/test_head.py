"""The head's logits in float32 whatever kernel multiplies it (model/head.py): the kernel's rounded product, then
every score that can decide a token recomputed from the stored weight."""

from __future__ import annotations

import pytest
import torch

from sangama_p2p.model.gguf.dense import FloatLinear
from sangama_p2p.model.gguf.packed import pack_int4
from sangama_p2p.model.gguf.quantizer import quantize
from sangama_p2p.model.gguf.quants import QType, QuantTensor
from sangama_p2p.model.head import MAX_EXACT_ROWS, Head

V, D = 512, 256


def _q8_head(seed: int = 0) -> tuple[QuantTensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(V, D, generator=g) * 0.05
    qt = QuantTensor(QType.Q8_0, torch.from_numpy(quantize(w.numpy(), QType.Q8_0)), D)
    return qt, qt.dequantize(torch.float32)


def _near_tie(exact_w: torch.Tensor, a: int, b: int, gap: float, seed: int = 1) -> torch.Tensor:
    """An activation row whose float32 logits of rows ``a`` and ``b`` are the two highest, ``gap`` apart, at ~25 (where
    bfloat16's step is 0.125)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(D, generator=g)
    wa, wb = exact_w[a].double(), exact_w[b].double()
    x = x.double()
    # solve for the two targets along the span of (wa, wb): x + s wa + t wb with <x', wa> = 25 + gap, <x', wb> = 25
    m = torch.stack([torch.stack([wa @ wa, wb @ wa]), torch.stack([wa @ wb, wb @ wb])])
    rhs = torch.stack([25.0 + gap - x @ wa, 25.0 - x @ wb])
    s, t = torch.linalg.solve(m, rhs)
    return (x + s * wa + t * wb).float()[None, :]


def test_a_near_tie_the_int4_kernel_rounds_together_is_decided_in_float32() -> None:
    qt, w = _q8_head()
    packed = pack_int4(qt)
    head = Head.build(packed, qt, torch.float32)
    assert head is not None
    wins = 0
    for seed in range(8):
        x = _near_tie(w, 7, 3, gap=0.01, seed=seed)  # row 7 wins; a tie goes to the lower index
        exact = x @ w.t()
        coarse = packed.product(x)
        assert coarse.dtype == torch.bfloat16  # the kernel's own output: its step at 25 is 0.125
        wins += int(coarse.float().argmax()) == int(exact.argmax())
        got = head.logits(x, coarse)
        assert got.dtype == torch.float32
        assert int(got.argmax()) == int(exact.argmax()) == 7
        top = exact.topk(2).indices[0]
        assert torch.allclose(got[0, top], exact[0, top], rtol=0, atol=1e-4)
    assert wins < 8  # the kernel alone gets some of these wrong (or ties them), which is what the second pass is for


def test_sampled_rows_recompute_everything_within_their_span() -> None:
    qt, w = _q8_head()
    packed = pack_int4(qt)
    head = Head.build(packed, qt, torch.float32)
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(5)) * 20
    exact = x @ w.t()
    got = head.logits(x, packed.product(x), torch.tensor([0.0, 40.0]))
    close = (got - exact).abs() < 1e-4
    near = exact >= exact.amax(-1, keepdim=True) - 35.0  # well inside row 1's span of 40
    assert int(near[1].sum()) > 10 and close[1][near[1]].all()
    assert int(got[0].argmax()) == int(exact[0].argmax())
    assert close[1].sum() > close[0].sum()  # the greedy row recomputed only its contenders


def test_a_row_gets_the_same_logits_alone_and_batched() -> None:
    qt, w = _q8_head()
    packed = pack_int4(qt)
    head = Head.build(packed, qt, torch.float32)
    x = torch.randn(5, D, generator=torch.Generator().manual_seed(9)) * 10
    together = head.logits(x, packed.product(x), torch.tensor([0.0, 2.0, 0.0, 1.0, 0.0]))
    for r, span in enumerate([0.0, 2.0, 0.0, 1.0, 0.0]):
        alone = head.logits(x[r : r + 1], packed.product(x[r : r + 1]), torch.tensor([span]))
        assert torch.equal(alone[0], together[r])


def test_a_sampled_row_with_a_flat_distribution_recomputes_at_most_its_highest_scores() -> None:
    qt, w = _q8_head()
    fl = FloatLinear(w.to(torch.float16))
    head = Head.build(fl, qt, torch.float32)
    x = torch.randn(1, D, generator=torch.Generator().manual_seed(2)) * 0.01  # logits all near 0: every row in span
    exact = x @ w.t()
    got = head.logits(x, fl.linear(x), torch.tensor([100.0]))
    if V > MAX_EXACT_ROWS:
        assert int(((got - exact).abs() < 1e-7).sum()) >= MAX_EXACT_ROWS
    assert torch.allclose(got, exact, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_dense_head_is_float32_on_any_stage_dtype(dtype: torch.dtype) -> None:
    w = torch.randn(V, D, generator=torch.Generator().manual_seed(3)).to(dtype)
    head = Head.build(w, w, dtype)
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    exact = x @ w.float().t()
    if dtype == torch.float32:
        assert head is None  # the product is float32 already
        return
    coarse = torch.nn.functional.linear(x.to(dtype), w)
    got = head.logits(x, coarse)
    assert (got.argmax(-1) == exact.argmax(-1)).all()
    top = exact.argmax(-1)
    assert torch.allclose(got.gather(1, top[:, None]), exact.gather(1, top[:, None]), atol=1e-4)
