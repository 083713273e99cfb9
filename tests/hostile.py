"""Hostile traffic against a stage over loopback (issue 15), shared by the hardening tests and benchmarks/soak.py.

Each helper is one bounded attack move (a fixed number of connections or bytes, or a time limit) and returns what
the stage did with it, so a test can assert on it and the soak can count it. Tests import it as ``from ..hostile
import ...``; the soak loads this file by path (test folders are no packages).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from typing import Any

import trio

from sangama_p2p.errors import LaneError, SangamaError, StreamClosed, WireError
from sangama_p2p.net.lane import LaneStream
from sangama_p2p.net.lane.handshake import NONCE_BYTES, READY, lane_key, seal_hello
from sangama_p2p.net.lane.records import receive_exactly
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.codec import decode, encode_message_frame
from sangama_p2p.wire.framing import DEFAULT_MAX_FRAME
from sangama_p2p.wire.messages import CloseSession, ErrorMessage, InfoRequest, LaneOffer, OpenSession, Step
from sangama_p2p.wire.protocols import LANE_PROTOCOL, STAGE_PROTOCOL
from sangama_p2p.wire.tensor import Tensor

__all__ = [
    "FUZZ_KINDS", "answer_of", "closed_on_us", "decodes", "fetch_offer", "flood_unread", "flood_unread_until",
    "fuzz_frame", "hold_idle",
    "non_finite_hidden", "open_session", "partial_record", "raw_stage_stream", "ready_after_hello", "replay_hello",
]

_CUT = (trio.BrokenResourceError, trio.ClosedResourceError, OSError)


async def closed_on_us(sock: trio.SocketStream) -> bool:
    """True when the other end closed the connection (cleanly, or with a reset when our bytes were unread)."""
    try:
        return await sock.receive_some(100) == b""
    except trio.BrokenResourceError:
        return True


async def hold_idle(port: int, n: int, opened: list[int], *, reopen_after: float = 0.2) -> None:
    """Keep ``n`` connections to ``port`` open, sending nothing; reopen each one the stage closes (after
    ``reopen_after`` s). ``opened[0]`` counts the connections made. Runs until cancelled."""

    async def one() -> None:
        while True:
            try:
                sock = await trio.open_tcp_stream("127.0.0.1", port)
            except OSError:
                await trio.sleep(reopen_after)
                continue
            opened[0] += 1
            try:
                while await sock.receive_some(64):
                    pass
            except _CUT:
                pass
            finally:
                await sock.aclose()
            await trio.sleep(reopen_after)

    async with trio.open_nursery() as nursery:
        for _ in range(n):
            nursery.start_soon(one)


async def partial_record(lane: LaneStream, announced: int, sent: int, chunk: bytes) -> int:
    """Announce a record of ``announced`` bytes and send ``sent`` of them; return how many the stage took (-1: it
    closed the lane, over its input budget, or stopped reading for 5 s)."""
    try:
        await lane.sock.send_all(struct.pack(">I", announced))
        done = 0
        while done < sent:
            with trio.fail_after(5):
                await lane.sock.send_all(chunk)
            done += len(chunk)
        return done
    except (*_CUT, trio.TooSlowError):
        return -1


async def flood_unread(lane: LaneStream, seconds: float, *, batch: int = 100) -> tuple[int, bool]:
    """Send InfoRequests on ``lane`` for ``seconds`` and read nothing: (requests sent, whether the stage closed
    the lane). A stage that stops reading leaves our writes blocked until the time is up."""
    frame = encode_message_frame(InfoRequest())
    sent = 0
    with trio.move_on_after(seconds):
        try:
            while True:
                await lane.write_raw(b"".join(lane.seal(frame) for _ in range(batch)))
                sent += batch
        except StreamClosed:
            return sent, True
    return sent, False


async def flood_unread_until(lane: LaneStream, done: Callable[[], bool], *, batch: int = 100, poll: float = 0.01
                             ) -> tuple[int, bool]:
    """Send InfoRequests on ``lane`` and read nothing until ``done()`` (checked every ``poll`` s, also while a write
    is blocked because the stage stopped reading) or the stage closes the lane: (requests sent, whether the lane was
    found closed). Bounded by what ``done`` waits for, not by a time."""
    frame = encode_message_frame(InfoRequest())
    sent, closed = 0, False
    async with trio.open_nursery() as nursery:
        async def stop() -> None:
            while not done():
                await trio.sleep(poll)
            nursery.cancel_scope.cancel()

        nursery.start_soon(stop)
        try:
            while True:
                await lane.write_raw(b"".join(lane.seal(frame) for _ in range(batch)))
                sent += batch
        except StreamClosed:
            closed = True
            nursery.cancel_scope.cancel()
    return sent, closed


async def ready_after_hello(sock: trio.SocketStream, offer: LaneOffer, dialler_nonce: bytes, peer_id: Any
                            ) -> LaneStream | None:
    """The dialler's side after its hello: the lane if the stage answered ready, None if it closed on us."""
    try:
        stage_nonce = await receive_exactly(sock, NONCE_BYTES, "ready")
    except LaneError:
        return None
    lane = LaneStream(sock, lane_key(offer.key, offer.token, dialler_nonce, stage_nonce), peer_id, dialer=True)
    try:
        return lane if await lane.read_record() == READY else None
    except (LaneError, StreamClosed, WireError):
        return None


async def fetch_offer(node: Any, peer_id: Any) -> LaneOffer | ErrorMessage:
    """Ask ``peer_id`` (already connected) for a lane offer over ``/sangama/lane/3``, as a real dialler does."""
    fs = FramedStream(await node.host.new_stream(peer_id, [LANE_PROTOCOL]), max_frame=4096)
    try:
        msg = await fs.recv()
    finally:
        await fs.aclose()
    if not isinstance(msg, LaneOffer | ErrorMessage):
        raise LaneError(f"the lane request was answered with {type(msg).__name__}")
    return msg


async def replay_hello(offer: LaneOffer, peer_id: Any, *, host: str = "127.0.0.1", copies: int = 2
                       ) -> list[LaneStream | None]:
    """One hello for ``offer`` sent on ``copies`` TCP connections at once, split so that every stage task has read
    the token before any has the whole hello (issue 15, item 1): the lanes that got ready (at most one may)."""
    socks = [await trio.open_tcp_stream(host, offer.port) for _ in range(copies)]
    hello, nonce = seal_hello(offer.token, offer.key)
    for part in (hello[:20], hello[20:]):
        for sock in socks:
            await sock.send_all(part)
        await trio.sleep(0.02)
    ready = [await ready_after_hello(sock, offer, nonce, peer_id) for sock in socks]
    for sock, lane in zip(socks, ready):
        if lane is None:
            await sock.aclose()
    return ready


async def raw_stage_stream(node: Any, peer_id: Any, addrs: Any = ()) -> FramedStream:
    """A libp2p ``/sangama/stage/2`` stream to ``peer_id``, connecting first (no lane, no client logic)."""
    await node.connect(peer_id, addrs)
    return FramedStream(await node.host.new_stream(peer_id, [STAGE_PROTOCOL]))


def open_session(sid: bytes, client: str, length: int = 16, *, model_id: str, start: int, end: int
                 ) -> OpenSession:
    """A greedy ``OpenSession`` for ``[start, end)`` that only its client steps (no previous or next hop)."""
    return OpenSession(sid, model_id, start, end, None, None, client, length, 0.0, 1.0, 0, 0, False)


def non_finite_hidden(rows: int, width: int, value: float = float("nan"), *, at: int = 0) -> Tensor:
    """fp32 hidden states of ``rows`` x ``width`` zeros with one ``value`` (NaN or Inf) at flat index ``at``."""
    data = bytearray(rows * width * 4)
    struct.pack_into("<f", data, 4 * at, value)
    return Tensor("fp32", (rows, width), bytes(data))


# ---- fuzzed frames ----------------------------------------------------------------------------------------------
FUZZ_KINDS = ("random", "bitflip", "truncated", "oversized", "version", "trailing", "empty")


def _valid(rng: random.Random, width: int) -> bytes:
    sid = rng.randbytes(16)
    msg = rng.choice([
        InfoRequest(), CloseSession(sid),
        open_session(sid, "fuzz", rng.randint(1, 64), model_id="m", start=0, end=rng.randint(1, 8)),
        Step(sid, rng.randint(0, 9), rng.randint(0, 99), (1, 2), Tensor("fp32", (2, width), bytes(8 * width)), (), ()),
    ])
    return encode_message_frame(msg)


def fuzz_frame(rng: random.Random, kind: str, *, width: int = 8, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """One malformed frame of ``kind`` (see :data:`FUZZ_KINDS`); "truncated" is meant to be followed by an end of
    stream, "oversized" announces more than ``max_frame`` and sends a little of it."""
    if kind == "random":
        body = rng.randbytes(rng.randint(1, 2048))
        return struct.pack(">I", len(body)) + body
    if kind == "oversized":
        return struct.pack(">I", rng.randint(max_frame + 1, 0xFFFFFFFF)) + rng.randbytes(64)
    if kind == "empty":
        return struct.pack(">I", 0)
    frame = bytearray(_valid(rng, width))
    if kind == "bitflip":  # distinct bits: two flips of one bit would give the valid frame back
        for bit in rng.sample(range(8 * (len(frame) - 4)), rng.randint(1, 8)):
            frame[4 + bit // 8] ^= 1 << (bit % 8)
    elif kind == "truncated":
        frame = frame[: rng.randrange(4, len(frame))]
    elif kind == "version":
        frame[4] = rng.choice([b for b in range(256) if b != frame[4]])
    elif kind == "trailing":
        frame += rng.randbytes(rng.randint(1, 64))
        frame[:4] = struct.pack(">I", len(frame) - 4)
    else:
        raise ValueError(f"unknown fuzz kind {kind!r}")
    return bytes(frame)


def decodes(frame: bytes) -> bool:
    """Whether ``frame`` is in fact a well-formed message (a bit flip in a session id leaves one): any answer to it
    is a fair one, where a malformed frame must get an error or a closed stream."""
    if len(frame) < 4 or struct.unpack(">I", frame[:4])[0] != len(frame) - 4:
        return False
    try:
        decode(frame[4:])
    except WireError:
        return False
    return True


async def answer_of(fs: FramedStream, timeout: float) -> str:
    """How the stage answered on ``fs`` within ``timeout`` s: ``error:<CODE>``, ``reply:<Type>``, ``closed`` (end of
    stream or reset) or ``silent``."""
    with trio.move_on_after(timeout):
        try:
            msg = await fs.recv()
        except (StreamClosed, WireError, LaneError):
            return "closed"
        except SangamaError as exc:
            return f"raised:{type(exc).__name__}"
        if msg is None:
            return "closed"
        return f"error:{msg.code.name}" if isinstance(msg, ErrorMessage) else f"reply:{type(msg).__name__}"
    return "silent"
