"""What one request produced (:class:`Run`) and the server-sent events of a streamed reply (:func:`events`).

A chunk carries the text of the tokens that came in since the last one, their ids and (when asked) their
log-probabilities; a chat stream with tools holds the text of a call and sends the calls as one ``tool_calls`` delta
at the end (:class:`~sangama_p2p.api.tools.CallScanner`); the last chunk has the ``finish_reason``, then a usage chunk
when asked, then ``data: [DONE]``. A failure after the stream started is one ``data: {"error": ...}`` event, and the
stream closes without ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from ..errors import SangamaError, group_leaves
from .logprobs import chat_logprobs, completion_logprobs
from .protocol import ApiRequest, chat_chunk, completion_chunk, error_body, error_for, new_id, usage
from .tools import CallScanner, tool_calls_json

__all__ = ["Run", "events", "logprobs_of", "sangama_error"]

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What one request produced so far."""

    prompt_tokens: int
    tokens: list[int] = field(default_factory=list)
    finish: str | None = None
    scores: list[Any] = field(default_factory=list)  # wire.TokenLogprobs per token, when asked for
    sent: int = 0  # tokens whose log-probabilities a chunk carried
    chars: int = 0  # characters of completion text those chunks carried


def sangama_error(exc: BaseException) -> SangamaError | None:
    """The typed error ``exc`` is (trio may wrap it in groups), or None."""
    if isinstance(exc, SangamaError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        leaves = group_leaves(exc)
        if leaves and all(isinstance(e, SangamaError) for e in leaves):
            return leaves[0]  # type: ignore[return-value]
    return None


def logprobs_of(tokenizer: Any, req: ApiRequest, run: Run, toks: Sequence[int]) -> Any:
    """The ``logprobs`` of the next ``toks`` of ``run`` (None when the request asked for none)."""
    if req.top_logprobs is None:
        return None
    scores, run.sent = run.scores[run.sent:run.sent + len(toks)], run.sent + len(toks)
    if req.chat:
        return chat_logprobs(tokenizer, toks, scores)
    return completion_logprobs(tokenizer, toks, scores, run.chars)


async def events(tokenizer: Any, req: ApiRequest, pieces: AsyncIterator[tuple[str, list[int]]],
                 first: tuple[str, list[int]] | None, run: Run, calls: CallScanner | None) -> AsyncIterator[str]:
    """The ``data: ...`` events of a streamed reply; ``first``: the piece already read (None: the reply is empty)."""
    rid, created = new_id(req.chat), int(time.time())
    held: list[int] = []  # ids of text the call scanner holds

    def chunk(text: str | None, finish: str | None, toks: Sequence[int] = (), use: Any = None,
              delta: dict[str, Any] | None = None) -> str:
        lp = logprobs_of(tokenizer, req, run, toks) if toks else None
        if req.chat:
            if delta is None:
                delta = None if text is None else ({"content": text} if finish is None else {})
            obj = chat_chunk(rid, req.model, created, delta, finish, toks, use, lp)
        else:
            obj = completion_chunk(rid, req.model, created, text, finish, toks, use, lp)
            run.chars += len(text or "")
        return f"data: {json.dumps(obj)}\n\n"

    def content(piece: str, toks: list[int]) -> str | None:
        if calls is None:
            return chunk(piece, None, toks)
        held.extend(toks)
        text = calls.push(piece)
        if not text:
            return None
        sent = held[:]
        held.clear()
        return chunk(text, None, sent)

    if req.chat:
        yield f"data: {json.dumps(chat_chunk(rid, req.model, created, {'role': 'assistant', 'content': ''}, None))}\n\n"
    try:
        if first is not None:
            out = content(*first)
            if out:
                yield out
            async with aclosing(pieces):
                async for piece, toks in pieces:
                    out = content(piece, toks)
                    if out:
                        yield out
    except BaseException as exc:
        typed = sangama_error(exc)
        if typed is None:
            raise
        log.info("stream failed after %d tokens: %s", len(run.tokens), typed)
        yield f"data: {json.dumps(error_body(error_for(typed, started=True)))}\n\n"
        return
    finish = run.finish or "length"
    if calls is not None:
        rest, found = calls.finish()
        if found:
            yield chunk(None, None, held, delta={"tool_calls": tool_calls_json(found, stream=True)})
            finish = "tool_calls"
        elif rest or held:
            yield chunk(rest, None, held)
    yield chunk("", finish)
    if req.include_usage:
        yield chunk(None, None, use=usage(run.prompt_tokens, len(run.tokens)))
    yield "data: [DONE]\n\n"
