"""How many layers of a checkpoint this machine can hold: what ``--layers auto`` caps its span with.

A stage holds its layers' weights (about their file bytes, a little more where products are joined or packed:
docs/benchmarks.md measures 1.0-1.6x) and its sessions' caches. :func:`span_that_fits` takes the file bytes of each
layer (:func:`layer_bytes`, from the tensor headers: nothing is read) and a budget (:func:`available_bytes`: 80% of
the memory the kernel says is available, or of the GPU's free memory) and returns the longest run of layers whose
bytes times :data:`OVERHEAD` fit.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["OVERHEAD", "auto_span", "available_bytes", "layer_bytes", "span_that_fits"]

OVERHEAD = 1.6  # held bytes per file byte, at most (Q4_K_M on CUDA, docs/benchmarks.md), with room for sessions
SHARE = 0.8  # of the available memory a stage may plan to take


def layer_bytes(spec: Any, source: Any) -> list[int]:
    """The stored bytes of each layer's tensors (``spec.num_layers`` entries; headers only)."""
    from .fingerprint import tensor_table

    _, entries = tensor_table(source, spec)
    out = [0] * spec.num_layers
    for e in entries:
        if e.part.isdigit() and int(e.part) < spec.num_layers:
            out[int(e.part)] += e.nbytes
    return out


def available_bytes(device: str = "cpu", meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """:data:`SHARE` of the memory a new stage could take on ``device``: the kernel's ``MemAvailable`` for the CPU,
    the free memory of a CUDA device; None when it cannot be told (another OS)."""
    if device.startswith("cuda"):
        import torch

        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(SHARE * free)
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(SHARE * int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        return None
    return None


def span_that_fits(per_layer: Sequence[int], budget: int | None) -> int:
    """The most consecutive layers whose bytes x :data:`OVERHEAD` fit in ``budget`` (all of them for None);
    0 when not even the smallest layer does."""
    if budget is None:
        return len(per_layer)
    best, total, lo = 0, 0, 0
    for hi, nbytes in enumerate(per_layer):
        total += nbytes
        while lo <= hi and total * OVERHEAD > budget:
            total -= per_layer[lo]
            lo += 1
        best = max(best, hi - lo + 1)
    return best


def auto_span(ckpt: Any, device: str = "cpu") -> int:
    """The span of a bare ``--layers auto``: a third of the model (three peers cover it), or fewer layers when this
    machine cannot hold that many (blocking: reads tensor headers). Raises ``LayerRangeError`` when not one fits."""
    from ..errors import LayerRangeError

    per_layer = layer_bytes(ckpt.spec, ckpt.source)
    budget = available_bytes(device)
    fits = span_that_fits(per_layer, budget)
    if fits == 0:
        raise LayerRangeError(f"not one layer of this model fits in the {budget or 0} bytes this machine has "
                              f"available (a layer takes up to {int(max(per_layer) * OVERHEAD)}): free memory or "
                              "use a smaller quantization")
    return min(-(-len(per_layer) // 3), fits)
