"""``response_format`` of a request: the grammar that holds a reply to JSON (``json_object``) or to a JSON schema
(``json_schema``), compiled here and sent to the last stage, which samples only the tokens it allows
(``model.constraint``; the wire's ``OpenSession.grammar``).

The constraint runs at the last stage, not at the client on the last stage's scores: it must act before each token is
sampled, and the alternative sends every step's whole vocabulary of scores (or its mask: 31 KB a token for Qwen3.5's
248k tokens, four times a step's hidden state) across every hop.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..errors import ApiError, ModelError
from ..model.constraint import MAX_GRAMMAR_BYTES, json_grammar

__all__ = ["parse_response_format"]

MAX_SCHEMA_BYTES = 32 * 1024  # a schema's JSON text; its grammar must fit the wire's 64 KiB


def parse_response_format(body: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """``(grammar, kind)`` of a request's ``response_format`` (None, None for text or none); :class:`ApiError` (400)
    for a malformed one or a schema the grammar engine cannot compile."""
    fmt = body.get("response_format")
    if fmt is None:
        return None, None
    if not isinstance(fmt, Mapping) or not isinstance(fmt.get("type"), str):
        raise ApiError("response_format must be an object with a type: text, json_object or json_schema",
                       param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None, None
    if kind == "json_object":
        schema: dict[str, Any] | None = None
    elif kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, Mapping) or not isinstance(spec.get("schema", {}), Mapping):
            raise ApiError("response_format.json_schema must be an object with a schema object (and a name)",
                           param="response_format")
        schema = dict(spec.get("schema") or {})
    else:
        raise ApiError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                       param="response_format")
    if schema is not None and len(json.dumps(schema)) > MAX_SCHEMA_BYTES:
        raise ApiError(f"the schema is longer than {MAX_SCHEMA_BYTES} bytes", param="response_format")
    try:
        grammar = json_grammar(schema)
    except ModelError as exc:
        raise ApiError(str(exc), param="response_format") from exc
    if len(grammar.encode()) > MAX_GRAMMAR_BYTES:
        raise ApiError(f"the schema's grammar is larger than {MAX_GRAMMAR_BYTES} bytes", param="response_format")
    return grammar, kind
