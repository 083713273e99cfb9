"""A chain of stages in one process, driven through the same per-stage API that the network uses.

``LocalChain`` is what ``sangama-peer generate --local`` runs and what network results are compared against.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from ..errors import CapacityError, ModelError
from ..guesses import AUTO_MAX_GUESSES, MAX_GUESSES, parse_guesses
from .checkpoint import Checkpoint
from .decode import Decoder, LastStep, finish_steps
from .sampling import SamplingParams
from .speculative import GuessPolicy
from .spec import LayerRange
from .stage import StageModel, StepInput
from .state import SessionState

__all__ = ["AUTO_MAX_GUESSES", "GenerationResult", "LocalChain", "MAX_GUESSES", "StageTiming", "parse_guesses"]



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
    steps: int = 0  # trips after the prefill
    guesses_proposed: int = 0
    guesses_accepted: int = 0
    accepted_at: list[float] = dataclasses.field(default_factory=list)  # acceptance rate of guess j+1

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.tokens) - 1, 0)  # the first new token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return (len(self.tokens) - 1) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict:
        return {
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "text": self.text,
            "prefill_ms": round(self.prefill_s * 1e3, 3),
            "decode_ms": round(self.decode_s * 1e3, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "steps": self.steps,
            "tokens_per_step": round(self.tokens_per_step, 3),
            "guesses_proposed": self.guesses_proposed,
            "guesses_accepted": self.guesses_accepted,
            "accepted_per_step": round(self.guesses_accepted / self.steps, 3) if self.steps else 0.0,
            "acceptance_by_position": [round(a, 3) for a in self.accepted_at],
            "stages": [s.as_dict() for s in self.stages],
        }


@dataclasses.dataclass
class _Request:
    prompt: list[int]
    max_new: int
    sessions: list[SessionState]
    decoder: Decoder
    pending: list[int]  # token ids of the next step (last token + guesses)
    eos: frozenset[int]
    index: int = 0  # in the prompts given
    n_guesses: int = 0
    start: int = 0
    out: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
    t_first: float = 0.0
    t_done: float = 0.0


class LocalChain:
    """Stages covering all layers, in order, in this process."""

    def __init__(self, stages: Sequence[StageModel], tokenizer=None) -> None:
        self.stages = list(stages)
        self.tokenizer = tokenizer
        self.spec = self.stages[0].spec

    @classmethod
    def load(cls, ckpt: Checkpoint, ranges: Sequence[LayerRange], *, dtype="float32", device="cpu",
             batch_invariant: bool = False, fused: bool = True) -> "LocalChain":
        stages = [StageModel.load(ckpt.spec, ckpt.source, r.start, r.end, dtype=dtype, device=device,
                                  batch_invariant=batch_invariant, fused=fused) for r in ranges]
        return cls(stages, ckpt.tokenizer)

    @property
    def can_guess(self) -> bool:
        return self.stages[-1].mtp is not None

    def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        *,
        guesses: int | str = 0,
        stop_at_eos: bool = True,
        capacity: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> GenerationResult:
        """One request; ``guesses``: a fixed number of MTP guesses per step, or ``"auto"``."""
        return self.generate_many([prompt_ids], max_new_tokens, sampling, guesses=guesses, stop_at_eos=stop_at_eos,
                                  capacity=capacity, stop_tokens=stop_tokens, on_tokens=on_tokens)[0]

    def generate_many(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        *,
        guesses: int | str | Sequence[int | str] = 0,
        stop_at_eos: bool = True,
        capacity: int | None = None,
        stop_tokens: Sequence[int] | None = None,
        on_tokens: Callable[[int, list[int]], None] | None = None,
    ) -> list[GenerationResult]:
        """Several requests at once: every trip runs all unfinished requests as one batched step per stage.

        ``guesses`` is one setting for all requests, or one per request. ``stop_tokens`` replaces the model's eos
        ids as the ids that end a request (e.g. a chat template's end-of-turn tokens); ``stop_at_eos=False`` ignores
        both. ``on_tokens(i, ids)`` is called with request ``i``'s new ids after every trip that produced some.
        """
        settings = list(guesses) if isinstance(guesses, (list, tuple)) else [guesses] * len(prompts)
        if len(settings) != len(prompts):
            raise ModelError(f"{len(settings)} guess settings for {len(prompts)} prompts")
        stops = self.spec.eos_token_ids if stop_tokens is None else stop_tokens
        eos = frozenset(int(t) for t in stops) if stop_at_eos else frozenset()
        timings = [StageTiming(f"{s.start}:{s.end}") for s in self.stages]
        reqs = []
        for i, (prompt, setting) in enumerate(zip(prompts, settings)):
            max_guesses, adaptive = parse_guesses(setting)
            if max_guesses and not self.can_guess:
                raise ModelError("guesses need the checkpoint's MTP layer on the last stage (this model has none)")
            prompt = list(prompt)
            if not prompt:
                raise CapacityError("the prompt is empty")
            cap = capacity or len(prompt) + max_new_tokens + max_guesses + 1
            if len(prompt) + max_new_tokens > cap:
                raise CapacityError(
                    f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds the session capacity {cap}"
                )
            ring = max_guesses + 1 if max_guesses else 0
            sessions = [s.new_session(cap, ring=ring) for s in self.stages]
            params = dataclasses.replace(sampling, seed=sampling.seed + i)
            dec = Decoder(sessions[-1], params, GuessPolicy(max_guesses, adaptive))
            reqs.append(_Request(prompt, max_new_tokens, sessions, dec, pending=prompt, eos=eos, index=i))
        t0 = time.perf_counter()
        while True:
            active = [r for r in reqs if not r.done]
            if not active:
                break
            self._trip(active, timings, on_tokens)
            now = time.perf_counter()
            for r in active:
                if not r.t_first:
                    r.t_first = now
                if r.done:
                    r.t_done = now
        results = []
        for r in reqs:
            d = r.decoder
            text = self.tokenizer.decode(r.out) if self.tokenizer is not None else None
            by_pos = [a / p for a, p in zip(d.accepted_at, d.proposed_at) if p]
            results.append(GenerationResult(
                r.prompt, r.out, text, r.t_first - t0, r.t_done - r.t_first, timings,
                steps=d.steps - 1, guesses_proposed=d.proposed, guesses_accepted=d.accepted, accepted_at=by_pos))
        return results

    def _trip(self, reqs: list[_Request], timings: list[StageTiming],
              on_tokens: Callable[[int, list[int]], None] | None = None) -> None:
        """One batched trip through every stage for ``reqs``; updates each request."""
        x: torch.Tensor | None = None
        t_trip = time.thread_time()  # the guess policy weighs compute time (Decoder.record_trip)
        for i, stage in enumerate(self.stages):
            t0 = time.perf_counter()
            if stage.is_first:
                steps = [StepInput(r.sessions[i], r.start, tokens=torch.tensor(r.pending)) for r in reqs]
            else:
                assert x is not None
                chunks = torch.split(x, [len(r.pending) for r in reqs])
                steps = [StepInput(r.sessions[i], r.start, hidden=h) for r, h in zip(reqs, chunks)]
            x = stage.forward(steps)
            if stage.is_last:
                outs = finish_steps(stage, [LastStep(r.decoder, r.start, r.pending, r.n_guesses) for r in reqs], x)
            timings[i].calls += 1
            timings[i].seconds += time.perf_counter() - t0
        t_trip = time.thread_time() - t_trip
        for r, o in zip(reqs, outs):
            r.decoder.record_trip(t_trip)
            r.start += len(r.pending) - r.n_guesses + o.accepted
            before = len(r.out)
            for tok in o.tokens:
                if len(r.out) >= r.max_new:
                    break
                r.out.append(tok)
                if tok in r.eos:
                    break
            if on_tokens is not None and len(r.out) > before:
                on_tokens(r.index, r.out[before:])
            if len(r.out) >= r.max_new or r.out[-1] in r.eos:
                r.done = True
            r.pending = [o.tokens[-1], *o.guesses]
            r.n_guesses = len(o.guesses)

