"""Sangama: peer-to-peer pipelines that run language models too large for any one machine.

``from sangama_p2p import Peer, PeerConfig`` embeds a peer (trio; ``sangama_p2p.aio.Peer`` for asyncio). Those two
names load on first use (PEP 562 ``__getattr__``): importing the package itself pulls in neither trio, libp2p nor
torch, because a bootstrap node and ``wire/`` users import it too.
"""

from __future__ import annotations

from ._version import __version__
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

_LAZY = {"Peer": "peer", "PeerConfig": "config"}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "CapacityError",
    "CheckpointError",
    "ErrorCode",
    "LayerRangeError",
    "ModelError",
    "NetworkError",
    "Peer",
    "PeerConfig",
    "RouteError",
    "SangamaError",
    "SessionStateError",
    "StageError",
    "UnsupportedModelError",
    "WireError",
    "__version__",
]
