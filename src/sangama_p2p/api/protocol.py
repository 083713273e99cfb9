"""OpenAI's request and response shapes, without I/O: decode and check a request body, bound its prompt by the
model's context, cut text at stop strings, map Sangama's errors to HTTP statuses, build the JSON objects the server
sends.

Kept apart from the server (:mod:`sangama_p2p.api.server`) so that every rule here is a pure function tests call.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ApiError, CapacityError, ChatTemplateError, ErrorCode, ModelError, RouteError, SangamaError
from ..errors import StageError, translate
from ..guesses import parse_guesses
from .logprobs import parse_logprobs
from .structured import parse_response_format
from .tools import ToolRequest, check_tool_messages, parse_tools

__all__ = ["ApiRequest", "StopScanner", "chat_chunk", "chat_response", "completion_chunk", "completion_response",
           "decode_body", "error_body", "error_for", "fit_context", "parse_request", "prompt_chars", "usage"]

MAX_STOP = 4  # OpenAI's limit on stop strings
MAX_SEED = 2**64  # seeds travel as u64 (wire.limits)
_WS = re.compile(r"[ \t\n\r]*")


@dataclass(frozen=True)
class ApiRequest:
    """One ``/v1/completions`` or ``/v1/chat/completions`` request, checked."""

    chat: bool
    model: str
    prompt: str | tuple[int, ...] | None  # completions
    messages: tuple[Mapping[str, Any], ...]  # chat
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    guesses: int | str
    ignore_eos: bool = False  # extension (as vLLM's): generate max_tokens, past the end-of-sequence ids
    max_tokens_field: str | None = None  # the field that set max_tokens (None: the server's default)
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's and its n best alternatives'
    grammar: str | None = None  # response_format's grammar (api/structured.py), held to at the last stage
    tools: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls (api/tools.py)


def decode_body(raw: bytes) -> Any:
    """The JSON of a request body; :class:`ApiError` (400) when it is not UTF-8 JSON, naming the top-level field
    whose value nests too deeply to decode (Python's decoder gives up at its recursion limit)."""
    try:
        text = raw.decode("utf-8")
        return json.loads(text)
    except RecursionError:
        field = _deep_field(text)
        raise ApiError("the body nests too deeply" + (f" in {field}" if field else ""), param=field) from None
    except (ValueError, UnicodeDecodeError) as exc:  # int digits over Python's limit are a ValueError too
        raise translate(exc, ApiError, "the body is not valid JSON")


def _deep_field(text: str) -> str | None:
    """The first member of the top-level object whose value cannot be decoded for its depth (None: not found)."""
    decoder = json.JSONDecoder()
    i = _WS.match(text, 0).end()  # type: ignore[union-attr]
    if not text.startswith("{", i):
        return None
    i += 1
    try:
        while True:
            i = _WS.match(text, i).end()  # type: ignore[union-attr]
            if not text.startswith('"', i):
                return None
            key, i = json.decoder.scanstring(text, i + 1)  # type: ignore[attr-defined]
            i = _WS.match(text, i).end()  # type: ignore[union-attr]
            if not text.startswith(":", i):
                return None
            try:
                _, i = decoder.raw_decode(text, _WS.match(text, i + 1).end())  # type: ignore[union-attr]
            except RecursionError:
                return str(key)
            i = _WS.match(text, i).end()  # type: ignore[union-attr]
            if not text.startswith(",", i):
                return None
            i += 1
    except ValueError:
        return None


def _number(body: Mapping[str, Any], name: str, default: float, lo: float, hi: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise ApiError(f"{name} must be a number in [{lo}, {hi}], got {value!r}", param=name)
    return float(value)


def _int(body: Mapping[str, Any], name: str, lo: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ApiError(f"{name} must be an integer >= {lo}, got {value!r}", param=name)
    return value


def parse_request(body: Any, *, chat: bool, default_max_tokens: int, default_guesses: int | str,
                  max_tokens_cap: int | None = None) -> ApiRequest:
    """Check a decoded JSON body; :class:`ApiError` (400) names the bad field. ``max_tokens_cap``: the most new
    tokens a request may ask for."""
    if not isinstance(body, Mapping):
        raise ApiError("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("model is required (a string)", param="model")
    n = _int(body, "n", 1)
    if n is not None and n != 1:
        raise ApiError(f"n={n} is not supported: this server returns one choice (n=1)", param="n")
    top_logprobs = parse_logprobs(body, chat=chat)
    grammar, _ = parse_response_format(body)
    tools = parse_tools(body) if chat else None
    if not chat and body.get("tools") not in (None, []):
        raise ApiError("tools are for /v1/chat/completions", param="tools")
    if tools is not None and grammar is not None and tools.choice != "none":
        raise ApiError("response_format and tools cannot be combined: both hold the reply to a grammar",
                       param="response_format")
    for name in ("echo", "functions", "function_call", "logit_bias", "best_of"):
        value = body.get(name)
        if value not in (None, False, 0, 1, {}, []) or (name == "best_of" and value not in (None, 1)):
            raise ApiError(f"{name} is not supported by this server", param=name)
    prompt: str | tuple[int, ...] | None = None
    messages: tuple[Mapping[str, Any], ...] = ()
    if chat:
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            raise ApiError("messages must be a non-empty list", param="messages")
        for m in raw:
            if not isinstance(m, Mapping) or not isinstance(m.get("role"), str):
                raise ApiError("every message needs a role (and content)", param="messages")
            content = m.get("content")
            if isinstance(content, list):  # content parts: text only
                if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
                           for p in content):
                    raise ApiError("only text content parts (with string text) are supported", param="messages")
                m = {**m, "content": "".join(p.get("text", "") for p in content)}
            elif content is not None and not isinstance(content, str):
                raise ApiError("message content must be a string or a list of text parts", param="messages")
            messages += (dict(m),)
        check_tool_messages(messages)
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
            raw = raw[0]  # one prompt in a batch of one
        if isinstance(raw, str) and raw:
            prompt = raw
        elif isinstance(raw, list) and raw and all(isinstance(t, int) and not isinstance(t, bool) for t in raw):
            prompt = tuple(raw)
        else:
            raise ApiError("prompt must be a non-empty string or list of token ids (one prompt per request)",
                           param="prompt")
    field = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, field, 1)
    if max_tokens is not None and max_tokens_cap is not None and max_tokens > max_tokens_cap:
        raise ApiError(f"{field}={max_tokens} is over this server's limit of {max_tokens_cap} (--max-tokens-cap)",
                       param=field)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOP:
        stops = tuple(s for s in stop if s)
    else:
        raise ApiError(f"stop must be a string or a list of at most {MAX_STOP} strings", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError("stream must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, Mapping)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise ApiError("stream_options must be an object (include_usage: a boolean)", param="stream_options")
    guesses = body.get("guesses", default_guesses)
    try:
        parse_guesses(guesses)
    except (ModelError, TypeError, ValueError) as exc:
        raise ApiError(f"guesses: {exc}", param="guesses") from exc
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise ApiError("ignore_eos must be a boolean", param="ignore_eos")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED):
        raise ApiError(f"seed must be an integer in [0, 2**64), got {seed!r}", param="seed")
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise ApiError("top_p must be in (0, 1] (0 keeps no token; temperature 0 is greedy)", param="top_p")
    return ApiRequest(chat, model, prompt, messages, max_tokens or default_max_tokens,
                      _number(body, "temperature", 1.0, 0.0, 2.0), top_p, int(seed or 0), stops, stream,
                      bool(options and options.get("include_usage")), guesses, ignore_eos,
                      field if max_tokens is not None else None, top_logprobs, grammar, tools)


def prompt_chars(req: ApiRequest) -> int:
    """The characters of a request's prompt text (its messages' contents), bounded before tokenizing."""
    if req.chat:
        return sum(len(m.get("content") or "") for m in req.messages)
    return len(req.prompt) if isinstance(req.prompt, str) else 0


def fit_context(req: ApiRequest, prompt_tokens: int, context: int | None) -> ApiRequest:
    """``req`` within the model's ``context`` (positions; None: unknown): a prompt that fills it, or a
    ``max_tokens`` the request set that does not fit after the prompt, is a 400 (``context_length_exceeded``); the
    server's default ``max_tokens`` is cut to what fits."""
    if context is None:
        return req
    if prompt_tokens >= context:
        raise ApiError(f"the prompt is {prompt_tokens} tokens: this model's context is {context} tokens",
                       param="messages" if req.chat else "prompt", code="context_length_exceeded")
    room = context - prompt_tokens
    if req.max_tokens <= room:
        return req
    if req.max_tokens_field is not None:
        raise ApiError(f"{req.max_tokens_field}={req.max_tokens} and a prompt of {prompt_tokens} tokens are over "
                       f"this model's context of {context} tokens (at most {room} new tokens fit)",
                       param=req.max_tokens_field, code="context_length_exceeded")
    return dataclasses.replace(req, max_tokens=room)


class StopScanner:
    """Cuts streamed text at the first stop string: :meth:`push` returns the text that is safe to send (a tail that
    could be the start of a stop string is held back) and whether a stop string was hit."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.hit = False

    def push(self, piece: str) -> str:
        if self.hit:
            return ""
        self._buf += piece
        cuts = [i for i in (self._buf.find(s) for s in self.stops) if i >= 0]
        if cuts:
            self.hit = True
            out, self._buf = self._buf[:min(cuts)], ""
            return out
        keep = min(self._hold, len(self._buf))
        out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
        return out

    def flush(self, piece: str = "") -> str:
        out = self.push(piece)
        if self.hit:
            return out
        out, self._buf = out + self._buf, ""
        return out


def error_for(exc: BaseException, *, started: bool) -> ApiError:
    """The HTTP error for a Sangama error; ``started``: tokens had come back before it (the chain failed mid-way)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, (ChatTemplateError, CapacityError)) or (isinstance(exc, ModelError) and not started):
        return ApiError(str(exc), 400, "invalid_request_error", code="invalid_prompt")
    if isinstance(exc, StageError) and exc.code in (ErrorCode.CAPACITY, ErrorCode.OVERLOADED) and not started:
        return ApiError(f"the swarm is at capacity: {exc}", 429, "rate_limit_error", code="capacity")
    if isinstance(exc, RouteError) and not started and not isinstance(exc.__cause__, SangamaError):
        return ApiError(f"no chain of peers serves the model now: {exc}", 503, "service_unavailable",
                        code="no_chain")
    return ApiError(f"the chain of peers failed: {exc}", 502, "bad_gateway", code="chain_failed")


def error_body(err: ApiError) -> dict[str, Any]:
    return {"error": {"message": str(err), "type": err.type, "param": err.param, "code": err.code}}


def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(rid: str, obj: str, model: str, created: int | None) -> dict[str, Any]:
    return {"id": rid, "object": obj, "created": created or int(time.time()), "model": model}


def chat_response(rid: str, model: str, text: str | None, finish: str, use: dict[str, int],
                  token_ids: Sequence[int], logprobs: Any = None,
                  tool_calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {**_head(rid, "chat.completion", model, None),
            "choices": [{"index": 0, "message": message, "finish_reason": finish,
                         "logprobs": logprobs, "token_ids": list(token_ids)}],
            "usage": use}


def completion_response(rid: str, model: str, text: str, finish: str, use: dict[str, int],
                        token_ids: Sequence[int], logprobs: Any = None) -> dict[str, Any]:
    return {**_head(rid, "text_completion", model, None),
            "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs,
                         "token_ids": list(token_ids)}],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict[str, Any] | None, finish: str | None,
               token_ids: Sequence[int] = (), use: dict[str, int] | None = None,
               logprobs: Any = None) -> dict[str, Any]:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": logprobs,
                                         "token_ids": list(token_ids)}]
    return {**_head(rid, "chat.completion.chunk", model, created), "choices": choices, "usage": use}


def completion_chunk(rid: str, model: str, created: int, text: str | None, finish: str | None,
                     token_ids: Sequence[int] = (), use: dict[str, int] | None = None,
                     logprobs: Any = None) -> dict[str, Any]:
    choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish, "logprobs": logprobs,
                                        "token_ids": list(token_ids)}]
    return {**_head(rid, "text_completion", model, created), "choices": choices, "usage": use}
