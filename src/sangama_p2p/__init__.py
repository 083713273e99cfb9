"""Sangama: peer-to-peer pipelines that run language models too large for any one machine."""

from __future__ import annotations

from .errors import (
    CapacityError,
    CheckpointError,
    ErrorCode,
    LayerRangeError,
    ModelError,
    NetworkError,
    RouteError,
    SangamaError,
    SessionStateError,
    StageError,
    UnsupportedModelError,
    WireError,
)

__version__ = "0.1.0"

__all__ = [
    "CapacityError",
    "CheckpointError",
    "ErrorCode",
    "LayerRangeError",
    "ModelError",
    "NetworkError",
    "RouteError",
    "SangamaError",
    "SessionStateError",
    "StageError",
    "UnsupportedModelError",
    "WireError",
    "__version__",
]
