"""Log-probabilities in OpenAI's shapes: ``logprobs``/``top_logprobs`` of a request, and the objects a choice (or a
streamed chunk) carries.

The numbers come from the last stage (``wire.TokenLogprobs``: float32 log-softmax of the logits each token was
chosen from, before temperature and top-p); this module only names the tokens. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ApiError

__all__ = ["MAX_TOP_LOGPROBS", "chat_logprobs", "completion_logprobs", "parse_logprobs"]

MAX_TOP_LOGPROBS = 20  # OpenAI's bound on chat top_logprobs (the wire's MAX_TOP_LOGPROBS)


def parse_logprobs(body: Mapping[str, Any], *, chat: bool) -> int | None:
    """How many alternatives each token's log-probability comes with (None: no log-probabilities asked for).

    Chat: ``logprobs`` a boolean, ``top_logprobs`` 0..20 (only with ``logprobs: true``, as OpenAI). Completions:
    ``logprobs`` an integer 0..20 (OpenAI allows 5; the alternatives asked for, the chosen token always comes)."""
    value = body.get("logprobs")
    if chat:
        top = body.get("top_logprobs")
        if value is not None and not isinstance(value, bool):
            raise ApiError(f"logprobs must be a boolean, got {value!r}", param="logprobs")
        if top is not None and (isinstance(top, bool) or not isinstance(top, int)
                                or not 0 <= top <= MAX_TOP_LOGPROBS):
            raise ApiError(f"top_logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top!r}",
                           param="top_logprobs")
        if top is not None and not value:
            raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
        return (top or 0) if value else None
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {value!r}", param="logprobs")
    return value


def _text(tokenizer: Any, tid: int) -> str:
    return tokenizer.decode([tid])


def chat_logprobs(tokenizer: Any, ids: Sequence[int], scores: Sequence[Any]) -> dict[str, Any]:
    """A chat choice's ``logprobs``: ``{"content": [{token, logprob, bytes, top_logprobs}], "refusal": None}``.
    ``bytes`` are the UTF-8 bytes of the token's decoded text (a token that ends inside a character decodes to
    U+FFFD)."""
    def entry(tid: int, lp: float) -> dict[str, Any]:
        text = _text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = [{**entry(t, s.logprob), "top_logprobs": [entry(i, v) for i, v in zip(s.top_ids, s.top_logprobs)]}
               for t, s in zip(ids, scores)]
    return {"content": content, "refusal": None}


def completion_logprobs(tokenizer: Any, ids: Sequence[int], scores: Sequence[Any], offset: int = 0
                        ) -> dict[str, Any]:
    """A completion choice's ``logprobs``: parallel lists ``tokens``, ``token_logprobs``, ``top_logprobs`` (one
    ``{token: logprob}`` per token, best first) and ``text_offset`` (characters into the completion, from
    ``offset``)."""
    tokens, offsets = [], []
    for t in ids:
        tokens.append(_text(tokenizer, t))
        offsets.append(offset)
        offset += len(tokens[-1])
    tops = [{_text(tokenizer, i): v for i, v in zip(s.top_ids, s.top_logprobs)} for s in scores]
    return {"tokens": tokens, "token_logprobs": [s.logprob for s in scores], "top_logprobs": tops,
            "text_offset": offsets}
