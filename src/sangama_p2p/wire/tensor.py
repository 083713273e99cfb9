"""A tensor as bytes: dtype name, shape and little-endian raw data. Conversion to and from torch lives elsewhere.

Why not a torch tensor: ``wire/`` must stay importable without torch (a bootstrap node never loads it), and the
bytes are exactly what goes on the wire, so no copy is needed to send them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Final

from sangama_p2p.errors import InvalidMessageError
from sangama_p2p.wire.limits import check_uints

__all__ = ["DTYPE_SIZES", "MAX_DIM", "MAX_ELEMENTS", "MAX_RANK", "Tensor"]

DTYPE_SIZES: Final = {"bf16": 2, "fp16": 2, "fp32": 4}
"""Wire dtype names and their item sizes in bytes. bf16 is the default for hidden states."""
MAX_RANK: Final = 4
MAX_DIM: Final = 1 << 24
MAX_ELEMENTS: Final = 1 << 27


@dataclass(frozen=True, slots=True)
class Tensor:
    """``data`` holds ``prod(shape) * itemsize`` bytes, little-endian, C order.

    ``data`` may be a ``memoryview`` (e.g. over a torch tensor's storage) so that encoding copies it only once; it
    is then viewed as unsigned bytes and must be C-contiguous. Decoded tensors always hold ``bytes``.
    """

    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview = field(repr=False)

    def __post_init__(self) -> None:
        if type(self.dtype) is not str or self.dtype not in DTYPE_SIZES:
            raise InvalidMessageError(f"tensor dtype must be one of {sorted(DTYPE_SIZES)}, got {self.dtype!r}")
        shape = check_uints("tensor shape", self.shape, MAX_RANK, MAX_DIM + 1, min_len=1)
        object.__setattr__(self, "shape", shape)
        numel = math.prod(shape)
        if numel > MAX_ELEMENTS:
            raise InvalidMessageError(f"tensor of {numel} elements exceeds the limit of {MAX_ELEMENTS}")
        data: object = self.data
        if type(data) is bytearray:
            data = bytes(data)
        elif type(data) is memoryview:
            if not data.c_contiguous:
                raise InvalidMessageError("tensor data memoryview must be C-contiguous")
            if data.format != "B" or data.ndim != 1:
                data = data.cast("B")
        elif type(data) is not bytes:
            raise InvalidMessageError(f"tensor data must be bytes, got {type(data).__name__}")
        object.__setattr__(self, "data", data)
        expected = numel * DTYPE_SIZES[self.dtype]
        if len(data) != expected:
            raise InvalidMessageError(
                f"tensor {self.dtype}{list(shape)} needs {expected} bytes of data, got {len(data)}"
            )

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return len(self.data)
