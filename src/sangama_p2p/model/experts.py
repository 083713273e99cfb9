"""A MoE layer's experts as stacked weights, run over many rows with a fixed handful of products.

On CPU a small model's MoE step is bound by the number of calls, not by arithmetic: looping over the experts a batch
hits costs ~8 calls per expert. :class:`StackedExperts` holds the experts' SwiGLU weights transposed, as ``[E, H, 2I]``
and ``[E, I, H]`` (the experts' own weights become transposed views of them: no extra memory) and runs a step either

- densely: every expert on every row, combined with the routing weights (zero for the experts a row did not pick):
  E/k times the arithmetic, chosen only while that is small; the same products whatever the routing, which the
  batch-invariant mode needs; or
- grouped: the rows each expert got, gathered into ``[E, cap, H]`` (cap = the busiest expert's rows), two batched
  products, scattered back weighted: about k/E of the dense arithmetic, for larger steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .linear import DenseMLP

__all__ = ["StackedExperts"]

# Dense (all experts on all rows) while rows * E * H * I stays under this (~12 MFLOP), and only for models whose
# experts are this small per row (so that the batch-invariant mode can always take the dense path).
DENSE_MAX = 2**21
DENSE_MAX_PER_ROW = 2**17


class StackedExperts:
    def __init__(self, gate_up_t: torch.Tensor, down_t: torch.Tensor) -> None:
        # stored transposed and contiguous: a batched product with transposed views costs 2-3x as much for few rows
        self.gate_up_t = gate_up_t  # [E, H, 2I]
        self.down_t = down_t  # [E, I, H]
        e, h, two_i = gate_up_t.shape
        self.num, self.inter = e, two_i // 2
        self.per_row = e * h * self.inter
        self.dense_ok = self.per_row <= DENSE_MAX_PER_ROW

    @classmethod
    def build(cls, experts: list[DenseMLP]) -> "StackedExperts | None":
        """Stack dense, bias-free experts (re-pointing their weights at transposed views of the stack); None if they
        are not."""
        ws = [(e.gate_up.parts, e.down) for e in experts]
        if any(len(p) != 1 or not isinstance(p[0], torch.Tensor) or not isinstance(d, torch.Tensor) for p, d in ws):
            return None
        if any(e.gate_up.biases[0] is not None or e.down_bias is not None for e in experts):
            return None
        if len({(p[0].dtype, p[0].shape, d.shape) for p, d in ws}) != 1:
            return None
        gate_up_t = torch.stack([p[0].t() for p, _ in ws])  # [E, H, 2I]
        down_t = torch.stack([d.t() for _, d in ws])  # [E, I, H]
        for i, e in enumerate(experts):
            e.gate_up.parts[0], e.down = gate_up_t[i].t(), down_t[i].t()
        return cls(gate_up_t, down_t)

    def dense(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Every expert on every row of x [N, H]; top_i, top_w [N, k]. Returns [N, H]."""
        rows = x.expand(self.num, *x.shape)  # [E, N, H] (bmm with a broadcast row block is cheaper than matmul's)
        gate, up = torch.bmm(rows, self.gate_up_t.to(x.dtype)).chunk(2, dim=-1)  # [E, N, I] each
        y = torch.bmm(F.silu(gate) * up, self.down_t.to(x.dtype))  # [E, N, H]
        weights = torch.zeros(x.shape[0], self.num, dtype=x.dtype, device=x.device).scatter_(1, top_i, top_w)
        return (y * weights.t()[:, :, None]).sum(0)

    def grouped(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor | None:
        """Each expert on its own rows only, as two batched products; None when padding would waste over half."""
        n, k = top_i.shape
        flat = top_i.reshape(-1)  # [N*k] the expert of each (row, slot)
        counts = torch.bincount(flat, minlength=self.num)
        cap = int(counts.max())
        if self.num * cap > 2 * n * k:
            return None
        order = torch.argsort(flat, stable=True)  # (row, slot) pairs by expert
        expert = flat[order]
        place = torch.arange(n * k, device=x.device) - (counts.cumsum(0) - counts)[expert]  # index within expert
        row = order // k
        buf = torch.zeros(self.num, cap, x.shape[1], dtype=x.dtype, device=x.device)
        buf[expert, place] = x[row]
        gate, up = torch.bmm(buf, self.gate_up_t.to(x.dtype)).chunk(2, dim=-1)  # [E, cap, I] each
        y = torch.bmm(F.silu(gate) * up, self.down_t.to(x.dtype))  # [E, cap, H]
        return torch.zeros_like(x).index_add_(0, row, y[expert, place] * top_w.reshape(-1)[order, None])
