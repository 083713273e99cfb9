"""Protocol ids and the wire version.

A protocol id names a stream's whole conversation; libp2p's multistream-select negotiates it when the stream opens,
so two peers that do not share a version never exchange a frame. The version byte inside every message is a second
guard against a peer that speaks the right id with the wrong layout. Any incompatible change to a message bumps both
(``/sangama/stage/5`` and ``WIRE_VERSION = 5``); a peer may keep serving the old id alongside the new one.
"""

from __future__ import annotations

from typing import Final

__all__ = ["INFO_PROTOCOL", "LANE_PROTOCOL", "STAGE_PROTOCOL", "WIRE_VERSION"]

WIRE_VERSION: Final = 6
"""The version byte that starts every message payload. Version 6 added ``OpenSession.ring``, ``ring_until``,
``ring_stop`` and ``Step.ring`` (the last stage hands the next trip on to the first stage itself); version 5 added ``OpenSession.fingerprint`` (a stage
refuses a session meant for another checkpoint); version 4 added ``OpenSession.grammar`` and
``grammar_start`` (output held to a JSON schema); version 3 added ``OpenSession.top_logprobs`` and
``StepResult.logprobs``; version 2 added ``OpenSession.prev_hop``. The byte is shared by all three protocols, so
their ids move with it (version 6: stage and info ``/6``, the lane ``/7``; version 5: stage and info ``/5``, the lane ``/6``; version 4: ``/4`` and ``/5``; version 3:
``/3`` and ``/4``): peers of
different versions never negotiate a stream."""

STAGE_PROTOCOL: Final = "/sangama/stage/6"
"""Long-lived stream between neighbouring peers of a chain: sessions, steps, results, errors."""

INFO_PROTOCOL: Final = "/sangama/info/6"
"""One request, one response: a peer's served range, load and software version."""

LANE_PROTOCOL: Final = "/sangama/lane/7"
"""One response: a ``LaneOffer`` for a direct, AES-GCM-protected TCP lane that then carries ``/sangama/stage/6``
frames (see ``sangama_p2p.net.lane``). A peer that does not serve it is reached over ``/sangama/stage/6`` as before.
Version 7 moved with ``WIRE_VERSION`` 6, version 6 with ``WIRE_VERSION`` 5, version 5 with ``WIRE_VERSION`` 4, version 4 with ``WIRE_VERSION`` 3 (the frames the lane carries changed). Version 3 changed only the lane's own TCP handshake (per-connection keys from both sides' nonces, see
``sangama_p2p.net.lane.handshake``), not any message, so it moved alone and ``WIRE_VERSION`` stays 2: a version 2
dialler finds no ``/sangama/lane/2`` and uses a libp2p stream."""
