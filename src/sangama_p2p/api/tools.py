"""``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request, and the ``tool_calls`` of its reply.

The tools reach the model through the checkpoint's own template (or the Hermes fallback, :mod:`sangama_p2p.model.
tool_calls`); what the model writes is read back as calls at the end of the reply. ``tool_choice`` ``required`` or a
named function holds the reply to calls by a grammar at the last stage (as ``response_format`` does); ``auto`` leaves
the model free and reads whatever calls it wrote; ``none`` lays the tools out as well (the conversation may hold
calls of them; vLLM does the same) but reads no calls back: the reply is content. A stream sends the text
before the first call as it comes, holds what follows ``<tool_call>``, and sends the calls as one ``tool_calls`` delta
when the reply ends (or the held text as content, when it was no call after all).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ApiError, ModelError
from ..model.constraint import MAX_GRAMMAR_BYTES
from ..model.tool_calls import CALL_OPEN, ToolCall, ToolFormat, call_grammar, parse_tool_calls

__all__ = ["CallScanner", "ToolRequest", "check_tool_messages", "parse_tools", "tool_calls_json"]

MAX_TOOLS = 128  # OpenAI's limit
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")  # OpenAI's rule for function names


@dataclass(frozen=True)
class ToolRequest:
    """A request's tools (OpenAI's shape, checked), ``choice`` (``auto``, ``none``, ``required`` or a tool's name)
    and whether several calls may come in one reply."""

    tools: tuple[Mapping[str, Any], ...]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice not in ("auto", "none")

    def grammar(self, fmt: ToolFormat, prompt_text: str) -> str | None:
        """The grammar that holds the reply to calls (None unless forced): one call of a named tool; with
        ``required``, one of any tool, or several in a row when parallel calls are allowed."""
        if not self.forced:
            return None
        anyone = self.choice == "required"
        try:
            grammar = call_grammar(self.tools, fmt, only=None if anyone else self.choice,
                                   parallel=self.parallel and anyone,
                                   open_think=prompt_text.rstrip(" ").endswith("<think>\n"))
        except ModelError as exc:
            raise ApiError(f"tools: {exc}", param="tools") from exc
        if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
            raise ApiError(f"the tools' grammar is larger than {MAX_GRAMMAR_BYTES} bytes", param="tools")
        return grammar


def _tool(i: int, tool: Any) -> Mapping[str, Any]:
    fn = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(fn, Mapping):
        raise ApiError(f"tools[{i}] must be {{'type': 'function', 'function': {{...}}}}", param="tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ApiError(f"tools[{i}].function.name must be 1-64 letters, digits, _ or -, got {name!r}", param="tools")
    if not isinstance(fn.get("description", ""), str):
        raise ApiError(f"tools[{i}].function.description must be a string", param="tools")
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping) or not isinstance(params.get("properties", {}), Mapping):
        raise ApiError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    return {"type": "function", "function": {**fn, "parameters": dict(params)}}


def parse_tools(body: Mapping[str, Any]) -> ToolRequest | None:
    """The request's tools (None without any); :class:`ApiError` (400) names the bad field."""
    raw, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if raw in (None, []):
        if choice not in (None, "none"):
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(raw, list) or len(raw) > MAX_TOOLS:
        raise ApiError(f"tools must be a list of at most {MAX_TOOLS} functions", param="tools")
    tools = tuple(_tool(i, t) for i, t in enumerate(raw))
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError("tools name a function twice", param="tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, Mapping):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, Mapping) else None
        if choice.get("type") != "function" or name not in names:
            raise ApiError(f"tool_choice must name one of the tools ({', '.join(names)})", param="tool_choice")
        choice = name
    elif choice not in ("auto", "none", "required"):
        raise ApiError("tool_choice must be auto, none, required or {'type': 'function', 'function': {'name': ...}}",
                       param="tool_choice")
    return ToolRequest(tools, choice, parallel)


def check_tool_messages(messages: Sequence[Mapping[str, Any]]) -> None:
    """An assistant message's ``tool_calls`` and a ``tool`` message's ``tool_call_id`` are well formed."""
    for m in messages:
        calls = m.get("tool_calls")
        if calls is not None:
            if m.get("role") != "assistant" or not isinstance(calls, list):
                raise ApiError("tool_calls belong to assistant messages, as a list", param="messages")
            for c in calls:
                fn = c.get("function") if isinstance(c, Mapping) else None
                if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or \
                        not isinstance(fn.get("arguments", ""), (str, Mapping)):
                    raise ApiError("every tool call needs a function with a name and arguments", param="messages")
        if m.get("role") == "tool" and not isinstance(m.get("tool_call_id", ""), str):
            raise ApiError("a tool message's tool_call_id must be a string", param="messages")


def tool_calls_json(calls: Sequence[ToolCall], *, stream: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` list (``index`` added in a stream's delta)."""
    out = []
    for i, call in enumerate(calls):
        item: dict[str, Any] = {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}
        out.append({"index": i, **item} if stream else item)
    return out


class CallScanner:
    """A streamed reply that may hold calls: :meth:`push` returns the content safe to send now (text from
    ``<tool_call>`` on, and a tail that could begin it, is held); :meth:`finish` reads the held text as calls, or
    gives it back as content."""

    def __init__(self, request: ToolRequest, fmt: ToolFormat) -> None:
        self.request, self.fmt = request, fmt
        self.held = ""
        self.calling = False

    def push(self, piece: str) -> str:
        if self.request.choice == "none":
            return piece
        self.held += piece
        if not self.calling:
            at = self.held.find(CALL_OPEN)
            if at >= 0:
                out, self.held, self.calling = self.held[:at], self.held[at:], True
                return out
            keep = next((k for k in range(min(len(CALL_OPEN) - 1, len(self.held)), 0, -1)
                         if CALL_OPEN.startswith(self.held[-k:])), 0)
            out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            return out
        return ""

    def finish(self) -> tuple[str, list[ToolCall]]:
        """``(content still to send, calls)``."""
        held, self.held = self.held, ""
        if not self.calling:
            return held, []
        content, calls = parse_tool_calls(held, self.fmt, self.request.tools)
        return ("", calls) if calls else (content or "", [])
