"""Tool calls in a chat: the tools told to the model, the calls it writes read back, and the grammar that holds a
reply to calls when the caller demands one.

A chat template that takes ``tools`` lays them out and teaches the model one way of writing a call; that way is the
template family's, and :func:`tool_format` reads it from the template's source:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, SmolLM3): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``;
- ``xml`` (Qwen3.5, Qwen3-Coder): ``<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>
  \\n</tool_call>``, string values bare, others as JSON.

A template that takes no tools (SmolLM2's, Llama 2's) gets them in the Hermes layout, described in a system message
(:func:`prepare_messages`), and the conversation's earlier calls and tool results written into its messages as the
text a Hermes model would have seen. Arguments come to templates as objects (transformers' convention: Qwen's
templates iterate them), not as the JSON text OpenAI's clients send.

The grammar (:func:`call_grammar`, llguidance's Lark) runs at the last stage like ``response_format``'s: the reply is
one call (or up to :data:`MAX_CALLS` in a row) of a named tool or any tool, its arguments held to the tool's JSON
schema, after the template's open thinking block when the prompt ends inside one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ModelError

__all__ = ["CALL_OPEN", "MAX_CALLS", "ToolCall", "ToolFormat", "call_grammar", "parse_tool_calls",
           "prepare_messages", "tool_format"]

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
MAX_CALLS = 8  # calls one forced reply may hold when parallel calls are allowed
_TOOLS_VAR = re.compile(r"\btools\b")
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.S)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*\Z", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
# text up to and with the first "</think>" / "\n</parameter>": llguidance's lexemes are greedy, so a lexeme ends at
# its own terminator rather than before a literal that follows it
_THINK = r"/(?s:.*)<\/think>/ & ~/(?s:.*)<\/think>(?s:.+)/"
_PVAL = r"/(?s:.+)\n<\/parameter>/ & ~/(?s:.*)\n<\/parameter>(?s:.+)/"
# JSON in a call as templates write it (``tojson``: Python's json.dumps), and no free whitespace to loop on
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ToolFormat:
    """How a template's family writes calls (``hermes`` or ``xml``) and whether the template lays tools out itself
    (``native``; else the Hermes fallback in a system message)."""

    name: str
    native: bool


@dataclass(frozen=True)
class ToolCall:
    """One call read back from a reply: the tool's name and its arguments as JSON text (OpenAI's shape)."""

    name: str
    arguments: str


def tool_format(template_source: str | None) -> ToolFormat:
    """The tool-call format of a chat template (its Jinja source; None: no template)."""
    src = template_source or ""
    if not _TOOLS_VAR.search(src):
        return ToolFormat("hermes", False)
    return ToolFormat("xml" if "<function=" in src else "hermes", True)


def _function(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    return tool.get("function", tool)


def _arguments(call: Mapping[str, Any]) -> dict[str, Any]:
    """A message's call's arguments as an object (OpenAI sends JSON text)."""
    args = _function(call).get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as exc:
            raise ModelError(f"the arguments of tool call {_function(call).get('name')!r} are not JSON: {exc}") from None
    if not isinstance(args, Mapping):
        raise ModelError(f"the arguments of tool call {_function(call).get('name')!r} are not a JSON object")
    return dict(args)


def _hermes_call(name: str, args: Mapping[str, Any]) -> str:
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def _fallback_system(tools: Sequence[Mapping[str, Any]]) -> str:
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou can call functions to help answer the user. The functions, as JSON signatures within "
            f"<tools></tools> tags:\n<tools>\n{listed}\n</tools>\n\nTo call one, reply with a JSON object holding its "
            "name and arguments within <tool_call></tool_call> tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def prepare_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None,
                     fmt: ToolFormat) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """``(messages, tools)`` as the template should get them. Native: the calls' arguments as objects, the tools
    as given. Fallback: the tools in a system message (joined to the first one), calls written as Hermes blocks into
    the assistant's text, and each run of ``tool`` messages as one user message of ``<tool_response>`` blocks; the
    template then gets no tools. Raises :class:`ModelError` for a call whose arguments are not a JSON object."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.get("tool_calls") or ()
        if fmt.native:
            if calls:
                m["tool_calls"] = [{**c, "function": {**_function(c), "arguments": _arguments(c)}} for c in calls]
            out.append(m)
            continue
        if m.get("role") == "tool":
            block = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].pop("_responses", False):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
            out[-1]["_responses"] = True
            continue
        if calls:
            written = "\n".join(_hermes_call(str(_function(c).get("name")), _arguments(c)) for c in calls)
            text = m.get("content") or ""
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = f"{text}\n{written}" if text else written
        out.append(m)
    for m in out:
        m.pop("_responses", None)
    if fmt.native or not tools:
        return out, (list(tools) if tools and fmt.native else None)
    system = _fallback_system(tools)
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".lstrip()}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


# ---- reading calls back -----------------------------------------------------------------------------------------
def _schema_types(tool: Mapping[str, Any]) -> dict[str, Any]:
    props = (_function(tool).get("parameters") or {}).get("properties") or {}
    return {str(k): (v.get("type") if isinstance(v, Mapping) else None) for k, v in props.items()}


def _hermes_block(body: str) -> list[tuple[str, Any]] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, Mapping):
            return None
        calls.append((item["name"], dict(args)))
    return calls


def _xml_block(body: str, types: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, Any]] | None:
    match = _FUNCTION.match(body)
    if match is None:
        return None
    name = match.group(1).strip()
    args: dict[str, Any] = {}
    for key, raw in _PARAMETER.findall(match.group(2)):
        key = key.strip()
        kind = types.get(name, {}).get(key)
        if kind == "string":
            args[key] = raw
            continue
        try:
            args[key] = json.loads(raw)
        except ValueError:
            args[key] = raw  # a bare word where the schema (or its absence) asked for JSON: kept as text
    return [(name, args)]


def parse_tool_calls(text: str, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    """``(content, calls)`` of a reply: the text before the first call (None when empty) and the calls, when every
    ``<tool_call>`` block in it parses and names one of ``tools`` (a last block may lack its closing tag: the model
    stopped there); otherwise ``(text, [])``, the reply as plain content."""
    at = text.find(CALL_OPEN)
    if at < 0:
        return text, []
    names = {str(_function(t).get("name")) for t in tools}
    types = {str(_function(t).get("name")): _schema_types(t) for t in tools}
    calls: list[ToolCall] = []
    rest = text[at:]
    for block in _BLOCK.finditer(rest):
        parsed = _xml_block(block.group(1), types) if fmt.name == "xml" else _hermes_block(block.group(1).strip())
        if not parsed or any(name not in names for name, _ in parsed):
            return text, []
        calls += [ToolCall(name, json.dumps(args, ensure_ascii=False)) for name, args in parsed]
    if _BLOCK.sub("", rest).strip():  # text between or after the calls: not a reply of calls
        return text, []
    return text[:at].strip() or None, calls


# ---- the grammar of a forced call -------------------------------------------------------------------------------
def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _hermes_rule(tool: Mapping[str, Any]) -> str:
    fn = _function(tool)
    schema = {"type": "object", "properties": {"name": {"const": fn["name"]},
                                               "arguments": fn.get("parameters") or {"type": "object"}},
              "required": ["name", "arguments"], "additionalProperties": False,
              "x-guidance": _JSON_LAYOUT}
    return f'{_literal(CALL_OPEN + chr(10))} %json {json.dumps(schema)} {_literal(chr(10) + CALL_CLOSE)}'


def _xml_rule(tool: Mapping[str, Any]) -> str:
    fn = _function(tool)
    params = fn.get("parameters") or {}
    required = set(params.get("required") or ())
    parts = [_literal(f"{CALL_OPEN}\n<function={fn['name']}>\n")]
    for key, schema in (params.get("properties") or {}).items():
        if not isinstance(key, str) or not key or any(c in key for c in ">\n"):
            raise ModelError(f"tool {fn['name']!r}: parameter name {key!r} cannot be written as <parameter=...>")
        schema = schema if isinstance(schema, Mapping) else {}
        if schema.get("type") == "string":
            value = f'PVAL {_literal(chr(10))}'
        else:
            value = f'%json {json.dumps({**schema, "x-guidance": _JSON_LAYOUT})} ' \
                    f'{_literal(chr(10) + "</parameter>" + chr(10))}'
        part = f'{_literal(f"<parameter={key}>" + chr(10))} {value}'
        parts.append(part if key in required else f"({part})?")
    parts.append(_literal(f"</function>\n{CALL_CLOSE}"))
    return " ".join(parts)


def call_grammar(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, *, only: str | None = None,
                 parallel: bool = True, open_think: bool = False) -> str:
    """The llguidance grammar of a reply that is calls only: of the tool named ``only`` (None: any of ``tools``),
    one, or up to :data:`MAX_CALLS` when ``parallel``; after the rest of a thinking block when ``open_think`` (the
    prompt ends inside ``<think>``). Raises :class:`ModelError` when the engine cannot compile it."""
    from .constraint import lark_grammar

    chosen = [t for t in tools if only is None or _function(t).get("name") == only]
    if not chosen:
        raise ModelError(f"no tool named {only!r}")
    rule = _xml_rule if fmt.name == "xml" else _hermes_rule
    lines = [f"call_{i}: {rule(t)}" for i, t in enumerate(chosen)]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(chosen))))
    calls = f'call ({_literal(chr(10))} call){{0,{MAX_CALLS - 1}}}' if parallel else "call"
    lines.insert(0, f'start: THINK {_literal(chr(10) * 2)} {calls}' if open_think else f"start: {calls}")
    if open_think:
        lines.append(f"THINK: {_THINK}")
    if fmt.name == "xml":
        lines.append(f"PVAL: {_PVAL}")
    return lark_grammar("\n".join(lines) + "\n")
