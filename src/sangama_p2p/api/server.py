"""An OpenAI-compatible HTTP API over the swarm: starlette routes served by hypercorn's trio worker.

Routes: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream`` as
server-sent events ending in ``data: [DONE]``). Each request runs one :meth:`ChainClient.stream` on the one client per model,
so concurrent requests batch at the stages like concurrent ``generate`` calls. Chat prompts go through the
checkpoint's own template (:func:`sangama_p2p.model.chat.render_chat`) and end at its stop ids. Errors are
OpenAI's ``{"error": {...}}`` objects with the status :func:`~sangama_p2p.api.protocol.error_for` gives; a failure
after a stream started is sent as one ``data: {"error": ...}`` event, then the stream closes (no ``[DONE]``).
Before a request is parsed, :mod:`sangama_p2p.api.guard` checks its Host, Origin, Content-Type, body size and its
client's share; a request whose client hangs up (streamed or not) is cancelled, and its sessions close.

Embedding (trio)::

    server = ApiServer([served_model("/models/smol")], peer.client, ApiConfig(port=8000))
    url = await nursery.start(server.serve)       # "http://127.0.0.1:8000"

or simply ``url = await peer.serve_api("/models/smol")``.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import trio

from ..errors import ApiError, ModelError
from ..model.chat import render_chat
from ..model.chat_model import open_chat_model
from ..model.tokenizer import IncrementalDecoder
from ..model.tool_calls import ToolFormat, parse_tool_calls, prepare_messages, tool_format
from .config import ApiConfig
from .guard import ClientSlots, Gate, check_content_type, check_port, client_key, is_loopback, read_body
from .protocol import (ApiRequest, StopScanner, chat_response, completion_response, decode_body, error_body,
                       error_for, fit_context, new_id, parse_request, prompt_chars, usage)
from .stream import Run, events, logprobs_of, sangama_error
from .tools import CallScanner, tool_calls_json

__all__ = ["ApiConfig", "ApiServer", "ServedModel", "served_model"]

log = logging.getLogger(__name__)

# starlette and hypercorn are imported where the server starts and answers: they come with the optional `api` extra,
# and take 0.5 s to import (the package and `sangama-peer` work without them)


@dataclass(frozen=True)
class ServedModel:
    """A model the API offers: its swarm id, tokenizer, chat template and end-of-sequence ids."""

    model_id: str
    tokenizer: Any  # model.tokenizer.Tokenizer
    template: Any  # model.chat.ChatTemplate
    eos_ids: tuple[int, ...]
    created: int = field(default_factory=lambda: int(time.time()))
    context: int | None = None  # positions (max_position_embeddings); None: unknown

    @cached_property
    def tool_format(self) -> ToolFormat:
        """How the template lays tools out and writes calls (read from its source once)."""
        return tool_format(self.template.source)


def served_model(path: str | Path, model_id: str | None = None) -> ServedModel:
    """Tokenizer, template and eos ids of a checkpoint directory or ``.gguf`` file (the id: its name)."""
    p = Path(path).expanduser()
    m = open_chat_model(p)
    return ServedModel(model_id or (p.stem if p.suffix == ".gguf" else p.resolve().name), m.tokenizer, m.template,
                       m.eos_ids, context=m.context)


async def _while_connected(request: Any, work: Callable[[], Awaitable[None]]) -> bool:
    """Run ``work`` unless the client hangs up first (its body read, the next ASGI message is its disconnect):
    then ``work`` is cancelled and False returned."""
    gone = False
    async with trio.open_nursery() as nursery:
        async def watch() -> None:
            nonlocal gone
            while (await request.receive())["type"] != "http.disconnect":
                pass
            gone = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        await work()
        nursery.cancel_scope.cancel()
    return not gone


class _Released:
    """An ASGI response that calls ``release`` once it is over: sent, failed or its client gone."""

    def __init__(self, response: Any, release: Callable[[], None]) -> None:
        self.response, self.release = response, release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.release()
            await self.response.body_iterator.aclose()


class ApiServer:
    """The ASGI app and its trio server; ``clients(model_id)`` returns the model's ChainClient (``Peer.client``)."""

    def __init__(self, models: Sequence[ServedModel], clients: Callable[[str], Awaitable[Any]],
                 config: ApiConfig = ApiConfig(), mounts: Mapping[str, Any] | None = None) -> None:
        self.models = {m.model_id: m for m in models}
        self.clients = clients
        self.config = config
        self._key = config.api_key()
        self._nursery: trio.Nursery | None = None
        self._gate = Gate(config.host, config.allowed_hosts, config.allowed_origins)
        self._slots = ClientSlots(config.max_requests_per_client)
        self._mounts = dict(mounts or {})  # path -> ASGI app (the dashboard), served without the API's key
        self._used: dict[str, Any] = {}  # model id -> the client its requests ran on (for /metrics)
        self.app = self._build_app()
        if self._key is None and not is_loopback(config.host):
            log.warning("the API listens on %s with no API key: anyone who can reach it can run generations on "
                        "the swarm (--api-key-file FILE)", config.host)

    # ---- ASGI ---------------------------------------------------------------------------------------------------
    def _build_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.middleware import Middleware
        from starlette.middleware.cors import CORSMiddleware
        from starlette.routing import Mount, Route

        async def not_found(request: Any, exc: Any) -> Any:
            status = getattr(exc, "status_code", 404)
            return self._error(ApiError(f"{request.method} {request.url.path}: {getattr(exc, 'detail', '')}",
                                        status, "invalid_request_error", code="not_found" if status == 404 else None))

        return Starlette(routes=[
            Route("/health", self._health, methods=["GET"]),
            Route("/metrics", self._metrics, methods=["GET"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model:path}", self._model_info, methods=["GET"]),
            Route("/v1/completions", self._completions, methods=["POST"]),
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            *(Mount(path, app=app) for path, app in self._mounts.items()),
        ], exception_handlers={HTTPException: not_found}, middleware=[
            Middleware(CORSMiddleware, allow_origins=list(self.config.allowed_origins), allow_methods=["GET", "POST"],
                       allow_headers=["Authorization", "Content-Type"])] if self.config.allowed_origins else [])

    async def serve(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """Listen until cancelled; ``task_status.started`` gets the base URL (``http://host:port``)."""
        from hypercorn.config import Config
        from hypercorn.trio import serve

        check_port(self.config.host, self.config.port)  # in use: one line, not hypercorn's grouped OSError
        cfg = Config()
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        cfg.bind = [f"{host}:{self.config.port}"]
        cfg.accesslog = None
        cfg.errorlog = log
        cfg.graceful_timeout = 1.0

        class _Status:
            def started(self, binds: Any = None) -> None:
                task_status.started(binds[0] if binds else None)

        async with trio.open_nursery() as nursery:  # the generations of the requests in flight
            self._nursery = nursery
            try:
                await serve(self.app, cfg, shutdown_trigger=trio.sleep_forever,
                            task_status=_Status())  # type: ignore[arg-type]
            finally:
                self._nursery = None
                nursery.cancel_scope.cancel()

    def _error(self, err: ApiError) -> Any:
        from starlette.responses import JSONResponse

        headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
        return JSONResponse(error_body(err), status_code=err.status, headers=headers)

    def _auth(self, request: Any, *, post: bool = False) -> None:
        """Host and Origin, Content-Type (``post``), then the key."""
        host = request.headers.get("host")
        self._gate.check_host(host)
        self._gate.check_origin(request.headers.get("origin"), host)
        if post:
            check_content_type(request.headers.get("content-type"))
        if self._key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), self._key.encode()):
            raise ApiError("Incorrect API key provided" if given else "Missing API key (Authorization: Bearer KEY)",
                           401, "invalid_request_error", code="invalid_api_key")

    def _model(self, model_id: str) -> ServedModel:
        model = self.models.get(model_id)
        if model is None:
            raise ApiError(f"The model {model_id!r} does not exist (served: {', '.join(self.models)})", 404,
                           "invalid_request_error", "model", "model_not_found")
        return model

    def _card(self, m: ServedModel) -> dict[str, Any]:
        return {"id": m.model_id, "object": "model", "created": m.created, "owned_by": "sangama"}

    async def _health(self, request: Any) -> Any:
        """``GET /health``: 200 ``{"status": "ok", "models": N}`` while the server runs (no key needed: load balancers
        and container probes ask it; it names no model)."""
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok", "models": len(self.models)})

    async def _metrics(self, request: Any) -> Any:
        """``GET /metrics``: Prometheus text of the clients' counters (:mod:`sangama_p2p.api.metrics`); behind the
        key when there is one (Prometheus sends it as ``authorization: {credentials: KEY}``)."""
        from prometheus_client import generate_latest
        from starlette.responses import Response

        from .metrics import CONTENT_TYPE, api_registry

        try:
            self._auth(request)
        except ApiError as err:
            return self._error(err)
        registry = api_registry(lambda: list(self.models), lambda: {m: c.stats for m, c in self._used.items()},
                                lambda: self._slots.running)
        return Response(generate_latest(registry), media_type=CONTENT_TYPE)

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            self._auth(request)
        except ApiError as err:
            return self._error(err)
        return JSONResponse({"object": "list", "data": [self._card(m) for m in self.models.values()]})

    async def _model_info(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        try:
            self._auth(request)
            return JSONResponse(self._card(self._model(request.path_params["model"])))
        except ApiError as err:
            return self._error(err)

    async def _completions(self, request: Any) -> Any:
        return await self._complete(request, chat=False)

    async def _chat(self, request: Any) -> Any:
        return await self._complete(request, chat=True)

    # ---- one request --------------------------------------------------------------------------------------------
    def _prompt(self, model: ServedModel, req: ApiRequest) -> tuple[list[int], tuple[int, ...], ApiRequest]:
        """The prompt's ids, its stop ids and ``req`` with the grammar of a forced tool call (blocking: a thread)."""
        if req.chat:
            fmt = model.tool_format
            try:  # the tools, and a conversation's earlier calls and results, as the template takes them
                messages, tools = prepare_messages(req.messages, req.tools.tools if req.tools else None, fmt)
            except ModelError as exc:
                raise ApiError(str(exc), param="messages") from exc
            prompt = render_chat(model.template, model.tokenizer, messages, tools=tools)
            if req.tools is not None and req.tools.forced:
                req = dataclasses.replace(req, grammar=req.tools.grammar(fmt, prompt.text))
            return list(prompt.ids), tuple(prompt.stop_ids), req
        if isinstance(req.prompt, str):
            return model.tokenizer.encode(req.prompt), model.eos_ids, req
        ids = list(req.prompt or ())
        vocab = model.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(f"prompt token ids must be in 0..{vocab - 1}", param="prompt")
        return ids, model.eos_ids, req

    async def _complete(self, request: Any, *, chat: bool) -> Any:
        from starlette.responses import JSONResponse, Response, StreamingResponse

        run: Run | None = None
        release: Callable[[], None] | None = None
        try:
            self._auth(request, post=True)
            release = self._slots.acquire(client_key(request))
            body = decode_body(await read_body(request, self.config.max_body_bytes))
            req = parse_request(body, chat=chat, default_max_tokens=self.config.max_tokens,
                                default_guesses=self.config.guesses, max_tokens_cap=self.config.max_tokens_cap)
            model = self._model(req.model)
            limit = self.config.max_prompt_chars or 16 * (model.context or 16384)
            if prompt_chars(req) > limit:
                raise ApiError(f"the prompt is {prompt_chars(req)} characters, over this server's limit of {limit} "
                               "(--max-prompt-chars)", param="messages" if chat else "prompt",
                               code="context_length_exceeded")
            ids, stop_ids, req = await trio.to_thread.run_sync(self._prompt, model, req)  # the loop serves meanwhile
            req = fit_context(req, len(ids), model.context)
            if req.ignore_eos:
                stop_ids = ()
            run = Run(len(ids))
            pieces = self._pieces(model, req, ids, stop_ids, run)
            text: list[str] = []
            first: list[Any] = []

            async def work() -> None:
                if req.stream:  # errors before the first token get their own status
                    first.append(await anext(pieces, None))
                    return
                async with aclosing(pieces):
                    async for piece, _ in pieces:
                        text.append(piece)

            if not await _while_connected(request, work):
                return Response(status_code=499)  # nobody reads it: the client has gone, its sessions closed
            if req.stream:
                calls = CallScanner(req.tools, model.tool_format) if req.tools is not None else None
                stream = StreamingResponse(events(model.tokenizer, req, pieces, first[0], run, calls),
                                           media_type="text/event-stream",
                                           headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                release, done = None, release
                return _Released(stream, done)
        except ApiError as err:
            return self._error(err)
        except BaseException as exc:
            typed = sangama_error(exc)
            if typed is None:
                raise
            log.info("request failed: %s", typed)
            return self._error(error_for(typed, started=bool(run and run.tokens)))
        finally:
            if release is not None:
                release()
        use, lp = usage(run.prompt_tokens, len(run.tokens)), logprobs_of(model.tokenizer, req, run, run.tokens)
        if not chat:
            return JSONResponse(completion_response(new_id(chat), req.model, "".join(text), run.finish or "length",
                                                    use, run.tokens, lp))
        content: str | None = "".join(text)
        calls: list[Any] = []
        if req.tools is not None and req.tools.choice != "none":
            content, calls = parse_tool_calls(content or "", model.tool_format, req.tools.tools)
        return JSONResponse(chat_response(new_id(chat), req.model, content, "tool_calls" if calls else
                                          run.finish or "length", use, run.tokens, lp, tool_calls_json(calls)))

    async def _pieces(self, model: ServedModel, req: ApiRequest, ids: list[int], stop_ids: tuple[int, ...],
                      run: Run) -> AsyncIterator[tuple[str, list[int]]]:
        """(text, the token ids it came from) as the tokens arrive; text is cut at the request's stop strings.

        The generation runs in a task of the server's own (:meth:`_produce`), so that the next trip leaves as soon
        as a token is in, while this one is still being decoded and written to the HTTP client."""
        if self._nursery is None:
            raise ApiError("the server is not running (ApiServer.serve)", 503, "service_unavailable")
        client = await self.clients(model.model_id)
        self._used[model.model_id] = client
        send, recv = trio.open_memory_channel[Any](math.inf)
        scope = trio.CancelScope()
        self._nursery.start_soon(self._produce, client, req, ids, stop_ids, send, scope)
        decoder, scan = IncrementalDecoder(model.tokenizer), StopScanner(req.stop)
        stops, held, text = frozenset(stop_ids), [], ""
        try:
            async with recv:
                async for item in recv:
                    if isinstance(item, BaseException):
                        raise item
                    item, score = item
                    run.tokens.append(item)
                    run.scores.append(score)
                    held.append(item)
                    if item in stops:
                        run.finish = "stop"
                        break
                    text = scan.push(decoder.push([item]))
                    if scan.hit:
                        run.finish = "stop"
                        break
                    if text:
                        yield text, held
                        held = []
        finally:
            scope.cancel()  # a stop string, an error or a client gone: the generation ends (its sessions close)
        tail = text if scan.hit else scan.flush(decoder.flush())
        run.finish = run.finish or "length"
        if tail or held:
            yield tail, held

    @staticmethod
    async def _produce(client: Any, req: ApiRequest, ids: list[int], stop_ids: tuple[int, ...],
                       send: Any, scope: trio.CancelScope) -> None:
        """Run the generation, sending each token id (then any error) to the request's channel."""
        with scope:
            async with send:
                try:
                    async with aclosing(client.stream_scored(ids, req.max_tokens, req.top_logprobs,
                                                             temperature=req.temperature, top_p=req.top_p,
                                                             seed=req.seed, guesses=req.guesses,
                                                             stop_tokens=stop_ids, grammar=req.grammar)) as tokens:
                        async for tok in tokens:
                            send.send_nowait(tok)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return  # the request is gone
                except Exception as exc:  # noqa: BLE001 - handed to the request, which types it (or re-raises)
                    try:
                        send.send_nowait(exc)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):  # the request is gone
                        pass
