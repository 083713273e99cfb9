"""``StageServer``: serve layers ``[start, end)`` of a model over ``/sangama/stage/1`` and ``/sangama/info/1``.

Usage (trio; ``node`` from :func:`sangama_p2p.net.open_host`)::

    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.stage import StageConfig, StageServer

    ckpt = open_checkpoint(path)
    server = StageServer.load(node, ckpt, StageConfig(model_id="org/model", start=0, end=4))  # reads the weights
    async with server:            # handlers registered, compute worker and DHT announcer running
        ...                       # serve until the block ends
    # or: await server.run()      # serve until cancelled

What it does: a client opens a session (``OpenSession``: id, model, range, next hop, sampling and guess settings,
max length); the session belongs to the client's authenticated peer id, and its caches are preallocated within
the stage's memory budget (``CAPACITY`` refusal when full; running sessions are unaffected). ``Step`` frames go
through the batching scheduler (one compute worker off the trio thread; the steps of several sessions waiting at
once run as one batched step). A middle stage forwards its output hidden states to the next hop over one
long-lived stream per neighbour; the last stage checks guesses, samples, drafts new guesses and answers the client
with ``StepResult`` on the client's own stream. Every frame's ``start_pos`` rolls the session back locally. Each
stage appends its ``TraceStamp`` (receive, compute start, compute end, send; own monotonic clock).
Refusals are ``ErrorMessage`` frames with an :class:`~sangama_p2p.errors.ErrorCode` (``NOT_OWNER`` for a peer
that neither opened the session nor feeds it, ``UNKNOWN_SESSION``, ``WRONG_MODEL``, ``BAD_POSITION``, ...).
"""

from __future__ import annotations

from typing import Any

from ..wire.messages import InfoResponse
from .config import StageConfig

__all__ = ["StageServer"]


class StageServer:
    """One stage served on one node; an ``async with`` object (see the module docstring)."""

    def __init__(self, node: Any, model: Any, config: StageConfig) -> None:
        """``model``: a loaded :class:`~sangama_p2p.model.stage.StageModel` for ``config.start``..``config.end``."""
        self.node = node
        self.model = model
        self.config = config

    @classmethod
    def load(cls, node: Any, checkpoint: Any, config: StageConfig) -> StageServer:
        """Load only this stage's tensors from ``checkpoint`` (a ``model.checkpoint.Checkpoint``); blocking."""
        raise NotImplementedError

    async def __aenter__(self) -> StageServer:
        raise NotImplementedError

    async def __aexit__(self, *exc: object) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        """Serve until cancelled."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Stop serving: unregister the handlers, reset the streams, free every session."""
        raise NotImplementedError

    def info(self) -> InfoResponse:
        """What ``/sangama/info/1`` answers: range, measured throughput, free sessions, queue length, version."""
        raise NotImplementedError

    @property
    def free_sessions(self) -> int:
        raise NotImplementedError

    @property
    def throughput(self) -> float:
        """Measured single-request steps per second (what the DHT record announces)."""
        raise NotImplementedError
