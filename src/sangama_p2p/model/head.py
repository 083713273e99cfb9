"""The output head: logits in float32 on every path, whatever kernel multiplies the head's weight.

The fused kernels round: torch's int4 kernel takes bfloat16 activations, holds bfloat16 scales and returns
bfloat16 products (at a logit of 25 its step is 0.125), an fp16 copy returns fp16, a CUDA stage computes in
bfloat16. Those roundings decide tokens where two scores nearly tie, and near-ties are common in real checkpoints:
on SmolLM2's README chat prompt "The" and "L" scored 25.325 and 25.243 in float32 and came out of the kernel as one
number. So the head is computed in two passes:

1. the kernel's product (what the stage computed before: fast, rounded) gives every logit of a row within
   ``B = REL * (max_r |w_r| |x| + max |coarse|)`` of its float32 value (Cauchy-Schwarz over the activations' and
   the scales' roundings, plus the output's; the largest row norm of the weight is computed once at load).
   Measured on SmolLM2 Q4_1's tied Q8_0 head: the largest error was 0.3 of the per-logit form of this bound with
   REL = 2^-8; REL is 2^-7.
2. a score under ``top - 2B`` cannot be the float32 maximum; every score above it (less a sampling span, below) is
   computed again in float32 from the weight as stored (its quantized blocks, read back from the file's mapping,
   or its float rows).

So the scores that can decide a token are float32 products of the stored weight, like the dequantize-per-use
path's: greedy argmax is exact, and so is guess verification. A sampled row recomputes every score within
``SPAN_NATS * temperature`` of the top (a score left out has a probability under e^-10 of the top's), at most its
:data:`MAX_EXACT_ROWS` highest; the rest keep the kernel's values, within the bound, so the draw's distribution
differs from float32's only in a tail of negligible mass. The second pass costs a few rows of dequantization per
greedy token (1-5 of SmolLM2's 49,152 on its chat prompt). A greedy row with more than :data:`MAX_EXACT_ROWS`
candidates (a flat distribution; never seen) is computed whole in float32, a chunk of the weight at a time. Each
(row, candidate) pair is its own reduction, so batching does not change a row's logits.

Heads whose product is float32 already (a float32 weight, or blocks dequantized per use, on a float32 stage) have
no second pass (:meth:`Head.build` returns None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import torch

from .gguf.quants import QuantTensor, dequantize_rows
from .weights import FusedWeight, Weight, dense

__all__ = ["Head", "REL", "SPAN_NATS"]

REL = 2.0**-7  # the relative bound of the kernels' roundings (bfloat16's unit roundoff is 2^-9; see above)
SPAN_NATS = 10.0  # a sampled row recomputes the logits within this many temperatures of the top
MAX_EXACT_ROWS = 1024  # at most this many logits of a sampled row recomputed (its highest); see above
_CHUNK_BYTES = 16 << 20  # the float32 weight a whole-row computation holds at once
_NORM_CHUNK_BYTES = 2 << 20  # the float32 rows the load's norm pass holds at once (its peak stays small)


@dataclasses.dataclass(eq=False)
class Head:
    """The second pass of a stage's head. ``stored``: the weight as the checkpoint stores it (or, for a dense
    weight, as the stage holds it); ``max_norm``: the largest norm of its rows."""

    stored: Weight
    max_norm: float

    @classmethod
    def build(cls, weight: Weight, stored: Weight, dtype: torch.dtype,
              release: Callable[[torch.Tensor], None] | None = None) -> "Head | None":
        """The second pass for a stage computing in ``dtype`` that multiplies by ``weight`` (``stored``: as read
        from the checkpoint); None when ``weight``'s product is float32 already. ``release`` is given each chunk of
        stored blocks (or rows) once its norms are taken (the source drops their mapped pages: a load's peak does
        not hold the whole head twice)."""
        if dtype == torch.float32 and not isinstance(weight, FusedWeight) and (
                not isinstance(weight, torch.Tensor) or weight.dtype == torch.float32):
            return None
        if not isinstance(weight, FusedWeight):
            stored = weight  # dense or per-use blocks: the stage's own weight is the float32 reference
        return cls(stored, _max_row_norm(stored, release))

    def logits(self, x: torch.Tensor, coarse: torch.Tensor, spans: torch.Tensor | None = None) -> torch.Tensor:
        """Float32 logits ``[N, V]`` for the float32 activations ``x [N, D]`` from the kernel's ``coarse`` [N, V];
        ``spans`` [N]: how far below the top (in logits) a row's scores must be exact (0: greedy)."""
        coarse = coarse.float()
        if coarse.numel() == 0:
            return coarse
        # one bound per row (the largest of its logits' bounds): cheaper than one per logit, a few more candidates
        top = coarse.amax(-1, keepdim=True)  # [N, 1]
        bound = REL * (self.max_norm * torch.linalg.vector_norm(x, dim=-1, keepdim=True)
                       + torch.maximum(top, -coarse.amin(-1, keepdim=True)))
        floor = top - 2 * bound  # a score below this cannot reach the top's float32 value
        if spans is not None:
            floor = floor - spans.to(floor.device, torch.float32)[:, None]
        mask = coarse >= floor  # [N, V] the scores to recompute
        t_idx, r_idx = mask.nonzero(as_tuple=True)
        out = coarse.clone()
        if t_idx.numel() > MAX_EXACT_ROWS:  # some row may have more candidates than that
            over = [t for t, c in enumerate(torch.bincount(t_idx, minlength=coarse.shape[0]).tolist())
                    if c > MAX_EXACT_ROWS]
            for t in over:
                mask[t] = False
                if spans is None or float(spans[t]) == 0.0:  # a greedy row with that many near-ties (never seen)
                    out[t] = self.whole(x[t : t + 1])[0]
                else:  # a sampled row: its MAX_EXACT_ROWS highest scores (the tail's mass is negligible)
                    mask[t, coarse[t].topk(MAX_EXACT_ROWS).indices] = True
            t_idx, r_idx = mask.nonzero(as_tuple=True)
        if not t_idx.numel():
            return out
        rows = _rows(self.stored, r_idx.to(_device_of(self.stored))).to(x.device)  # [P, D] float32
        xs = x[0] if x.shape[0] == 1 else x.index_select(0, t_idx)  # (index_select: advanced indexing is slower)
        out[t_idx, r_idx] = (rows * xs).sum(-1)  # one reduction per (row, candidate): batching changes nothing
        return out

    def whole(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ stored.T`` in float32, a chunk of the stored rows at a time: every logit a float32 product of the
        stored weight (perplexity scores every row's target, not only its top)."""
        out = torch.empty(x.shape[0], self.stored.shape[0], dtype=torch.float32, device=x.device)
        for r0, rows, _ in _row_chunks(self.stored, _CHUNK_BYTES):
            out[:, r0 : r0 + rows.shape[0]] = x @ rows.to(x.device).t()
        return out


def _device_of(w: Weight) -> torch.device:
    if isinstance(w, torch.Tensor):
        return w.device
    data = getattr(w, "data", None)
    if isinstance(data, torch.Tensor):
        return data.device
    weight = getattr(w, "weight", None)
    return weight.device if isinstance(weight, torch.Tensor) else torch.device("cpu")


def _rows(w: Weight, idx: torch.Tensor) -> torch.Tensor:
    """Rows ``idx`` of ``w`` in float32, exactly as stored (quantized blocks dequantize only those rows)."""
    if isinstance(w, torch.Tensor):
        return w.index_select(0, idx).float()
    take = getattr(w, "take_rows", None)
    if take is not None:
        return take(idx, torch.float32)
    return dense(w, torch.float32).index_select(0, idx.to(_device_of(w)))


def _row_chunks(w: Weight, chunk_bytes: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
    """``(first row, rows in float32, the stored chunk they came from or None)`` over ``w``, ``chunk_bytes`` of
    float32 rows at a time (a quantized weight is never dequantized whole; its columns stay in stored order)."""
    v, d = w.shape  # type: ignore[misc]
    step = max(1, chunk_bytes // (4 * d))
    for r0 in range(0, v, step):
        if isinstance(w, QuantTensor):
            part: torch.Tensor | None = w.data[r0 : r0 + step]
            rows = dequantize_rows(w.qtype, part, w.n_cols)
            if w.col_perm is not None:
                rows = rows.index_select(1, w.col_perm.to(rows.device))
        elif isinstance(w, torch.Tensor):
            part = w[r0 : r0 + step]
            rows = part.float()
        else:
            part, rows = None, _rows(w, torch.arange(r0, min(v, r0 + step), device=_device_of(w)))
        yield r0, rows, part


def _max_row_norm(w: Weight, release: Callable[[torch.Tensor], None] | None) -> float:
    """The largest norm of ``w``'s rows (``release`` gets each chunk of stored blocks, or rows, once read)."""
    best = 0.0
    for _, rows, part in _row_chunks(w, _NORM_CHUNK_BYTES):
        best = max(best, float(torch.linalg.vector_norm(rows, dim=-1).max()))
        if release is not None and part is not None:
            release(part)
    return best
