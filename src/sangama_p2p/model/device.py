"""Where a stage computes: ``--device cpu|cuda|cuda:N`` checked before anything loads, and its default dtype.

A stage on a CUDA device holds its weights, caches and the ring of rollback snapshots there (``StageModel.load`` and
``SessionState`` create every tensor on ``stage.device``); hidden states cross to and from the host once per trip
(``StageModel.forward`` moves its input there, ``tensors.to_wire`` brings the output back). Quantized weights are
repacked on the CPU for the device's own int4 kernel (``_weight_int4pack_mm``) and moved there once, as on the CPU;
where that kernel fails its one probe on the device they stay in their GGUF blocks and are dequantized per use
(``model/gguf/packed.py``).
"""

from __future__ import annotations

import re

import torch

from ..errors import DeviceError

__all__ = ["default_dtype", "resolve_device"]

_FORM = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def resolve_device(name: str) -> torch.device:
    """``name`` as a torch device that this process can use, else a one-line :class:`DeviceError`."""
    m = _FORM.match(name.strip().lower())
    if m is None or (m.group(1) == "cpu" and m.group(2) is not None):
        raise DeviceError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if m.group(1) == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
        raise DeviceError(f"--device {name}: {why} (torch {torch.__version__}); use --device cpu")
    index = int(m.group(2) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise DeviceError(f"--device {name}: only {count} CUDA device(s) here (cuda:0..cuda:{count - 1})")
    return torch.device("cuda", index)


def default_dtype(device: torch.device, dtype: str | None) -> str:
    """The compute dtype asked for, else bfloat16 on CUDA and float32 on the CPU."""
    if dtype is not None:
        return dtype
    return "bfloat16" if device.type == "cuda" else "float32"
