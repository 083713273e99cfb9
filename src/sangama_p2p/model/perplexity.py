"""Perplexity as llama.cpp's ``llama-perplexity`` computes it: chunks, BOS, NLL from logits in float64 (pure).

The rules of ``tools/perplexity/perplexity.cpp``'s ``perplexity()`` (without ``--ppl-stride``), the model left out:

- The text is read as ``-f`` reads it (``common/arg.cpp``): the file's bytes, less one trailing newline.
- The whole text is tokenized once, BOS added when the model adds it (``common_tokenize(ctx, text, true)``); it must
  hold at least ``2 * n_ctx`` tokens.
- Chunk ``i`` is tokens ``[i * n_ctx, (i + 1) * n_ctx)``, evaluated alone from an empty cache; there are
  ``len(tokens) // n_ctx`` of them (at most ``--chunks``). When the model adds BOS, the chunk's first token is replaced
  by BOS (the text's tokens are otherwise unchanged, so every chunk but the first loses one token to it).
- Only the second half is scored: with ``first = n_ctx // 2``, the logits at positions ``first .. n_ctx - 2`` predict
  tokens ``first + 1 .. n_ctx - 1``, ``n_ctx - first - 1`` tokens per chunk.
- ``-log softmax(logits)[target]`` is summed in double (llama.cpp: the row's maximum in float, ``expf`` of each
  logit less it summed in double; here everything in float64). After each chunk the running figure is
  ``exp(sum / count)``; the final estimate is that, ``+/- ppl * sqrt((mean(nll^2) - mean(nll)^2) / (count - 1))``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from ..errors import ModelError

__all__ = ["PerplexityRun", "chunk_starts", "read_text", "scored_rows", "token_nll", "window"]


def read_text(data: bytes) -> str:
    """The text of a ``--text-file``'s bytes as ``llama-perplexity -f`` reads it: one trailing newline dropped."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelError(f"the text file is not UTF-8 ({exc})") from exc
    return text[:-1] if text.endswith("\n") else text


def scored_rows(n_ctx: int) -> tuple[int, int]:
    """``(first, n)``: a chunk's logits at positions ``first .. first + n - 1`` are scored (``first = n_ctx // 2``,
    ``n = n_ctx - first - 1``), each against the next token."""
    first = n_ctx // 2
    n = n_ctx - first - 1
    if n < 1:
        raise ModelError(f"a context of {n_ctx} tokens scores no token; use at least 3")
    return first, n


def chunk_starts(n_tokens: int, n_ctx: int, n_chunks: int | None = None) -> list[int]:
    """Where each chunk of ``n_ctx`` tokens starts: ``n_tokens // n_ctx`` chunks, at most ``n_chunks`` (None or a
    negative number: all). Fewer than ``2 * n_ctx`` tokens is an error, as in llama.cpp."""
    scored_rows(n_ctx)
    if n_tokens < 2 * n_ctx:
        raise ModelError(f"perplexity with a context of {n_ctx} needs at least {2 * n_ctx} tokens; the text "
                         f"tokenizes to only {n_tokens}")
    count = n_tokens // n_ctx
    if n_chunks is not None and n_chunks >= 0:
        count = min(count, n_chunks)
    return [i * n_ctx for i in range(count)]


def window(tokens: Sequence[int], start: int, n_ctx: int, bos: int | None) -> list[int]:
    """The ids a chunk is evaluated on: ``tokens[start : start + n_ctx]``, the first replaced by ``bos`` (when the
    model adds BOS; None: kept)."""
    ids = [int(t) for t in tokens[start : start + n_ctx]]
    if len(ids) != n_ctx:
        raise ModelError(f"chunk at {start} runs past the {len(tokens)} tokens")
    if bos is not None:
        ids[0] = int(bos)
    return ids


def token_nll(logits: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """``-log softmax(row)[target]`` of each row of ``logits [n, vocab]``, in float64 ``[n]``."""
    z = logits.detach().to(torch.float64)
    tgt = torch.as_tensor(targets, dtype=torch.long, device=z.device).reshape(-1, 1)
    if z.ndim != 2 or tgt.shape[0] != z.shape[0]:
        raise ModelError(f"{tgt.shape[0]} targets for logits of shape {tuple(z.shape)}")
    top = z.amax(-1, keepdim=True)
    lse = top + torch.log(torch.exp(z - top).sum(-1, keepdim=True))
    return (lse - z.gather(1, tgt)).reshape(-1).cpu()


@dataclasses.dataclass
class PerplexityRun:
    """The running sums over scored tokens, as llama.cpp keeps them; ``chunks``: the running perplexity after each
    chunk (what it prints as ``[1]x,[2]y,...``)."""

    nll: float = 0.0
    nll2: float = 0.0
    count: int = 0
    chunks: list[float] = dataclasses.field(default_factory=list)

    def add(self, nlls: torch.Tensor) -> float:
        """Add one chunk's per-token NLLs (float64); returns the running perplexity."""
        v = nlls.to(torch.float64)
        self.nll += float(v.sum())
        self.nll2 += float((v * v).sum())
        self.count += int(v.numel())
        self.chunks.append(math.exp(self.nll / self.count))
        return self.chunks[-1]

    @property
    def ppl(self) -> float:
        return math.exp(self.nll / self.count)

    @property
    def ppl_error(self) -> float:
        """llama.cpp's ``+/-``: ``ppl * sqrt(var(nll) / (count - 1))`` (0 when undefined)."""
        mean = self.nll / self.count
        var = self.nll2 / self.count - mean * mean
        if var <= 0 or self.count < 2:
            return 0.0
        return self.ppl * math.sqrt(var / (self.count - 1))

    def as_dict(self) -> dict:
        return {"ppl": self.ppl, "ppl_error": self.ppl_error, "mean_nll": self.nll / self.count,
                "scored_tokens": self.count, "chunk_ppl": list(self.chunks)}
