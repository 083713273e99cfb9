"""Stage streams that move from a relayed connection to a hole-punched one between two frames.

Why: a stage stream (client to stage, stage to next hop) is opened as soon as the peer is reached, which behind NAT
is through a relay; the hole punch succeeds a fraction of a second later, but a libp2p stream cannot change its
connection, so every frame kept crossing the relay (measured: 21-29 kB per generation over the relay, ~750 B over
the punched connection). A :class:`MovableStream` is one logical byte stream over a sequence of libp2p streams:

* ``/sangama/stage-mv/1`` streams start with a 17-byte header, ``kind`` (0: a new stream, 1: the continuation of
  one) and a 16-byte token that names the logical stream (random, chosen by the dialler).
* The dialler, once a direct connection to the peer exists (:func:`watch_and_move`), opens a continuation on it,
  waits for the acceptor's one-byte ACK, then half-closes (FIN) the old stream and writes only to the new one. The
  acceptor, before its ACK, notes the continuation as the stream to read after the old one's end; after the ACK it
  half-closes the old stream the same way. Each side reads the old stream to its end, then the new one.
* Writes are whole frames (``FramedStream`` writes one frame per ``write``) under a lock that the move takes too, so
  a move happens between two frames; the FIN ends the old stream after its last frame, and reading on from the new
  stream after that end keeps every frame, in order, exactly once. Sessions never notice: to the stage server and
  the client it is the same stream object.
* A continuation must come from the peer that opened the logical stream (its authenticated id), so nobody else can
  take a stream over by guessing - or learning - its token; a failed move (no ACK within ``timeout_s``) leaves the
  stream where it was.

Peers that do not offer ``/sangama/stage-mv/1`` are reached with plain ``/sangama/stage/2`` streams (which never
move), so old and new peers chain.
"""

from __future__ import annotations

import logging
import secrets
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID

from ..errors import NetworkError
from .holepunch import link_info, stream_link, wait_direct

__all__ = [
    "LINKS_PROTOCOL",
    "STAGE_MOVABLE_PROTOCOL",
    "TRAFFIC",
    "MovableAcceptor",
    "MovableStream",
    "StageTraffic",
    "links_report",
    "open_movable",
    "watch_and_move",
]

log = logging.getLogger(__name__)

STAGE_MOVABLE_PROTOCOL = TProtocol("/sangama/stage-mv/1")
LINKS_PROTOCOL = TProtocol("/sangama/links/1")  # request: nothing; response: msgpack of links_report()
NEW, NEXT = 0, 1
ACK = b"\x01"
TOKEN_BYTES = 16


def header(kind: int, token: bytes) -> bytes:
    """The first bytes a dialler writes on a ``/sangama/stage-mv/1`` stream (pure)."""
    if kind not in (NEW, NEXT) or len(token) != TOKEN_BYTES:
        raise NetworkError(f"bad movable-stream header: kind {kind}, token of {len(token)} bytes")
    return bytes([kind]) + token


async def _read_exactly(stream: Any, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = await stream.read(n - len(out))
        if not chunk:
            raise NetworkError("stream ended inside a movable-stream header")
        out += chunk
    return out


def _eof(exc: BaseException) -> bool:
    return type(exc).__name__ in ("StreamEOF", "StreamClosed")


class StageTraffic:
    """Bytes of stage frames this process sent and received on movable streams, by kind of connection: what
    ``sangama-peer status --json`` shows as ``traffic`` (after a move, the ``relayed`` figures stop growing)."""

    def __init__(self) -> None:
        self.bytes = {"relayed_in": 0, "relayed_out": 0, "direct_in": 0, "direct_out": 0}

    def add(self, relayed: bool, direction: str, n: int) -> None:
        self.bytes[f"{'relayed' if relayed else 'direct'}_{direction}"] += n


TRAFFIC = StageTraffic()
_LIVE: weakref.WeakSet[MovableStream] = weakref.WeakSet()


def _relayed(raw: Any) -> bool:
    try:
        return not stream_link(raw).direct
    except Exception:  # not a libp2p stream (in-process tests): count it as direct
        return False


class MovableStream:
    """One logical stage stream over a sequence of libp2p streams (see the module docstring)."""

    def __init__(self, raw: Any, token: bytes, *, dialled: bool = False) -> None:
        self.token = token
        self.dialled = dialled
        self._read = raw
        self._write = raw
        self._read_relayed = self._write_relayed = _relayed(raw)
        self._next_read: Any = None
        self._wlock = trio.Lock()
        self._moving: trio.Event | None = None
        self.moves = 0
        self.closed = False
        _LIVE.add(self)

    @property
    def muxed_conn(self) -> Any:
        """The connection frames are written to now (its ``peer_id``; relayed or direct: ``stream_link``)."""
        return self._write.muxed_conn

    def get_protocol(self) -> TProtocol:
        return STAGE_MOVABLE_PROTOCOL

    def get_remote_address(self) -> tuple[str, int] | None:
        """The (ip, port) of the far end of the stream frames are written to now; None through a relay (whose
        address is not the peer's). What a stage counts sessions by, and a client's ban follows (net/addrs.py)."""
        if _relayed(self._write):
            return None
        getter = getattr(self._write, "get_remote_address", None)
        return getter() if getter is not None else None

    async def read(self, n: int) -> bytes:
        """Bytes from the current stream; at its end, from its continuation if one was agreed, else ``b""``."""
        while True:
            try:
                data = await self._read.read(n)
            except Exception as exc:
                if not _eof(exc):
                    raise
                data = b""
            if data:
                TRAFFIC.add(self._read_relayed, "in", len(data))
                return data
            if self._moving is not None:  # a move in flight decides whether this end is final
                await self._moving.wait()
            nxt = self._next_read
            if nxt is None or nxt is self._read:
                return b""
            self._read, self._next_read = nxt, None
            self._read_relayed = _relayed(nxt)

    async def write(self, data: bytes) -> None:
        async with self._wlock:
            await self._write.write(data)
            TRAFFIC.add(self._write_relayed, "out", len(data))

    async def close(self) -> None:
        self.closed = True
        for raw in {id(s): s for s in (self._write, self._read, self._next_read) if s is not None}.values():
            try:
                await raw.close()
            except Exception:  # already gone
                pass

    async def reset(self) -> None:
        self.closed = True
        for raw in {id(s): s for s in (self._write, self._read, self._next_read) if s is not None}.values():
            try:
                await raw.reset()
            except Exception:
                pass

    async def move(self, new: Any, *, timeout_s: float = 3.0) -> bool:
        """Dialler side: continue on ``new`` (a fresh ``/sangama/stage-mv/1`` stream); False (and ``new`` reset)
        when the peer did not acknowledge in ``timeout_s``, the stream staying where it was."""
        if self.closed:
            return False
        async with self._wlock:
            self._moving = trio.Event()
            try:
                with trio.fail_after(timeout_s):
                    await new.write(header(NEXT, self.token))
                    if await _read_exactly(new, 1) != ACK:
                        raise NetworkError("continuation refused")
                self._next_read = new
                old, self._write = self._write, new
                self._write_relayed = _relayed(new)
                await _close_write(old)
            except Exception as exc:  # no ACK, a reset, a timeout: stay on the old stream
                log.info("stage stream to %s did not move: %s", _peer(new), exc)
                try:
                    await new.reset()
                except Exception:
                    pass
                return False
            finally:
                self._moving.set()
                self._moving = None
        self.moves += 1
        return True

    async def accept_continuation(self, new: Any) -> None:
        """Acceptor side: read on from ``new`` after the old stream's end, acknowledge, write only to ``new``."""
        self._next_read = new
        await new.write(ACK)
        async with self._wlock:
            old, self._write = self._write, new
            self._write_relayed = _relayed(new)
            await _close_write(old)
        self.moves += 1


async def _close_write(raw: Any) -> None:
    close_write = getattr(raw, "close_write", None)
    try:
        await (close_write() if callable(close_write) else raw.close())
    except Exception as exc:  # the old stream died already: its reader sees the end anyway
        log.debug("half-closing a moved stream: %s", exc)


def _peer(raw: Any) -> str:
    try:
        return str(raw.muxed_conn.peer_id)
    except Exception:
        return "?"


class MovableAcceptor:
    """Serves ``/sangama/stage-mv/1``: new streams go to ``on_stream`` wrapped, continuations join theirs."""

    def __init__(self, on_stream: Callable[[Any], Awaitable[None]], *, header_timeout_s: float = 5.0) -> None:
        self.on_stream = on_stream
        self.header_timeout_s = header_timeout_s
        self._streams: weakref.WeakValueDictionary[tuple[str, bytes], MovableStream] = weakref.WeakValueDictionary()

    async def handle(self, raw: Any) -> None:
        """The stream handler (``host.set_stream_handler(STAGE_MOVABLE_PROTOCOL, acceptor.handle)``)."""
        peer = _peer(raw)
        try:
            with trio.fail_after(self.header_timeout_s):
                head = await _read_exactly(raw, 1 + TOKEN_BYTES)
        except Exception as exc:  # slow, short or broken: not a stage stream
            log.debug("movable stream from %s without a header: %s", peer, exc)
            await _reset(raw)
            return
        kind, token = head[0], head[1:]
        if kind == NEW:
            ms = MovableStream(raw, token)
            self._streams[(peer, token)] = ms
            await self.on_stream(ms)
            return
        ms_or_none = self._streams.get((peer, token)) if kind == NEXT else None
        if ms_or_none is None or ms_or_none.closed:
            log.info("refused a stage-stream continuation from %s (unknown stream)", peer)
            await _reset(raw)
            return
        try:
            await ms_or_none.accept_continuation(raw)
        except Exception as exc:
            log.info("stage-stream continuation from %s failed: %s", peer, exc)
            await _reset(raw)
            return
        log.info("stage stream from %s moved to %s", peer, _link_text(raw))


def _link_text(raw: Any) -> str:
    try:
        return str(stream_link(raw))
    except Exception:  # not a libp2p stream (in-process): nothing to describe
        return "another stream"


async def _reset(raw: Any) -> None:
    try:
        await raw.reset()
    except Exception:
        pass


PUNCH_WAIT_S = 1.5
"""How long a stream to a peer reached only through a relay waits for the hole punch before it opens (the peer that
accepted the relayed connection starts the punch at once; measured in namespaces: direct 0.1-0.6 s later). A slower
punch still takes the stream over (:func:`watch_and_move`); a failed one costs this wait once per link."""


async def open_movable(host: Any, peer_id: ID, fallback: TProtocol, *, punch_wait_s: float = PUNCH_WAIT_S) -> Any:
    """A stage stream to ``peer_id``: movable where the peer offers it, else a plain ``fallback`` stream."""
    info = link_info(host, peer_id)
    if info is not None and not info.direct and punch_wait_s > 0:
        await wait_direct(host, peer_id, punch_wait_s)
    raw = await host.new_stream(peer_id, [STAGE_MOVABLE_PROTOCOL, fallback])
    if raw.get_protocol() != STAGE_MOVABLE_PROTOCOL:
        return raw
    token = secrets.token_bytes(TOKEN_BYTES)
    await raw.write(header(NEW, token))
    return MovableStream(raw, token, dialled=True)


async def watch_and_move(host: Any, stream: MovableStream, peer_id: ID, *, watch_s: float = 30.0,
                         poll_s: float = 0.05) -> bool:
    """While ``stream`` runs over a relay, wait up to ``watch_s`` for a direct connection to ``peer_id`` (a hole
    punch) and move the stream onto it. True once moved."""
    if stream_link(stream).direct:
        return False
    with trio.move_on_after(watch_s):
        while not stream.closed:
            info = link_info(host, peer_id)
            if info is not None and info.direct:
                break
            await trio.sleep(poll_s)
        else:
            return False
    if stream.closed or not (link_info(host, peer_id) or stream_link(stream)).direct:
        return False
    try:
        new = await host.new_stream(peer_id, [STAGE_MOVABLE_PROTOCOL])
    except Exception as exc:
        log.info("no continuation stream to %s: %s", peer_id, exc)
        return False
    if not stream_link(new).direct:  # py-libp2p picked the relayed connection after all
        await _reset(new)
        return False
    if not await stream.move(new):
        return False
    log.info("stage stream to %s moved to the direct connection %s", peer_id, stream_link(stream).remote_addr)
    return True


def links_report(circuit_bytes: int | None = None) -> dict[str, Any]:
    """This process's open movable stage streams (peer, who dialled, ``direct`` / ``relayed via <id>``, moves) and
    its stage traffic by kind of connection; ``circuit_bytes``: what it relayed for others (a relay node)."""
    streams = []
    for ms in list(_LIVE):
        if ms.closed:
            continue
        try:
            link = stream_link(ms)
        except Exception:  # an in-process stream
            continue
        streams.append({"peer": link.peer_id, "dialled": ms.dialled, "link": str(link), "moves": ms.moves})
    report: dict[str, Any] = {"streams": sorted(streams, key=lambda x: (x["peer"], x["dialled"])),
                              "traffic": dict(TRAFFIC.bytes)}
    if circuit_bytes is not None:
        report["circuit_bytes"] = circuit_bytes
    return report
