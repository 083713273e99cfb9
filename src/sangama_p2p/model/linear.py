"""Dense products of a batched step: row padding (batch invariance), one weight or several of one input, RMSNorm
scales and the SwiGLU MLP. The layers (``layers.py``, ``deltanet.py``, ``experts.py``, ``mtp.py``) build on these.
"""

from __future__ import annotations

import contextvars
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from .spec import ModelSpec
from .weights import FusedWeight, Weight, dense

__all__ = ["MIN_ROWS", "DenseMLP", "FusedLinear", "Loader", "linear", "norm_weight", "pad_rows"]

# A loader returns the weight for a canonical name relative to a prefix.
Loader = Callable[[str], Weight]


# Batch-invariant numerics. BLAS runs a few rows through other kernels (gemv, small-matrix paths) than many rows, and
# vectorised elementwise kernels compute a tensor's tail elements with scalar code, so the same row can differ in its
# last bits depending on what it is batched with. With MIN_ROWS = m > 0, every dense product and every whole-step
# tensor has a row count that is a multiple of m (zero rows are appended), so each row takes the same path whatever
# its neighbours. The stage sets this per step (see StageModel.batch_invariant).
MIN_ROWS: contextvars.ContextVar[int] = contextvars.ContextVar("sangama_min_rows", default=0)


def pad_rows(x: torch.Tensor, m: int) -> torch.Tensor:
    """``x`` with zero rows appended up to a multiple of ``m`` rows (``x`` itself when m is 0 or it fits)."""
    n = x.shape[0]
    target = -(-n // m) * m if m else n
    if target == n:
        return x
    return torch.cat((x, torch.zeros(target - n, *x.shape[1:], dtype=x.dtype, device=x.device)))


def linear(x: torch.Tensor, w: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    n, m = x.shape[0], MIN_ROWS.get()
    if bias is not None and bias.dtype != x.dtype:  # biases are kept fp32; a bf16/fp16 step uses them cast
        bias = bias.to(x.dtype)
    if isinstance(w, FusedWeight):  # repacked at load: the kernel multiplies the packed weight itself
        return w.linear(pad_rows(x, m), bias)[:n] if m else w.linear(x, bias)
    if m:
        return F.linear(pad_rows(x, m), dense(w, x.dtype), bias)[:n]
    return F.linear(x, dense(w, x.dtype), bias)


class FusedLinear:
    """Projections of the same input as ONE product when their weights are dense or repacked alike (one each when
    quantized per use).

    The concatenated weight replaces the parts (same bytes), so a decode step makes one call where it made three
    or four: on CPU the per-call overhead, not the arithmetic, dominates small models. Repacked parts that cannot all
    be joined are joined in runs, in order (a packed layout takes a part that fills no whole tile only last: a Gated
    DeltaNet's q/k/v, z and 8-row beta in one product, its 8-row alpha in a second, where there were four).
    """

    def __init__(self, weights: list[Weight], biases: list[torch.Tensor] | None = None) -> None:
        self.sizes = [int(w.shape[0]) for w in weights]
        bias_of = list(biases) if biases else [None] * len(weights)
        if all(isinstance(w, torch.Tensor) for w in weights) and len({w.dtype for w in weights}) == 1:
            runs = [list(range(len(weights)))]
            joined: list[Weight] = [torch.cat(weights)]  # type: ignore[arg-type]
        elif all(isinstance(w, FusedWeight) for w in weights):
            runs, joined = _join_runs(weights)  # type: ignore[arg-type]
        else:
            runs, joined = [[i] for i in range(len(weights))], list(weights)
        self.parts: list[Weight] = joined
        self.biases: list[torch.Tensor | None] = [
            torch.cat([bias_of[i] for i in run]) if biases else None for run in runs]  # type: ignore[misc]
        self.splits = [[self.sizes[i] for i in run] for run in runs]  # each part's outputs

    def weights(self) -> Iterator[Weight]:
        yield from self.parts
        yield from (b for b in self.biases if b is not None)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        for w, b, sizes in zip(self.parts, self.biases, self.splits):
            y = linear(x, w, b)
            out.extend(y.split(sizes, dim=-1) if len(sizes) > 1 else (y,))
        return out


def _join_runs(weights: list[FusedWeight]) -> tuple[list[list[int]], list[Weight]]:
    """Maximal runs of consecutive repacked weights that their type joins, and the joined weights (each run built
    once: ``joinable`` decides without copying)."""
    runs: list[list[int]] = [[0]]
    for i in range(1, len(weights)):
        run = runs[-1] + [i]
        if type(weights[run[0]]).joinable([weights[j] for j in run]):
            runs[-1] = run
        else:
            runs.append([i])
    joined: list[Weight] = []
    for run in runs:
        parts = [weights[j] for j in run]
        one = parts[0] if len(parts) == 1 else type(parts[0]).concat(parts)
        assert one is not None, "concat must join what joinable accepts"
        joined.append(one)
    return runs, joined


def norm_weight(w: Weight, spec: ModelSpec) -> torch.Tensor:
    """Effective RMSNorm scale, fp32: Qwen3.5 stores w and applies 1 + w."""
    t = dense(w, torch.float32)
    return (t + 1.0) if spec.zero_centered_norm else t


class DenseMLP:
    """SwiGLU MLP (Llama's FFN and Qwen3.5's shared expert)."""

    def __init__(self, load: Loader, prefix: str, bias: bool = False) -> None:
        biases = [dense(load(f"{prefix}.{p}.bias"), torch.float32) for p in ("gate_proj", "up_proj")] if bias \
            else None
        self.gate_up = FusedLinear([load(f"{prefix}.gate_proj.weight"), load(f"{prefix}.up_proj.weight")], biases)
        self.down = load(f"{prefix}.down_proj.weight")
        self.down_bias = dense(load(f"{prefix}.down_proj.bias"), torch.float32) if bias else None
        parts = self.gate_up.parts
        # one repacked gate/up and a repacked down, no biases: their products chain in the kernels' own dtype
        self.native = len(parts) == 1 and isinstance(parts[0], FusedWeight) and isinstance(self.down, FusedWeight) \
            and not bias
        pd = {parts[0].product_dtype, self.down.product_dtype} if self.native else {None}  # type: ignore[union-attr]
        self.takes: torch.dtype | None = pd.pop() if len(pd) == 1 else None  # what forward_native takes uncast

    def weights(self) -> Iterator[Weight]:
        yield from self.gate_up.weights()
        yield self.down
        if self.down_bias is not None:
            yield self.down_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dim() == 2 and not MIN_ROWS.get():
            return self.forward_native(x).to(x.dtype)
        gate, up = self.gate_up(x)
        return linear(F.silu(gate) * up, self.down, self.down_bias)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, hidden]`` in the down product's output dtype (``self.native`` only; not
        batch-invariant): what :meth:`forward` computes, without its last cast.

        The SiLU and the product with ``up`` stay in fp32 (one rounding to bfloat16, at the down product's input).
        Doing them in bfloat16 saved two casts a call (~4 us) but rounded twice more, and on the tiny MoE preset's
        near-tied router that flipped a teacher-forced token against the dequantize-per-use path (15 -> 14 of 16)."""
        both = self.gate_up.parts[0].product(x).float()  # type: ignore[union-attr]
        gate, up = both.split(self.gate_up.sizes, dim=-1)
        return self.down.product(F.silu(gate).mul_(up))  # type: ignore[union-attr]
