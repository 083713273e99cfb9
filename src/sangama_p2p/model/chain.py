"""A chain of stages in one process, driven through the same per-stage API that the network uses.

``LocalChain`` is what ``sangama-peer generate --local`` runs and what network results are compared against.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

import torch

from ..errors import CapacityError
from .checkpoint import Checkpoint
from .sampling import SamplingParams, next_token
from .spec import LayerRange
from .stage import StageModel, StepInput
from .state import SessionState

__all__ = ["GenerationResult", "LocalChain", "StageTiming"]


@dataclasses.dataclass
class StageTiming:
    layers: str
    calls: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"layers": self.layers, "calls": self.calls, "total_ms": round(self.seconds * 1e3, 3),
                "mean_ms": round(self.seconds * 1e3 / max(self.calls, 1), 3)}


@dataclasses.dataclass
class GenerationResult:
    prompt_ids: list[int]
    tokens: list[int]  # new token ids
    text: str | None
    prefill_s: float
    decode_s: float
    stages: list[StageTiming]

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.tokens) - 1, 0)  # the first new token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "text": self.text,
            "prefill_ms": round(self.prefill_s * 1e3, 3),
            "decode_ms": round(self.decode_s * 1e3, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "stages": [s.as_dict() for s in self.stages],
        }


class LocalChain:
    """Stages covering all layers, in order, in this process."""

    def __init__(self, stages: Sequence[StageModel], tokenizer=None) -> None:
        self.stages = list(stages)
        self.tokenizer = tokenizer
        spec = self.stages[0].spec
        self.spec = spec

    @classmethod
    def load(cls, ckpt: Checkpoint, ranges: Sequence[LayerRange], *, dtype="float32") -> "LocalChain":
        stages = [StageModel.load(ckpt.spec, ckpt.source, r.start, r.end, dtype=dtype) for r in ranges]
        return cls(stages, ckpt.tokenizer)

    def new_sessions(self, capacity: int, ring: int = 0) -> list[SessionState]:
        return [s.new_session(capacity, ring=ring) for s in self.stages]

    def step(self, sessions: Sequence[SessionState], start: int, tokens: torch.Tensor,
             timings: list[StageTiming] | None = None) -> torch.Tensor:
        """One trip through every stage for one session: logits ``[T, V]`` for the T new positions."""
        x: torch.Tensor | None = None
        for i, (stage, state) in enumerate(zip(self.stages, sessions)):
            t0 = time.perf_counter()
            inp = StepInput(state, start, tokens=tokens) if stage.is_first else StepInput(state, start, hidden=x)
            x = stage.forward([inp])
            if stage.is_last:
                x = stage.logits(x)
            if timings is not None:
                timings[i].calls += 1
                timings[i].seconds += time.perf_counter() - t0
        assert x is not None
        return x

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        *,
        stop_at_eos: bool = True,
        capacity: int | None = None,
    ) -> GenerationResult:
        prompt = list(prompt_ids)
        if not prompt:
            raise CapacityError("the prompt is empty")
        cap = capacity or len(prompt) + max_new_tokens
        if len(prompt) + max_new_tokens > cap:
            raise CapacityError(
                f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds the session capacity {cap}"
            )
        sessions = self.new_sessions(cap)
        gen = torch.Generator().manual_seed(sampling.seed)
        timings = [StageTiming(f"{s.start}:{s.end}") for s in self.stages]
        eos = set(self.spec.eos_token_ids) if stop_at_eos else set()
        out: list[int] = []
        t0 = time.perf_counter()
        logits = self.step(sessions, 0, torch.tensor(prompt), timings)
        tok = next_token(logits[-1], sampling, gen)
        t1 = time.perf_counter()
        out.append(tok)
        pos = len(prompt)
        while len(out) < max_new_tokens and tok not in eos:
            logits = self.step(sessions, pos, torch.tensor([tok]), timings)
            tok = next_token(logits[-1], sampling, gen)
            out.append(tok)
            pos += 1
        t2 = time.perf_counter()
        text = self.tokenizer.decode(out) if self.tokenizer is not None else None
        return GenerationResult(prompt, out, text, t1 - t0, t2 - t1, timings)
