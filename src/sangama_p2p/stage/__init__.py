"""The stage side of the pipeline: the stage server, its session table, batching scheduler and DHT announcer.

Usage: see :mod:`sangama_p2p.stage.server`. Never imports ``client/`` (they share only ``wire/``).
"""

from .config import StageConfig
from .server import StageServer

__all__ = ["StageConfig", "StageServer"]
