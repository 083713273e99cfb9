"""The last stage's grammars: the checkpoint's vocabulary in the grammar engine's form, built at the first
constrained session (~1.3 s for SmolLM2, which a stage serving no grammar never spends), and each session's grammar
compiled in a thread, one at a time (a flood of grammars costs the stage one thread, never its event loop)."""

from __future__ import annotations

from typing import Any

import trio

from ..errors import ErrorCode, ModelError, StageError
from ..model.constraint import GrammarTokenizer, TokenConstraint, load_grammar_tokenizer
from ..wire.messages import ErrorMessage, OpenSession

__all__ = ["Grammars"]


class Grammars:
    """``compile(grammar, start)`` for the stage whose checkpoint is at ``checkpoint_path`` (None: no grammars)."""

    def __init__(self, checkpoint_path: Any = None) -> None:
        self.checkpoint_path = checkpoint_path
        self._tokenizer: GrammarTokenizer | None = None
        self._lock = trio.Lock()

    async def compile(self, grammar: str, start: int) -> TokenConstraint:
        """The session's constraint; ``StageError`` (BAD_FRAME) without a tokenizer, ``ModelError`` for a grammar
        the engine refuses."""
        async with self._lock:
            if self._tokenizer is None:
                if self.checkpoint_path is None:
                    raise StageError("this stage knows no tokenizer: it cannot hold output to a grammar",
                                     ErrorCode.BAD_FRAME)
                self._tokenizer = await trio.to_thread.run_sync(load_grammar_tokenizer, self.checkpoint_path)
            return await trio.to_thread.run_sync(TokenConstraint, self._tokenizer, grammar, start)

    async def open(self, table: Any, msg: OpenSession, fs: Any, reply: Any) -> ErrorMessage | None:
        """Open ``msg``'s session from ``fs`` (its FramedStream: peer and source) in ``table`` (a ``SessionTable``)
        once it passed the table's checks (quotas, range, capacity: before any compile) and its grammar compiled;
        the refusal to send, or None."""
        assert msg.grammar is not None
        try:
            table.admit(msg, fs.peer, fs.source)
            table.open(msg, fs.peer, reply, await self.compile(msg.grammar, msg.grammar_start), fs.source)
        except StageError as exc:
            return ErrorMessage(msg.session_id, None, exc.code, str(exc)[:1000])
        except ModelError as exc:  # a grammar the engine refuses, a tokenizer it cannot read
            return ErrorMessage(msg.session_id, None, ErrorCode.BAD_FRAME, str(exc)[:1000])
        return None
