"""``Peer``: one object that serves a layer range, drives generations, or both; it owns every lifetime under it.

Under trio::

    async with Peer(PeerConfig(host=HostConfig(bootstrap_addrs=(addr,)))) as peer:
        await peer.serve("/models/qwen", "0:20")            # or "auto": the range the swarm covers worst
        result = await peer.generate("Hello", 32, guesses="auto")
        async for token_id in peer.stream([1, 2, 3], 16):
            ...

A peer is a libp2p node (:func:`sangama_p2p.net.open_host`) plus at most one stage server
(:class:`sangama_p2p.stage.StageServer`: a node has one handler per protocol id, so a second stage would take the
first one's streams; run another peer for another range; an ``auto`` range moves by handing the handlers to a new
stage, :mod:`sangama_p2p.stage.rebalance`) and one chain client per model (:class:`sangama_p2p.client.ChainClient`).
Each server and client lives in a task of the peer's own nursery, whichever task asked for it, so the asyncio face
(:mod:`sangama_p2p.aio`) can call ``serve`` from any job; ``aclose`` cancels them all, then closes the host.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import trio

from .api.server import ApiConfig, ApiServer, ServedModel, served_model
from .client.config import ClientConfig
from .client.generate import ChainClient, GenerationResult
from .config import PeerConfig, default_model_id
from .errors import LayerRangeError, ModelError, SangamaError, StageError
from .model.chat_model import open_chat_model
from .model.checkpoint import Checkpoint, open_checkpoint
from .model.constraint import json_grammar
from .model.fingerprint import stage_identity
from .model.memory import auto_span
from .model.pin import EMBEDDED_HOW, Pin, local_pin, require_pin
from .model.spec import ModelSpec, parse_auto_span, parse_layer_range
from .model.tokenizer import Tokenizer
from .net.host import open_host
from .net.identity import KeyPair
from .net.logs import keep_probe_hang_ups_quiet
from .net.node import Node
from .net.traversal import Traversal, TraversalConfig
from .placement.rebalance import thinnest_range
from .stage.config import StageConfig
from .stage.rebalance import Rebalancer, live_ranges
from .stage.server import StageServer

# PeerConfig, default_model_id: from sangama_p2p.config, named here too (``from sangama_p2p.peer import PeerConfig``)
__all__ = ["Generation", "Peer", "PeerConfig", "choose_layers", "default_model_id"]

log = logging.getLogger(__name__)


def choose_layers(covered: Sequence[tuple[int, int]], num_layers: int, span: int | None = None,
                  speeds: Sequence[float] | None = None) -> tuple[int, int]:
    """Up to ``span`` layers where the swarm is thinnest, given the ``(start, end)`` ranges already served (and the
    steps/s their peers announce, ``speeds``): the first gap from its start (never past it), else a spare at an
    existing boundary where the least is served (:func:`sangama_p2p.placement.rebalance.thinnest_range`). ``span``
    defaults to a third of the model (rounded up). Pure; LayerRangeError on a bad depth or span."""
    span = -(-num_layers // 3) if span is None and num_layers > 0 else span
    if num_layers <= 0 or not 0 < (span or 0) <= num_layers:
        raise LayerRangeError(f"the model has no layers or span {span} is not in 1..{num_layers}")
    return thinnest_range(covered, num_layers, span, speeds)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Generation:
    """One generation's outcome: new token ids, their text (when a tokenizer is known), and the client's result
    (trips with their timings, route, failovers, guess counts)."""

    tokens: tuple[int, ...]
    text: str | None
    result: GenerationResult


class Peer:
    """A Sangama peer under trio: ``async with Peer(config) as peer`` (see the module docstring)."""

    def __init__(self, config: PeerConfig | None = None, *, key_pair: KeyPair | None = None) -> None:
        """``key_pair``: a libp2p key pair to use instead of ``config.host.key_path`` (e.g. a throwaway identity)."""
        self.config = config or PeerConfig()
        self._key_pair = key_pair
        self.traversal: Traversal | None = None  # when the peer has bootstrap nodes
        self.node: Node | None = None
        self.servers: list[StageServer] = []  # in the order served
        self._server_scopes: dict[int, trio.CancelScope] = {}  # id(server) -> the scope of its task
        self.rebalancer: Rebalancer | None = None  # serving "auto" layers: re-checks the swarm and moves
        self._clients: dict[str, tuple[ChainClient, trio.CancelScope]] = {}
        self._client_lock = trio.Lock()
        self._stack: AsyncExitStack | None = None
        self._nursery: trio.Nursery | None = None
        self._tokenizer: Tokenizer | None = None
        self._eos: tuple[int, ...] = ()
        self._spec_num_layers: int | None = None
        self._pin_sources: dict[str, Path] = {}  # model id -> the checkpoint serve_api was given (its client's pin)
        self._auto_span: int | None = None  # the span --layers auto took (rebalancing keeps it)

    # lifetime ---------------------------------------------------------------------------------------------------

    async def __aenter__(self) -> Peer:
        keep_probe_hang_ups_quiet()
        stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            services = []
            if self.config.host.bootstrap_addrs:
                # learn reachability from the bootstrap nodes; if private, hold relay reservations, advertise the
                # /p2p-circuit addresses, and hole-punch relayed links (net/traversal.py)
                self.traversal = Traversal(TraversalConfig())
                services.append(self.traversal.run)
            self.node = await stack.enter_async_context(
                open_host(self.config.host, key_pair=self._key_pair, services=services)
            )
            self._nursery = await stack.enter_async_context(trio.open_nursery())
            self._stack = stack
            if self.config.tokenizer_path is not None:
                await trio.to_thread.run_sync(self._load_tokenizer, self.config.tokenizer_path)
            if self.config.model_path is not None:
                await self.serve(self.config.model_path, self.config.layers)
        except BaseException:
            self._stack = None
            await self._close(stack)
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop serving, close every client session, then the host. Idempotent."""
        stack, self._stack = self._stack, None
        if stack is not None:
            await self._close(stack)

    async def _close(self, stack: AsyncExitStack) -> None:
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()
        await stack.aclose()  # nursery first (servers and clients end), then the host
        self._nursery = None

    def _running(self) -> trio.Nursery:
        if self._nursery is None or self._stack is None:
            raise SangamaError("the peer is not running (use `async with Peer(...)`)")
        return self._nursery

    @property
    def peer_id(self) -> str:
        if self.node is None:
            raise SangamaError("the peer is not running")
        return self.node.peer_id.to_base58()

    @property
    def addrs(self) -> list[str]:
        """Addresses other peers dial (ending in ``/p2p/<id>``); pass one as another peer's bootstrap address."""
        if self.node is None:
            raise SangamaError("the peer is not running")
        return [str(a) for a in self.node.advertised_addrs()]

    # serving ----------------------------------------------------------------------------------------------------

    async def serve(
        self,
        model: str | Path,
        layers: str | tuple[int, int] = "auto",
        *,
        model_id: str | None = None,
        tokenizer: bool = True,
        **stage_options: Any,
    ) -> tuple[int, int]:
        """Load and serve ``layers`` of the checkpoint at ``model``; returns the served ``(start, end)``.

        ``layers``: ``(start, end)``, ``"A:B"``, ``"auto"`` (the third of the model the swarm covers worst) or
        ``"auto:N"`` (N layers). Loading reads only this range's tensors, off the trio thread. The stage announces
        itself in the DHT and serves until the peer closes. ``tokenizer``: also keep the model's tokenizer for this
        peer's own text prompts (:meth:`generate`); a peer that only serves passes False and saves its memory (the
        stages never need it: 22 MiB of RSS for SmolLM2's 49k-token vocabulary, measured).
        """
        nursery = self._running()
        if self.servers:
            s = self.servers[0].config
            raise StageError(f"this peer already serves {s.model_id} {s.start}:{s.end}; a peer serves one stage "
                             "(its node has one /sangama/stage/2 handler): run another peer for another range")
        want = tokenizer and self._tokenizer is None
        ckpt = await trio.to_thread.run_sync(partial(open_checkpoint, model, tokenizer=want))
        num_layers = ckpt.spec.num_layers
        if want and ckpt.tokenizer is not None:
            self._tokenizer, self._eos = ckpt.tokenizer, tuple(ckpt.spec.eos_token_ids)
        self._spec_num_layers = num_layers
        # the configured stage settings are a template: model id (unless given) and range come from this call
        template = self.config.stage
        mid = model_id or (template.model_id if template is not None else default_model_id(model))
        base = template or StageConfig(model_id=mid, start=0, end=1)
        start, end = await self._resolve_layers(layers, mid, num_layers, ckpt)
        ckpt.spec.check_range(start, end)
        config = base.replace(model_id=mid, start=start, end=end, **stage_options)
        server = await trio.to_thread.run_sync(StageServer.load, self.node, ckpt, config)
        await self._start_server(server)
        if str(layers).startswith("auto") and self.config.rebalance_every > 0 and server.identity is not None:
            self.rebalancer = Rebalancer(self.node, mid, server.identity.fingerprint, num_layers=num_layers,
                                         span=self._auto_span or -(-num_layers // 3), current=self._served_range,
                                         move=partial(self._move, ckpt), every=self.config.rebalance_every)
            nursery.start_soon(self.rebalancer.run)
            if self.traversal is not None:  # `status` shows the moves (/sangama/links/1)
                self.traversal.report_extra = lambda: {"rebalance": self.rebalancer.report() if self.rebalancer else {}}
        await self._drop_client(mid)
        return start, end

    async def _start_server(self, server: StageServer) -> None:
        self._server_scopes[id(server)] = await self._running().start(self._run_inside, server)
        self.servers = [server]
        if self.traversal is not None and server.announcer is not None:
            self.traversal.listeners.append(server.announcer.publish_soon)  # new circuit address: re-publish now
            # the first record was signed before this listener existed, and storing it on the DHT can take seconds
            # (NATed peers in the routing table): a reservation granted meanwhile would otherwise wait for the next
            # periodic re-publish (announce_every, 60 s) - measured: `ready` 67 s after start instead of ~5 s
            if set(server.announcer.published_addrs()) != {str(a) for a in self.node.advertised_addrs()}:
                server.announcer.publish_soon()

    def _served_range(self) -> tuple[int, int]:
        return self.servers[0].config.start, self.servers[0].config.end

    async def _move(self, ckpt: Checkpoint, start: int, end: int) -> None:
        """Serve ``start:end`` instead (the rebalancer decided): load it beside the old stage (same open checkpoint;
        no layer is shared between the two), retire the old one (no more records or lanes), start the new one (its
        handlers take the node's new streams, then it publishes its record), and let the old one's sessions drain
        for ``rebalance_drain_s`` before it closes (a client cut off then fails over and replays: same tokens)."""
        old = self.servers[0]
        config = old.config.replace(start=start, end=end)
        ckpt.spec.check_range(start, end)
        new = await trio.to_thread.run_sync(StageServer.load, self.node, ckpt, config)
        await old.retire()
        if self.traversal is not None and old.announcer is not None:
            self.traversal.listeners.remove(old.announcer.publish_soon)
        await self._start_server(new)
        await self._drop_client(config.model_id)  # the next generation here routes through the new stage
        self._running().start_soon(self._drain, old)

    async def _drain(self, old: StageServer) -> None:
        with trio.move_on_after(self.config.rebalance_drain_s):
            while old.open_sessions:
                await trio.sleep(0.2)
        if old.open_sessions:
            log.info("closing the old stage %d:%d with %d sessions open after %g s", old.config.start,
                     old.config.end, old.open_sessions, self.config.rebalance_drain_s)
        self._server_scopes.pop(id(old)).cancel()

    async def wait_reachable(self, *, warn_every_s: float = 15.0) -> str:
        """Wait until others can reach this peer's stage: reachability known, and public or with a ``/p2p-circuit``
        address in its published record. Returns ``"direct"`` or ``"relayed"``; warns while it waits."""
        t = self.traversal
        if t is None:
            return "direct"
        waited = 0.0
        while True:
            with trio.move_on_after(warn_every_s):
                await t.wait_ready()
                while True:
                    if t.reachable():
                        if t.reachability.value == "public":
                            return "direct"
                        if all(any("/p2p-circuit" in a for a in s.announcer.published_addrs())
                               for s in self.servers if s.announcer is not None):
                            return "relayed"
                    await trio.sleep(0.05)
            waited += warn_every_s
            log.warning("not reachable yet after %.0f s (reachability %s, circuit addresses %s): waiting for a relay "
                        "reservation", waited, t.reachability.value, [str(a) for a in self.node.extra_addrs])

    async def _resolve_layers(self, layers: str | tuple[int, int], model_id: str, num_layers: int,
                              ckpt: Checkpoint | None = None) -> tuple[int, int]:
        if isinstance(layers, tuple):
            return int(layers[0]), int(layers[1])
        text = str(layers)
        if not text.startswith("auto"):
            r = parse_layer_range(text)
            return r.start, r.end
        device = self.config.stage.device if self.config.stage is not None else "cpu"
        span = self._auto_span = parse_auto_span(text, num_layers) or (
            await trio.to_thread.run_sync(auto_span, ckpt, device) if ckpt else None)
        # only peers of our own checkpoint count: others will never be chained with us
        mine = (await trio.to_thread.run_sync(stage_identity, ckpt.spec, ckpt.source)).fingerprint if ckpt else None
        # what the others serve as they answer now (a departed peer's record would hide its gap), a few asked of a
        # crowded range: a peer joining a swarm of N dials per range, not N
        live, records = await live_ranges(self.node, model_id, mine, num_layers)
        records = [r for r in records if r.peer_id in live]
        return choose_layers([live[r.peer_id] for r in records], num_layers, span, [r.throughput for r in records])

    @staticmethod
    async def _run_inside(resource: Any,
                          task_status: trio.TaskStatus[trio.CancelScope] = trio.TASK_STATUS_IGNORED) -> None:
        """Hold ``resource`` (a stage server or a chain client) open until the returned scope is cancelled."""
        with trio.CancelScope() as scope:
            async with resource:
                task_status.started(scope)
                await trio.sleep_forever()

    # generating -------------------------------------------------------------------------------------------------

    def _load_tokenizer(self, path: Path) -> None:
        if path.suffix == ".gguf" and path.is_file():  # the file's metadata only (no tensor is indexed)
            chat = open_chat_model(path)
            self._tokenizer, self._eos = chat.tokenizer, chat.eos_ids
            return
        self._tokenizer = Tokenizer.from_dir(path)
        try:
            self._eos = tuple(ModelSpec.from_dir(path).eos_token_ids)
        except SangamaError:
            self._eos = ()

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The tokenizer of the served model or of ``config.tokenizer_path`` (None when neither is known)."""
        return self._tokenizer

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt`` (text through the known tokenizer; ids pass through)."""
        if isinstance(prompt, str):
            if self._tokenizer is None:
                raise ModelError("text prompts need a tokenizer: serve a model or set tokenizer_path; "
                                 "or pass token ids")
            return list(self._tokenizer.encode(prompt))
        return [int(t) for t in prompt]

    def _default_model_id(self) -> str:
        if self.config.client is not None:
            return self.config.client.model_id
        if self.servers:
            return self.servers[0].config.model_id
        raise ModelError("which model? pass model_id=, or set PeerConfig.client, or serve one")

    async def client(self, model_id: str | None = None) -> ChainClient:
        """The chain client for ``model_id`` (created on first use, closed with the peer)."""
        model_id = model_id or self._default_model_id()
        nursery = self._running()
        async with self._client_lock:
            if model_id not in self._clients:
                base = self.config.client or ClientConfig(model_id=model_id)
                config = base.replace(model_id=model_id)
                own = [s for s in self.servers if s.config.model_id == model_id]
                if config.num_layers is None and own:
                    config = config.replace(num_layers=self._spec_num_layers)
                if config.fingerprint is None and own and own[0].identity is not None:
                    config = config.replace(fingerprint=own[0].identity.fingerprint)  # chain our own checkpoint
                config = await self._pinned(config)
                # our own stage joins our chains through an in-process stream (libp2p cannot dial itself)
                local = own[0].open_local_stream if own else None
                client = ChainClient(self.node, config, local_stage=local)
                scope = await nursery.start(self._run_inside, client)
                self._clients[model_id] = (client, scope)
        return self._clients[model_id][0]

    async def _pinned(self, config: ClientConfig) -> ClientConfig:
        """``config`` with the pin of the checkpoint ``serve_api`` was given for its model, else of ``tokenizer_path``
        when it is the checkpoint, when none is set; an unpinned
        model id in a public swarm is refused (:mod:`sangama_p2p.model.pin`)."""
        for source in (self._pin_sources.get(config.model_id), self.config.tokenizer_path):
            if config.fingerprint is None and source is not None:
                mine = await trio.to_thread.run_sync(local_pin, Path(source), None)
                config = config.replace(fingerprint=mine.fingerprint, num_layers=config.num_layers or mine.num_layers)
        require_pin(Pin(config.fingerprint), config.model_id, private=self.config.host.fleet_secret is not None,
                    how=EMBEDDED_HOW)
        return config

    async def _drop_client(self, model_id: str) -> None:
        """Close the client of ``model_id`` (e.g. after serving it: the next one routes through our own stage)."""
        async with self._client_lock:
            entry = self._clients.pop(model_id, None)
        if entry is not None:
            entry[1].cancel()

    def _gen_kwargs(self, kwargs: dict[str, Any], stop_at_eos: bool) -> dict[str, Any]:
        if stop_at_eos and "stop_tokens" not in kwargs:
            kwargs["stop_tokens"] = self._eos
        return kwargs

    async def generate(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        *,
        model_id: str | None = None,
        guesses: int | str = 0,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_at_eos: bool = True,
        on_tokens: Callable[[list[int]], None] | None = None,
        json_schema: Mapping[str, Any] | bool | None = None,
    ) -> Generation:
        """Generate through the swarm; greedy at ``temperature`` 0 gives the same tokens as ``generate --local``.

        ``guesses``: MTP guesses per trip, 0..8 or ``"auto"``. ``on_tokens(ids)``: called with each trip's new ids
        as they arrive. ``json_schema``: the new tokens are JSON that follows this schema (``True``: any JSON
        object), held to it at the last stage (no guesses then); ``ModelError`` for a schema that does not compile.
        Errors: :class:`RouteError` when no chain covers the model, :class:`StageError` when every stage refuses.
        """
        ids = self.encode(prompt)
        client = await self.client(model_id)
        kwargs = self._gen_kwargs({}, stop_at_eos)
        if json_schema is not None and json_schema is not False:
            kwargs["grammar"] = json_grammar(None if json_schema is True else dict(json_schema))  # type: ignore[arg-type]
        result = await client.generate(ids, max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                       guesses=guesses, on_tokens=on_tokens, **kwargs)
        text = self._tokenizer.decode(result.tokens) if self._tokenizer is not None else None
        return Generation(tuple(result.tokens), text, result)

    async def serve_api(self, model: str | Path | None = None, config: ApiConfig | None = None, *,
                        model_id: str | None = None, served: ServedModel | None = None) -> str:
        """Serve the OpenAI-compatible HTTP API (:mod:`sangama_p2p.api`) for one model until the peer closes;
        returns its base URL (``http://127.0.0.1:8000``; the ``/v1`` routes are under it).

        ``model``: the checkpoint directory or ``.gguf`` file whose tokenizer and chat template format requests
        (``served``: an :class:`~sangama_p2p.api.ServedModel` instead); ``config``: an
        :class:`~sangama_p2p.api.ApiConfig` (default: ``PeerConfig.api``, else port 8000 on 127.0.0.1).
        """
        nursery = self._running()
        if served is None:
            if model is None:
                raise SangamaError("serve_api needs the model's checkpoint (directory or .gguf file) or served=")
            served = await trio.to_thread.run_sync(served_model, model, model_id)
            self._pin_sources.setdefault(served.model_id, Path(model))  # its client chains that checkpoint
        config, mounts = config or self.config.api or ApiConfig(), {}
        if config.dashboard:  # the swarm's page at /dashboard/, surveyed by this peer, with its client's generations
            from .dashboard.server import watched_app

            stats = (await self.client(served.model_id)).stats
            mounts["/dashboard"] = await nursery.start(watched_app, self.node, [served.model_id],
                                                       self.config.host.bootstrap_addrs, lambda: list(stats.recent))
        return str(await nursery.start(ApiServer([served], self.client, config, mounts).serve))

    async def stream(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: int = 32,
        *,
        model_id: str | None = None,
        stop_at_eos: bool = True,
        **kwargs: Any,
    ) -> AsyncIterator[int]:
        """Yield each new token id as soon as its trip returns (same settings as :meth:`generate`)."""
        ids = self.encode(prompt)
        client = await self.client(model_id)
        async for tok in client.stream(ids, max_new_tokens, **self._gen_kwargs(kwargs, stop_at_eos)):
            yield tok
