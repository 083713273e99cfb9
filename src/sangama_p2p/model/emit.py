"""Printing a generation as its tokens arrive: text (token by token), JSON lines, or one JSON document at the end.

``generate`` (network and ``--local``) feeds each trip's new ids to :meth:`TokenPrinter.push`; whatever was
produced before a failure has been printed already (``--json``: :meth:`TokenPrinter.fail` prints the partial
document with the error).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Mapping
from typing import IO, Any

from .tokenizer import IncrementalDecoder

__all__ = ["MODES", "TokenPrinter"]

MODES = ("text", "jsonl", "json")


class TokenPrinter:
    """``mode``: ``text`` (decoded pieces, or ids separated by spaces without a tokenizer), ``jsonl`` (one
    ``{"token", "text"}`` line per token, then a ``{"done": true, ...}`` line) or ``json`` (nothing until
    :meth:`done`). ``hide``: ids left out of the text (a chat template's end-of-turn tokens)."""

    def __init__(self, tokenizer: Any, mode: str = "text", out: IO[str] | None = None,
                 hide: Iterable[int] = ()) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode, self.out = mode, out or sys.stdout
        self.hide = frozenset(int(t) for t in hide)
        self.decoder = IncrementalDecoder(tokenizer) if tokenizer is not None else None
        self.tokens: list[int] = []
        self.text = ""

    def _piece(self, ids: list[int]) -> str:
        shown = [t for t in ids if t not in self.hide]
        if self.decoder is None:
            return ("" if len(self.tokens) <= len(ids) else " ") + " ".join(map(str, shown)) if shown else ""
        return self.decoder.push(shown)

    def push(self, ids: Iterable[int]) -> None:
        for tok in ids:  # one at a time: jsonl has a line per token, and text shows each as soon as it decodes
            self.tokens.append(int(tok))
            piece = self._piece([int(tok)])
            self.text += piece
            if self.mode == "text" and piece:
                self.out.write(piece)
                self.out.flush()
            elif self.mode == "jsonl":
                self.out.write(json.dumps({"token": int(tok), "text": piece}) + "\n")
                self.out.flush()

    def _close_text(self) -> None:
        tail = self.decoder.flush() if self.decoder is not None else ""
        self.text += tail
        if self.mode == "text":
            self.out.write(tail + "\n")
            self.out.flush()

    def done(self, summary: Mapping[str, Any]) -> None:
        """The generation is over: end the text line, or print the final document (``summary`` + tokens, text)."""
        self._close_text()
        if self.mode == "jsonl":
            self.out.write(json.dumps({"done": True, **summary}) + "\n")
        elif self.mode == "json":
            self.out.write(json.dumps(dict(summary)) + "\n")
        self.out.flush()

    def fail(self, error: BaseException) -> None:
        """The generation failed: what was produced stays printed (``json``: printed now, with the error)."""
        self._close_text()
        if self.mode != "text":
            doc = {"tokens": self.tokens, "text": self.text if self.decoder is not None else None,
                   "error": str(error)}
            self.out.write(json.dumps({"done": False, **doc} if self.mode == "jsonl" else doc) + "\n")
        self.out.flush()
