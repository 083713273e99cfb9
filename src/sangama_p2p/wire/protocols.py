"""Protocol ids and the wire version.

A protocol id names a stream's whole conversation; libp2p's multistream-select negotiates it when the stream opens,
so two peers that do not share a version never exchange a frame. The version byte inside every message is a second
guard against a peer that speaks the right id with the wrong layout. Any incompatible change to a message bumps both
(``/sangama/stage/2`` and ``WIRE_VERSION = 2``); a peer may keep serving the old id alongside the new one.
"""

from __future__ import annotations

from typing import Final

__all__ = ["INFO_PROTOCOL", "LANE_PROTOCOL", "STAGE_PROTOCOL", "WIRE_VERSION"]

WIRE_VERSION: Final = 1
"""The version byte that starts every message payload."""

STAGE_PROTOCOL: Final = "/sangama/stage/1"
"""Long-lived stream between neighbouring peers of a chain: sessions, steps, results, errors."""

INFO_PROTOCOL: Final = "/sangama/info/1"
"""One request, one response: a peer's served range, load and software version."""

LANE_PROTOCOL: Final = "/sangama/lane/1"
"""One response: a ``LaneOffer`` for a direct, AES-GCM-protected TCP lane that then carries ``/sangama/stage/1``
frames (see ``sangama_p2p.net.lane``). A peer that does not serve it is reached over ``/sangama/stage/1`` as before."""
