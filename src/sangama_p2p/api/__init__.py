"""The OpenAI-compatible HTTP API over the swarm (``sangama-peer api``, :meth:`sangama_p2p.Peer.serve_api`).

Needs the ``api`` extra (hypercorn, starlette): ``pip install 'sangama-p2p[api]'``.
"""

from .config import ApiConfig
from .server import ApiServer, ServedModel, served_model

__all__ = ["ApiConfig", "ApiServer", "ServedModel", "served_model"]
