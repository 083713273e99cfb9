"""``StageServer``: serve layers ``[start, end)`` of a model over ``/sangama/stage/2`` and ``/sangama/info/2``.

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
that neither opened the session nor feeds it, ``UNKNOWN_SESSION``, ``WRONG_MODEL``, ``BAD_POSITION``, ...); an
error about an accepted session goes to the client that owns it, wherever in the chain it happened.

Bounded resources (issue 15, item 5): sessions per peer (``CAPACITY`` naming the per-peer quota), idle sessions
freed after ``session_idle_s`` (``EXPIRED`` to an owner that comes back), lanes per peer, one
:class:`~sangama_p2p.wire.framing.ByteBudget` (``input_budget``) for the partial frames of every stream and lane,
an outbox of at most ``outbox_bytes`` per stream: while a stream's replies are over it, that stream is not read
(back-pressure), and at twice it the stream is closed; and one :class:`~sangama_p2p.stage.links.OutboxBudget`
(``outbox_budget``) for every outbox together, which fails the largest queues (closing their streams) to make room.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Any

import trio

from .._version import __version__
from ..errors import (ErrorCode, InvalidMessageError, LaneError, OutboxFull, SangamaError, StageError,
                      StreamClosed, WireError)
from ..model.device import resolve_device
from ..model.fingerprint import parts_of, stage_identity
from ..model.stage import StageModel
from ..net.lane import LaneDialer, LaneListener, lanes_offered
from ..net.movable import STAGE_MOVABLE_PROTOCOL, MovableAcceptor
from ..net.seam import Network
from ..net.stage_stream import open_stage_stream
from ..net.streams import FramedStream, MemoryStream, memory_stream_pair
from ..wire.messages import (CloseSession, ErrorMessage, InfoRequest, InfoResponse, Message, OpenSession, SessionOpened,
                             Step, StepResult, TokenLogprobs, TraceStamp)
from ..wire.framing import ByteBudget
from ..wire.protocols import INFO_PROTOCOL, STAGE_PROTOCOL
from .announce import StageAnnouncer
from .config import StageConfig
from .grammars import Grammars
from .links import SMALL_ITEM, Item, NextHops, Outbox, OutboxBudget, tensor_bytes
from .neighbours import LinkMeter
from .scheduler import Job, Outcome, Scheduler, measure_step
from .sessions import SessionTable, StageSession
from .steps import check_step, ring_steps

__all__ = ["StageServer"]

log = logging.getLogger(__name__)


class StageServer:
    """One stage served on one node; an ``async with`` object (see the module docstring)."""

    def __init__(self, node: Network, model: Any, config: StageConfig, identity: Any = None) -> None:
        """``model``: a loaded :class:`~sangama_p2p.model.stage.StageModel` for ``config.start``..``config.end``;
        ``identity``: its checkpoint's :class:`~sangama_p2p.model.fingerprint.ModelIdentity` (what the DHT record
        announces; :meth:`load` computes it, and a stage without one cannot announce)."""
        if (model.start, model.end) != (config.start, config.end):
            raise StageError(f"model holds layers {model.start}:{model.end}, config says {config.start}:{config.end}")
        self.node = node
        self.model = model
        self.config = config
        self.identity = identity
        self.grammars = Grammars()  # the last stage's: StageServer.load gives it the checkpoint's path
        self.peer_id: str = node.peer_id.to_base58()
        self.table = SessionTable(model, config, identity.fingerprint if identity is not None else None)
        self.scheduler = Scheduler(model, self._deliver, max_batch_sessions=config.max_batch_sessions,
                                   max_batch_tokens=config.max_batch_tokens, wire_dtype=config.wire_dtype,
                                   inline_max_s=_inline_max_s(model, config))
        self._nursery: trio.Nursery | None = None
        self._nursery_cm: Any = None
        self._retired = False  # a successor stage took over the node's handlers (retire)
        self._inbound: dict[FramedStream, Outbox] = {}
        self.outbox_budget = OutboxBudget(config.outbox_budget)
        self.next_hops = NextHops(self._open_next, spawn=self._spawn, report=self._report,
                                  max_bytes=config.outbox_bytes, budget=self.outbox_budget)
        self._measured_step_s = 0.0
        self.input_budget = ByteBudget(config.input_budget, per_peer=config.input_share,
                                       partial_timeout=config.partial_frame_s, partial_rate=config.partial_frame_rate)
        self.announcer: Any = None
        self.link_meter = LinkMeter(self)
        self.lane_listener: LaneListener | None = None
        self.lanes = LaneDialer(node, enabled=config.lanes, timeout=config.lane_timeout, max_frame=config.max_frame)

    @classmethod
    def load(cls, node: Network, checkpoint: Any, config: StageConfig) -> StageServer:
        """Load only this stage's tensors from ``checkpoint`` (a ``model.checkpoint.Checkpoint``) and fingerprint
        the checkpoint (metadata, content samples, and the full bytes of the parts loaded); blocking."""
        model = StageModel.load(checkpoint.spec, checkpoint.source, config.start, config.end, dtype=config.dtype,
                                device=resolve_device(config.device), batch_invariant=config.batch_invariant,
                                fused=config.fused)
        t0 = time.perf_counter()
        identity = stage_identity(checkpoint.spec, checkpoint.source, parts_of(model.loaded_names))
        log.info("checkpoint fingerprint %s (%d layers), %d parts hashed in %.2f s", identity.fingerprint,
                 identity.num_layers, len(identity.layer_hashes), time.perf_counter() - t0)
        server = cls(node, model, config, identity)
        server.grammars.checkpoint_path = checkpoint.path if model.is_last else None  # grammars: the last stage's
        return server

    # ---- lifetime ------------------------------------------------------------------------------------------
    async def __aenter__(self) -> StageServer:
        self._nursery_cm = trio.open_nursery()
        self._nursery = await self._nursery_cm.__aenter__()
        try:
            if self.config.measure_on_start:
                self._measured_step_s = await trio.to_thread.run_sync(measure_step, self.model)
            self.node.serve(STAGE_PROTOCOL, self._on_stage_stream)
            # the same stage streams, able to move from a relay to a hole-punched connection (net/movable.py)
            self.node.serve(STAGE_MOVABLE_PROTOCOL, MovableAcceptor(self._on_stage_stream).handle)
            self.node.serve(INFO_PROTOCOL, self._on_info_stream)
            if self.config.lanes and lanes_offered(self.node, self.config.lane_port):
                self.lane_listener = LaneListener(self.node, self._on_stage_stream, port=self.config.lane_port,
                                                  max_frame=self.config.max_frame, budget=self.input_budget,
                                                  max_lanes_per_peer=self.config.max_lanes_per_peer)
                await self._nursery.start(self.lane_listener.run)
            self._nursery.start_soon(self.scheduler.run)
            self._nursery.start_soon(self._expire_idle)
            if self.config.announce and getattr(self.node, "dht", None) is not None:
                self.announcer = StageAnnouncer(self)
                await self.announcer.publish()
                self._nursery.start_soon(self.announcer.run)
                self.link_meter.on_change = self.announcer.publish_soon  # new round trips: re-publish at once
                self._nursery.start_soon(self.link_meter.run)
        except BaseException as exc:
            await self.__aexit__(type(exc), exc, exc.__traceback__)
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        nursery, cm = self._nursery, self._nursery_cm
        if nursery is None:
            return
        self._nursery = None
        with trio.CancelScope(shield=True):
            await self._shutdown()
        nursery.cancel_scope.cancel()
        await cm.__aexit__(*exc)

    async def aclose(self) -> None:
        """Stop serving: unregister the handlers, reset the streams, free every session."""
        await self.__aexit__(None, None, None)

    async def run(self) -> None:
        """Serve until cancelled."""
        async with self:
            await trio.sleep_forever()

    async def retire(self) -> None:
        """Make way for a successor stage on the same node (a peer moving to another range, ``peer.py``): stop
        announcing this range (the successor's record, newer, replaces it) and offering lanes (the port is free
        when this returns), and leave the protocol handlers at close to whoever registered them last. Streams and
        sessions already open keep running here until :meth:`aclose` (bound their draining with
        :attr:`open_sessions`)."""
        self._retired = True
        if self.announcer is not None:
            self.announcer.withdraw()  # for good: its refresh loop publishes nothing more
        if self.lane_listener is not None:
            self.lane_listener.stop()
            with trio.move_on_after(2):
                while self.lane_listener.bound_port:  # closed by its task, once the stop reaches it
                    await trio.sleep(0.01)

    async def _shutdown(self) -> None:
        retired = self._retired
        if self.lane_listener is not None and not retired:
            self.lane_listener.stop()
        for proto in (STAGE_PROTOCOL, STAGE_MOVABLE_PROTOCOL, INFO_PROTOCOL):
            if not retired:  # a successor serves them now
                self.node.stop_serving(proto)
        if self.announcer is not None:
            self.announcer.withdraw()
        streams = [*self._inbound, *self.next_hops.streams()]
        self._inbound.clear()
        with trio.move_on_after(2):
            async with trio.open_nursery() as nursery:
                for fs in streams:
                    nursery.start_soon(partial(fs.aclose, reset=True))
        self.next_hops.clear()
        self.table.drop_all()

    async def _expire_idle(self) -> None:
        """Free sessions without a step for ``session_idle_s``, checking a few times per that period."""
        every = min(max(self.config.session_idle_s / 4, 0.05), 10.0)
        while True:
            await trio.sleep(every)
            for s in self.table.expire_idle():
                log.info("session %s of %s expired after %g s without a step", s.session_id.hex()[:12], s.owner,
                         self.config.session_idle_s)

    # ---- figures -------------------------------------------------------------------------------------------
    @property
    def free_sessions(self) -> int:
        return self.table.free_sessions

    @property
    def open_sessions(self) -> int:
        return len(self.table.sessions)

    def link_kinds(self) -> dict[str, int]:
        """How many of this stage's streams (from upstream peers and to next hops) are direct lanes, libp2p
        streams or in-process streams (for status panels)."""
        kinds = {"lane": 0, "libp2p": 0, "local": 0}
        for fs in [*self._inbound, *self.next_hops.streams()]:
            kinds[fs.link_kind] += 1
        return kinds

    @property
    def queue_length(self) -> int:
        return self.scheduler.queue_length

    @property
    def throughput(self) -> float:
        """Steps per second one session gets here: 1 / the smoothed duration of a decode-like step (batched
        steps count once: each session in the batch advances one step; prefills are left out), or of the one-token
        step measured at start before any. One token per step without guesses, up to ``1 + guesses`` with them.
        What the DHT record (``tps``) and ``InfoResponse.throughput`` announce, and what routing divides by."""
        step_s = self.scheduler.stats.ewma_step_s or self._measured_step_s
        return 1.0 / step_s if step_s > 0 else 0.0

    def info(self) -> InfoResponse:
        """What ``/sangama/info/2`` answers: range, measured throughput, free sessions, queue length, version."""
        return InfoResponse(self.peer_id, self.config.model_id, self.model.start, self.model.end,
                            float(self.throughput), self.free_sessions, self.queue_length, __version__)

    # ---- streams -------------------------------------------------------------------------------------------
    async def open_local_stream(self) -> MemoryStream:
        """An in-process stage stream to this server, for a client on the same node (libp2p cannot dial itself).

        Pass it to the client as ``ChainClient(node, config, local_stage=server.open_local_stream)``.
        """
        if self._nursery is None:
            raise StageError("the stage server is not running")
        mine, theirs = memory_stream_pair(self.node.peer_id, self.node.peer_id)
        await self._on_stage_stream(theirs)
        return mine

    async def _on_info_stream(self, stream: Any) -> None:
        fs = FramedStream(stream, max_frame=4096)
        try:
            with trio.move_on_after(10):
                msg = await fs.recv()
                reply: Message = self.info() if isinstance(msg, InfoRequest) else ErrorMessage(
                    None, None, ErrorCode.BAD_FRAME, "expected an InfoRequest")
                await fs.send(reply)
        except (SangamaError, trio.BrokenResourceError) as exc:
            log.debug("info request from %s failed: %s", fs.peer, exc)
        finally:
            await fs.aclose()

    async def _on_stage_stream(self, stream: Any) -> None:
        if self._nursery is None:
            await FramedStream(stream).aclose(reset=True)
            return
        fs = FramedStream(stream, max_frame=self.config.max_frame, budget=self.input_budget)
        outbox = Outbox(fs, max_bytes=self.config.outbox_bytes, budget=self.outbox_budget, on_failed=self._reset)
        self._inbound[fs] = outbox
        self._nursery.start_soon(outbox.run)
        self._nursery.start_soon(self._serve_inbound, fs, outbox)

    def _reset(self, outbox: Outbox, lost: list[Item], exc: BaseException) -> None:
        """A reply outbox failed (full, evicted or its write failed): reset its stream now, which ends its reader."""
        if outbox.stream is not None and not outbox.stream.closed:
            self._spawn(partial(outbox.stream.aclose, reset=True))

    async def _serve_inbound(self, fs: FramedStream, outbox: Outbox) -> None:
        """Read frames from one peer (a client or the previous stage) until the stream ends."""
        try:
            while True:
                if outbox.congested:  # back-pressure: no more reading while this peer's replies do not drain
                    await outbox.wait_uncongested()
                if outbox.failed is not None:
                    log.info("stream from %s closed: %s", fs.peer, outbox.failed)
                    break
                try:
                    msg = await fs.recv()
                except InvalidMessageError as exc:
                    if exc.session_id is None:
                        raise
                    outbox.put(ErrorMessage(exc.session_id, exc.step, ErrorCode.BAD_FRAME, str(exc)))
                    continue
                if msg is None:
                    break
                self._dispatch(fs, outbox, msg, time.monotonic_ns())
        except StreamClosed:  # the stream ended or was reset: nobody left to answer
            pass
        except LaneError as exc:  # a record on its lane failed authentication: the lane is over, nothing to answer
            log.info("lane from %s failed: %s", fs.peer, exc)
        except Exception as exc:  # a bug must cost this stream, not every session of the stage
            if not isinstance(exc, WireError):
                log.exception("stream from %s failed", fs.peer)
            code = exc.code if isinstance(exc, SangamaError) else ErrorCode.INTERNAL
            outbox.put(ErrorMessage(None, None, code, str(exc)[:1000]))
        finally:
            self._inbound.pop(fs, None)
            self.table.drop_reply_stream(outbox)
            outbox.close()
            with trio.CancelScope(shield=True), trio.move_on_after(2):  # closed even when the stage is cancelled (a
                with trio.move_on_after(1):  # moved stage drained): else its peer keeps a link nobody reads
                    await outbox.done.wait()  # the writer flushes what is queued before the close
                await fs.aclose()

    def _dispatch(self, fs: FramedStream, outbox: Outbox, msg: Message, recv_ns: int) -> None:
        peer = fs.peer
        if isinstance(msg, Step):
            self._on_step(peer, outbox, msg, recv_ns, alone=not fs.has_frames)
        elif isinstance(msg, OpenSession) and msg.grammar is not None:
            self._spawn(self._open_constrained, outbox, msg, fs)  # the client steps it only once it is open
        elif isinstance(msg, OpenSession):
            try:
                session = self.table.open(msg, peer, outbox, source=fs.source)  # counted per address too (Sybils)
            except StageError as exc:
                outbox.put(ErrorMessage(msg.session_id, None, exc.code, str(exc)))
                return
            outbox.put(SessionOpened(msg.session_id, self.free_sessions))
            if self.model.is_last and session.ring not in (None, self.peer_id):
                self.next_hops.get(session.ring)  # dialled now: the ring's first hand-on does not wait for it
        elif isinstance(msg, CloseSession):
            try:
                self.table.close(msg.session_id, peer)
            except StageError as exc:
                outbox.put(ErrorMessage(msg.session_id, None, exc.code, str(exc)))
        elif isinstance(msg, InfoRequest):
            outbox.put(self.info())
        elif isinstance(msg, ErrorMessage):
            log.debug("error from %s: %s %s", peer, msg.code.name, msg.message)
        else:
            sid = getattr(msg, "session_id", None)
            outbox.put(ErrorMessage(sid, getattr(msg, "step", None), ErrorCode.BAD_FRAME,
                                    f"a stage does not accept {type(msg).__name__}"))

    def _on_step(self, peer: str, outbox: Outbox, msg: Step, recv_ns: int, *, alone: bool = False) -> None:
        try:
            session = self.table.authorize_step(msg.session_id, peer)
        except StageError as exc:
            outbox.put(ErrorMessage(msg.session_id, msg.step, exc.code, str(exc)))
            return
        self._take_step(session, peer, msg, recv_ns, alone)

    def _take_step(self, session: StageSession, peer: str, msg: Step, recv_ns: int, alone: bool = False) -> None:
        try:
            check_step(self.model, session, msg)
        except StageError as exc:
            self._to_owner(session, ErrorMessage(msg.session_id, msg.step, exc.code, str(exc)))
            return
        self.scheduler.submit(Job(session, msg, recv_ns), alone=alone)
        if msg.ring and self.model.is_first:  # the owner sees what entered the chain (the ring may have handed it on)
            self._to_owner(session, Step(msg.session_id, msg.step, msg.start_pos, msg.token_ids, None, msg.guesses,
                                         (), ring=True))

    # ---- results -------------------------------------------------------------------------------------------
    def _deliver(self, job: Job, out: Outcome) -> None:
        """A job left the worker: forward its hidden states, answer the client, or report its error."""
        session, m = job.session, job.msg
        if session.closed:
            return
        if out.error is not None:
            self._to_owner(session, ErrorMessage(m.session_id, m.step, out.error[0], out.error[1]))
            return
        me, recv, cs, ce, bs = self.peer_id, job.recv_ns, out.compute_start_ns, out.compute_end_ns, out.batch_size

        def stamp() -> TraceStamp:
            return TraceStamp(me, recv, cs, ce, time.monotonic_ns(), bs)

        if out.last is not None:
            res = out.last
            scores = tuple(TokenLogprobs(*s) for s in res.logprobs)
            answer = lambda: StepResult(m.session_id, m.step, res.tokens, res.guesses,  # noqa: E731
                                        (*m.trace, stamp()), scores)
            handed = ring_steps(session, m, res) if m.ring and session.ring is not None else []
            if session.ring == self.peer_id:  # a one-stage chain closes the ring on itself
                self._to_owner(session, answer)
                for nxt in handed:
                    self._take_step(session, self.peer_id, nxt, time.monotonic_ns())
                return
            for nxt in handed:  # the next trips first: they are the ones on the way
                self._send_on(session, m, session.ring or "", lambda s=nxt: s, SMALL_ITEM, "the ring's first stage")
            self._to_owner(session, answer)
            return
        hidden = out.hidden
        item = lambda: Step(m.session_id, m.step, m.start_pos, m.token_ids, hidden, m.guesses,  # noqa: E731
                            (*m.trace, stamp()), m.ring)
        self._send_on(session, m, session.next_hop or "", item, SMALL_ITEM + tensor_bytes(hidden), "next hop")

    def _send_on(self, session: StageSession, m: Step, peer: str, item: Item, nbytes: int, what: str) -> None:
        """Queue ``item`` for the stage ``peer`` (the next hop, or the ring's first stage); the owner hears of a
        link that does not take it."""
        link = self.next_hops.get(peer)
        if not link.put(item, nbytes):
            # alive but not draining, or failed for holding the most of the outbox budget: OVERLOADED, else INTERNAL
            stuck = link.failed is None and link.congested
            why = f"does not take its frames ({link.queued_bytes} bytes queued)" if stuck else "is unreachable"
            if isinstance(link.failed, OutboxFull):
                stuck, why = True, f"does not take its frames ({link.failed})"
            code = ErrorCode.OVERLOADED if stuck else ErrorCode.INTERNAL
            self._to_owner(session, ErrorMessage(m.session_id, m.step, code, f"{what} {peer} {why}"))

    def _to_owner(self, session: StageSession, item: Item) -> None:
        session.reply.put(item)

    def _report(self, msg: ErrorMessage) -> None:
        """An error about a session (from or about its next hop) goes to the session's owner."""
        session = self.table.sessions.get(msg.session_id) if msg.session_id is not None else None
        if session is not None:
            self._to_owner(session, msg)

    async def _open_constrained(self, outbox: Outbox, msg: OpenSession, fs: FramedStream) -> None:
        error = await self.grammars.open(self.table, msg, fs, outbox)  # checks, compile, open (stage/grammars.py)
        outbox.put(error or SessionOpened(msg.session_id, self.free_sessions))

    def _spawn(self, fn: Any, *args: Any) -> None:
        if self._nursery is not None:
            self._nursery.start_soon(fn, *args)

    async def _open_next(self, peer: str) -> FramedStream:
        """Reach the next stage (with its serving record's /p2p-circuit addresses from the DHT when no relay address
        is known) and open the long-lived stream: a direct lane where it offers one, else a libp2p stream."""
        return await open_stage_stream(self.node, self.lanes, peer, model_id=self.config.model_id,
                                       timeout=self.config.next_hop_timeout, max_frame=self.config.max_frame,
                                       budget=self.input_budget)


def _inline_max_s(model: Any, config: StageConfig) -> float:
    """Short steps run on the event loop's thread on a CPU stage only: a CUDA step ends in a device synchronisation
    (its tokens or hidden states copied to the host), which would block every stream of the stage meanwhile."""
    device = getattr(model, "device", None)
    kind = getattr(device, "type", str(device).split(":")[0]) if device is not None else "cpu"
    return config.inline_step_s if kind == "cpu" else 0.0
