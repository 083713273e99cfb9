"""``open_stage_stream``: the one way up the stack to a stage's long-lived ``/sangama/stage/2`` stream.

The client's links (``client/links.py``) and a stage's next-hop links (``stage/server.py``) both call it: reach the
peer from every address known for it (:func:`~sangama_p2p.net.dial.dial_peer`: the given addresses, the peerstore,
with ``model_id`` its serving record's ``/p2p-circuit`` addresses from the DHT), then open a direct lane where the
peer offers one, else a libp2p stream (:meth:`~sangama_p2p.net.lane.LaneDialer.stage_stream`), framed
(:class:`~sangama_p2p.net.streams.FramedStream`). Peer ids and addresses go in as text, so nothing above ``net/``
handles py-libp2p's types.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import multiaddr
import trio
from libp2p.peer.id import ID

from ..errors import NetworkError, translate
from ..wire.framing import DEFAULT_MAX_FRAME, ByteBudget
from .dial import dial_peer
from .holepunch import stream_link
from .lane import LaneDialer
from .streams import FramedStream

__all__ = ["describe_stage_stream", "open_stage_stream"]


async def open_stage_stream(node: Any, lanes: LaneDialer, peer: str, *, timeout: float, addrs: Sequence[str] = (),
                            model_id: str | None = None, max_frame: int = DEFAULT_MAX_FRAME,
                            budget: ByteBudget | None = None) -> FramedStream:
    """The framed stage stream to ``peer`` (base58), reached and opened within ``timeout`` seconds.

    ``addrs``: addresses to try first (a serving record's); ``model_id``: fetch the peer's serving record from the
    DHT when no circuit address is known; ``max_frame``/``budget``: the stream's frame bound and shared input budget.
    Raises :class:`NetworkError` for a malformed peer id or address, and when the peer is not reached in time.
    """
    try:
        pid = ID.from_base58(peer)
        maddrs = [multiaddr.Multiaddr(a) for a in addrs]
    except Exception as exc:  # base58 / multihash ValueErrors, multiaddr's parse errors, a non-str
        raise translate(exc, NetworkError, f"bad peer id or address for {peer!r}")
    with trio.move_on_after(timeout) as scope:
        # explicit: a generation (or a probe of a live record) names this peer now, so a backoff left by an earlier
        # failure does not stop it; a departed peer's record expires within its TTL, which bounds these dials
        await dial_peer(node, pid, addrs=maddrs, model_id=model_id, timeout=timeout, explicit=True)
        stream = await lanes.stage_stream(pid)
    if scope.cancelled_caught:
        raise NetworkError(f"{peer} not reached in {timeout:g} s")
    return FramedStream(stream, max_frame=max_frame, budget=budget)


def describe_stage_stream(fs: FramedStream) -> str:
    """What carries a stage stream now, for users: ``lane`` (a direct TCP lane), ``direct`` or ``relayed via <id>``
    (a libp2p stream; `` (moved N)`` once it followed a hole punch off the relay), or ``local`` (in-process)."""
    kind = fs.link_kind
    if kind != "libp2p":
        return kind
    try:
        link = str(stream_link(fs.stream))
    except Exception:  # a stream without a libp2p connection behind it: say what it is, never fail the caller
        return "libp2p"
    moves = getattr(fs.stream, "moves", 0)
    return f"{link} (moved {moves})" if moves else link
