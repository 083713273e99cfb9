"""Output held to a grammar: JSON that follows a schema, at the last stage, where the tokens are sampled.

``llguidance`` (the grammar engine llama.cpp can build with, and guidance's) compiles a JSON schema to a grammar and
gives, for each next token, the set of tokens the grammar allows as a bitmask over the vocabulary; the last stage
sets every other score to -inf before it samples (``Decoder`` in ``model.decode``). Chosen over ``xgrammar`` by what
it costs a stage (``benchmarks/constrained.py``, SmolLM2's 49k vocabulary): a wheel with no dependencies (xgrammar
pulls triton), a schema compiled in ~2 ms (xgrammar: ~40), a mask in ~0.2 ms per token (xgrammar: ~0.08; both far
below a token's compute), and resource limits meant for grammars from untrusted clients.

A :class:`TokenConstraint` follows the session's *input* tokens from ``start`` (the first generated position) on, not
the tokens it sampled: a step that rolls the cache back rolls the grammar back with it, and a stage that takes over a
session after a failover (its replay is one prefill of the prompt and the tokens so far) arrives at the same grammar
state from the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch

from ..errors import ModelError, SessionStateError

__all__ = ["GrammarTokenizer", "MAX_GRAMMAR_BYTES", "TokenConstraint", "json_grammar", "lark_grammar",
           "load_grammar_tokenizer"]

MAX_GRAMMAR_BYTES = 64 * 1024  # what OpenSession.grammar may carry (the wire's bound, wire/limits.py; a test pins both)

_SHIFTS = torch.arange(32, dtype=torch.int32)


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError as exc:  # pragma: no cover - a dependency; only a broken install lacks it
        raise ModelError("constrained output needs the llguidance package (pip install llguidance)") from exc
    return llguidance


def json_grammar(schema: dict[str, Any] | None) -> str:
    """The grammar of JSON text following ``schema`` (None: any JSON object, OpenAI's ``json_object``).

    No free whitespace between tokens (``whitespace_flexible`` off): a small model left free to emit spaces and
    newlines can loop on them until its token budget runs out. Raises ``ModelError`` for a schema it cannot compile.
    """
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(
            json.dumps({"type": "object"} if schema is None else schema),
            overrides={"whitespace_flexible": False})
    except Exception as exc:  # ValueError and others, with the compiler's message
        raise ModelError(f"cannot compile the JSON schema: {exc}") from exc
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ModelError(f"cannot compile the JSON schema: {error}")
    return grammar


def lark_grammar(source: str) -> str:
    """The grammar of llguidance's Lark ``source`` (tool calls: :mod:`sangama_p2p.model.tool_calls`); raises
    ``ModelError`` when it does not compile."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_lark(source)
    except Exception as exc:
        raise ModelError(f"cannot compile the grammar: {exc}") from exc
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise ModelError(f"cannot compile the grammar: {error}")
    return grammar


class GrammarTokenizer:
    """A checkpoint's vocabulary as the grammar engine sees it (building it takes ~1 s for 49k tokens: once per
    stage). ``vocab_size`` is the width of the model's scores (the embedding may have more rows than tokens)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_ids: Sequence[int]) -> None:
        llg = _llguidance()
        if not eos_ids:
            raise ModelError("constrained output needs the model's end-of-sequence token")
        try:
            self.inner = llg.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_ids))
        except Exception as exc:
            raise ModelError(f"the grammar engine cannot read this tokenizer: {exc}") from exc
        self.vocab_size = vocab_size


def load_grammar_tokenizer(path: str | Path) -> GrammarTokenizer:
    """The :class:`GrammarTokenizer` of the checkpoint at ``path`` (blocking: run it in a thread)."""
    from .checkpoint import open_checkpoint

    ckpt = open_checkpoint(path, tokenizer=True, need_tokenizer=False)
    try:
        if ckpt.tokenizer is None:
            raise ModelError(f"{path} ships no tokenizer: this stage cannot hold output to a grammar")
        return GrammarTokenizer(ckpt.tokenizer.backend.to_str(), ckpt.spec.vocab_size, ckpt.spec.eos_token_ids)
    finally:
        ckpt.close()


class TokenConstraint:
    """One session's grammar: the tokens it allows next, following the session's tokens at positions >= ``start``."""

    def __init__(self, tokenizer: GrammarTokenizer, grammar: str, start: int) -> None:
        llg = _llguidance()
        self.matcher = llg.LLMatcher(tokenizer.inner, grammar, log_level=0)
        if self.matcher.is_error():
            raise ModelError(f"invalid grammar: {self.matcher.get_error()}")
        self.vocab_size = tokenizer.vocab_size
        self.start = start  # the position of the first token the grammar decides
        self.end = start  # the grammar has consumed the tokens at positions [start, end)

    def follow(self, pos: int, tokens: Sequence[int]) -> None:
        """A step's input: ``tokens`` at positions ``pos``..; what it rewrites is rolled back first."""
        back = self.end - max(pos, self.start)
        if back > 0:
            if not self.matcher.rollback(back):
                raise SessionStateError(f"the grammar cannot roll back {back} tokens: {self.matcher.get_error()}")
            self.end -= back
        if pos + len(tokens) <= self.end:
            return
        if pos > self.end:
            raise SessionStateError(f"a step from position {pos} skips the grammar's position {self.end}")
        for tok in tokens[self.end - pos:]:
            if not self.matcher.consume_token(int(tok)):
                raise SessionStateError(f"token {tok} at position {self.end} breaks the grammar: "
                                        f"{self.matcher.get_error()}")
            self.end += 1

    def allowed(self, width: int) -> torch.Tensor:
        """The tokens the grammar allows next, as a bool mask ``[width]`` over the scores."""
        bits = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
        allowed = ((bits.unsqueeze(-1) >> _SHIFTS) & 1).flatten().bool()[:width]
        if not bool(allowed.any()):
            raise SessionStateError(f"the grammar allows no next token: {self.matcher.get_error()}")
        if allowed.shape[0] < width:  # scores past the tokenizer's words are never allowed
            allowed = torch.cat([allowed, allowed.new_zeros(width - allowed.shape[0])])
        return allowed

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ([V] or [1, V]) with the scores of the tokens the grammar does not allow next set to -inf."""
        return logits.masked_fill(~self.allowed(logits.shape[-1]), float("-inf"))
