"""A chain of stages in one process, driven through the same per-stage API that the network uses.

``LocalChain`` is what ``sangama-peer generate --local`` runs and what network results are compared against.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Sequence

import torch

from ..errors import CapacityError, ModelError
from ..generation import Answer, Generation, GenerationLoop, GenerationResult, Trip
from ..guesses import AUTO_MAX_GUESSES, MAX_GUESSES, parse_guesses
from ..positions import ring_size, session_length
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
class _Request:
    """One request's runtime state on the local chain: its session on every stage, its decoder on the last."""

    sessions: list[SessionState]
    decoder: Decoder


class _LocalTransport:
    """The generation loop's transport in this process (``generation.Transport``): every trip runs all its requests
    as one batched step per stage; ``timings`` adds up each stage's calls and seconds."""

    def __init__(self, stages: list[StageModel], reqs: list[_Request], timings: list[StageTiming]) -> None:
        self.stages, self.reqs, self.timings = stages, reqs, timings

    def run(self, trips: Sequence[Trip]) -> list[Answer | None]:
        reqs = [self.reqs[t.index] for t in trips]
        x: torch.Tensor | None = None
        t_trip = time.thread_time()  # the guess policy weighs compute time (Decoder.record_trip)
        for i, stage in enumerate(self.stages):
            t0 = time.perf_counter()
            if stage.is_first:
                steps = [StepInput(r.sessions[i], t.start, tokens=torch.tensor(t.tokens)) for r, t in zip(reqs, trips)]
            else:
                assert x is not None
                chunks = torch.split(x, [len(t.tokens) for t in trips])
                steps = [StepInput(r.sessions[i], t.start, hidden=h) for r, t, h in zip(reqs, trips, chunks)]
            x = stage.forward(steps)
            if stage.is_last:
                outs = finish_steps(stage, [LastStep(r.decoder, t.start, t.tokens, t.n_guesses)
                                            for r, t in zip(reqs, trips)], x)
            self.timings[i].calls += 1
            self.timings[i].seconds += time.perf_counter() - t0
        t_trip = time.thread_time() - t_trip
        for r in reqs:
            r.decoder.record_trip(t_trip)
        return [Answer(o.tokens, o.guesses) for o in outs]


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
        reqs, prompts = [], [list(p) for p in prompts]
        for i, (prompt, setting) in enumerate(zip(prompts, settings)):
            max_guesses, adaptive = parse_guesses(setting)
            if max_guesses and not self.can_guess:
                raise ModelError("guesses need the checkpoint's MTP layer on the last stage (this model has none)")
            if not prompt:
                raise CapacityError("the prompt is empty")
            cap = capacity or session_length(len(prompt), max_new_tokens, max_guesses)
            if len(prompt) + max_new_tokens > cap:
                raise CapacityError(
                    f"prompt of {len(prompt)} tokens + {max_new_tokens} new tokens exceeds the session capacity {cap}"
                )
            sessions = [s.new_session(cap, ring=ring_size(max_guesses)) for s in self.stages]
            params = dataclasses.replace(sampling, seed=sampling.seed + i)
            reqs.append(_Request(sessions, Decoder(sessions[-1], params, GuessPolicy(max_guesses, adaptive))))
        loop = GenerationLoop([Generation(GenerationResult(p, [], stages=timings), max_new_tokens, eos, index=i)
                               for i, p in enumerate(prompts)])
        transport = _LocalTransport(self.stages, reqs, timings)
        while trips := loop.trips():
            for index, new in loop.finish(transport.run(trips), time.perf_counter()):
                if on_tokens is not None:
                    on_tokens(index, new)
        results = [g.result for g in loop.generations]
        for r in results:
            r.text = self.tokenizer.decode(r.tokens) if self.tokenizer is not None else None
        return results
