"""The generation loop, written once for the local chain and the network client. Pure: no torch, no I/O, no trio.

A request's loop - the prefill (in chunks where the driver limits a step's tokens), the trips, the bookkeeping of
checked and accepted guesses, the emission of new tokens up to ``max_new`` or a stop token, stopping, and the
prefill/decode timing - is :class:`Generation`; :class:`GenerationLoop` runs several at once (one trip carries every
unfinished request). It never runs a trip itself: a driver asks for the trips (:meth:`GenerationLoop.trips`), has
its *transport* run them and hands the answers back (:meth:`GenerationLoop.finish`)::

    while trips := loop.trips():
        for index, new in loop.finish(transport.run(trips)):  # network: await transport.run(trips)
            ...                                                 # emit ``new`` (a trip's new tokens)

The transports (:class:`Transport`) are ``model.chain.LocalChain``'s stages in this process (synchronous, many
requests batched per trip) and ``client.transport.ChainTransport``'s network session (trio, one request, with
failover: when a chain breaks it routes a new one and answers ``None``, and the request then replays its answered
trips in their original shapes, so the new chain's numbers are the old one's). So the driving code is the same
three lines whether its transport is awaited
or not, and all position arithmetic is ``positions.py``'s.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .clock import now as clock_now
from .positions import next_start

__all__ = ["Answer", "Generation", "GenerationLoop", "GenerationResult", "Rewind", "Transport", "Trip"]


@dataclass(frozen=True)
class Trip:
    """What one trip carries for one request: ``tokens`` from position ``start``, the last ``n_guesses`` of them
    guesses. ``number`` counts the request's trips (the wire's step number); ``chunk``: a prefill chunk, whose answer
    is not used."""

    index: int
    number: int
    start: int
    tokens: tuple[int, ...]
    n_guesses: int = 0
    chunk: bool = False
    replay: bool = False  # a replay of an earlier trip after a failover: its answer is checked, not emitted


@dataclass(frozen=True)
class Answer:
    """The last stage's answer to a trip: the accepted guesses and one new token, and the next trip's guesses."""

    tokens: tuple[int, ...]
    guesses: tuple[int, ...] = ()
    # one per token when the request asked for log-probabilities (wire.TokenLogprobs); a replay compares tokens only
    logprobs: tuple[Any, ...] = field(default=(), compare=False)

    @property
    def accepted(self) -> int:
        return len(self.tokens) - 1


@dataclass(frozen=True)
class Rewind:
    """A transport's answer instead of :class:`Answer`: the chain was replaced *and* only the first ``keep`` new
    tokens stand (a verifier caught the old chain lying after them). The request goes back to them - the trips that
    produced them are replayed in their shapes, the later ones dropped - and goes on from there on the new chain."""

    keep: int


class Transport(Protocol):
    """Runs trips: one answer per trip, in order; ``None`` where the chain was replaced (the request replays), a
    :class:`Rewind` where it was replaced after a lie. The network's ``run`` is a coroutine function with the same
    signature."""

    def run(self, trips: Sequence[Trip]) -> list[Answer | Rewind | None]: ...


@dataclass
class GenerationResult:
    """One request's outcome, local or over the network.

    ``route`` is None for a generation in this process (``stages``: compute per stage) and the peers of the final
    chain over the network (``trips``: each trip's timing, the prefill first; ``time_summary`` summarizes them).
    """

    prompt_ids: list[int]
    tokens: list[int]  # new token ids
    text: str | None = None
    logprobs: list[Any] = field(default_factory=list)  # one per new token when asked for (wire.TokenLogprobs)
    prefill_s: float = 0.0  # until the first new token
    decode_s: float = 0.0  # from the first new token to the last
    steps: int = 0  # trips after the first (prefill chunks and replays count too)
    guesses_proposed: int = 0
    guesses_accepted: int = 0
    accepted_at: list[float] = field(default_factory=list)  # acceptance rate of guess j+1
    stages: list[Any] = field(default_factory=list)  # local: model.chain.StageTiming per stage
    route: list[str] | None = None  # network: peer ids of the final chain, in order
    links: list[str] = field(default_factory=list)  # network: what carried the stream to each, at the last trip
    hops: list[dict[str, Any]] = field(default_factory=list)  # network: each hop's one-way latency the route was
    # planned with, client to client ({"from", "to", "ms", "measured"}: measured by the stage or the client, or an
    # estimate where nobody measured it)
    trips: list[Any] = field(default_factory=list)  # network: client.timing.TripTiming per trip
    failovers: int = 0  # network: re-routes this generation needed
    replayed_trips: int = 0  # network: trips re-sent to replacement chains (each failover replays every trip so far)
    replay_diverged: int | None = None  # the first replayed trip whose answer differed from the original's, if any
    retracted: int = 0  # network: new tokens already returned that a verifier found wrong and took back (Rewind)
    verified_trips: int | None = None  # network, verifying: trips re-run on a second chain that agreed (else None)
    unverified_trips: int | None = None  # network, verifying: trips drawn for a check that could not be checked
    time_summary: Callable[[list[Any]], dict] | None = field(default=None, repr=False, compare=False)

    def failover_note(self) -> str:
        """What the failovers of this generation did to its tokens, in a sentence (empty without failovers)."""
        if not self.failovers:
            return ""
        head = f"the chain failed {self.failovers} time{'s' if self.failovers != 1 else ''} during this generation: "
        if self.retracted:
            head += (f"a peer was caught answering wrong tokens, and {self.retracted} tokens already returned were "
                     "taken back and generated again without it; ")
        if self.replay_diverged is None:
            return (head + f"re-routed and replayed {self.replayed_trips} trips in their original shapes, every "
                    "answer as before: the tokens are those of an uninterrupted run")
        return (head + f"re-routed and replayed, but the new chain answered trip {self.replay_diverged} differently "
                "(another device, dtype or kernel build computes other roundings): the tokens from there on may "
                "differ from an uninterrupted run's")

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.tokens) - 1, 0)  # the first new token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def tokens_per_step(self) -> float:
        return (len(self.tokens) - 1) / self.steps if self.steps else 0.0

    def as_dict(self) -> dict[str, Any]:
        local = self.route is None
        d: dict[str, Any] = {"prompt_ids": self.prompt_ids, "tokens": self.tokens}
        d.update({"text": self.text} if local else {"route": self.route, "links": self.links, "hops": self.hops,
                                                    "failovers": self.failovers,
                                                    "replayed_trips": self.replayed_trips,
                                                    "replay_exact": self.replay_diverged is None,
                                                    "retracted": self.retracted,
                                                    "verified_trips": self.verified_trips,
                                                    "unverified_trips": self.unverified_trips})
        d.update({
            "prefill_ms": round(self.prefill_s * 1e3, 3),
            "decode_ms": round(self.decode_s * 1e3, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "steps": self.steps,
        })
        if local:
            d["tokens_per_step"] = round(self.tokens_per_step, 3)
        d.update({"guesses_proposed": self.guesses_proposed, "guesses_accepted": self.guesses_accepted})
        if local:
            d["accepted_per_step"] = round(self.guesses_accepted / self.steps, 3) if self.steps else 0.0
            d["acceptance_by_position"] = [round(a, 3) for a in self.accepted_at]
            d["stages"] = [s.as_dict() for s in self.stages]
        else:
            d["where_the_time_goes"] = self.time_summary(self.trips) if self.time_summary is not None else {}
        return d


class Generation:
    """One request's loop state: what its next trip carries, and what an answer does to it.

    ``max_step_tokens``: the most tokens one trip may carry; a longer prefill or replay goes in chunks (so that no
    hidden-state frame outgrows the frame limit). ``clock``: seconds, for the prefill/decode timing (started now).
    """

    def __init__(self, result: GenerationResult, max_new: int, stop: Iterable[int] = (), *, index: int = 0,
                 max_step_tokens: int | None = None, clock: Callable[[], float] = clock_now) -> None:
        self.result = result
        self.max_new = max_new
        self.stop = frozenset(stop)
        self.index = index
        self.max_step_tokens = max_step_tokens
        self.clock = clock
        self.pending: list[int] = list(result.prompt_ids)  # the next trip's tokens (the new token + guesses)
        self.start = 0
        self.n_guesses = 0
        self.done = False
        self.sent = 0  # trips asked for
        self.answered = 0  # trips answered
        self._proposed_at: list[int] = []
        self._accepted_at: list[int] = []
        self._t0 = clock()
        self._t_first = 0.0
        self.history: list[tuple[Trip, Answer]] = []  # every answered trip and its answer, in order
        # the trips still to re-send to a replacement chain (pending/start/n_guesses keep the failed trip meanwhile)
        self._replay: deque[tuple[Trip, Answer]] = deque()

    def next_trip(self) -> Trip:
        self.sent += 1
        if self._replay:
            t = self._replay[0][0]
            return Trip(self.index, self.sent - 1, t.start, t.tokens, t.n_guesses, t.chunk, replay=True)
        limit = self.max_step_tokens
        chunk = limit is not None and len(self.pending) > limit and not self.n_guesses
        tokens = self.pending[:limit] if chunk else self.pending
        return Trip(self.index, self.sent - 1, self.start, tuple(tokens), self.n_guesses, chunk)

    def finish(self, trip: Trip, answer: Answer | Rewind | None, now: float | None = None) -> list[int]:
        """Apply ``trip``'s answer; returns the tokens it emitted.

        ``None``: the transport replaced the chain. The next trips then replay every answered trip in its original
        shape (the same positions, tokens and guesses, the prompt's chunks as they were sent), so that the new
        chain's caches are computed by the same operations on the same shapes as the old one's - a prefill of
        everything so far would round differently from the steps it replaces, and a greedy near-tie would then go
        the other way. Each replayed answer is checked against the original; the first that differs is recorded in
        ``result.replay_diverged`` (the new chain computes differently: another device, dtype or kernel). Then the
        trip that failed is sent again. A :class:`Rewind` first drops the trips after its ``keep`` tokens."""
        if answer is None:
            self._replay = deque(self.history)  # (a failover during a replay starts it again)
            return []
        if isinstance(answer, Rewind):
            self._rewind(answer.keep)
            self._replay = deque(self.history)
            return []
        if trip.replay:
            return self._replayed(answer)
        self.history.append((trip, answer))
        self.answered += 1
        res = self.result
        res.steps = self.answered - 1
        self._continue_after(trip, answer)
        if trip.chunk:
            return []
        k, accepted = trip.n_guesses, answer.accepted
        if k:
            self._count_guesses(k, accepted)
        out, new = res.tokens, []
        for j, tok in enumerate(answer.tokens):
            if len(out) >= self.max_new:
                break
            out.append(tok)
            new.append(tok)
            if answer.logprobs:
                res.logprobs.append(answer.logprobs[j])
            if tok in self.stop:
                break
        now = self.clock() if now is None else now
        if not self._t_first:
            self._t_first = now
            res.prefill_s = now - self._t0
        res.decode_s = now - self._t_first
        self.done = len(out) >= self.max_new or out[-1] in self.stop
        return new

    def _continue_after(self, trip: Trip, answer: Answer) -> None:
        """Where the next trip starts and what it carries, once ``trip`` was answered with ``answer``."""
        if trip.chunk:  # the rest of the prompt
            self.start = trip.start + len(trip.tokens)
            self.pending, self.n_guesses = list(self.result.prompt_ids[self.start:]), 0
        else:  # the new token and the next guesses
            self.start = next_start(trip.start, len(trip.tokens), trip.n_guesses, answer.accepted)
            self.pending, self.n_guesses = [answer.tokens[-1], *answer.guesses], len(answer.guesses)

    def _rewind(self, keep: int) -> None:
        """Back to the state after the trips that produced the first ``keep`` new tokens (at a trip's end): the later
        trips and their tokens are dropped (counted in ``result.retracted``)."""
        res, kept, n = self.result, [], 0
        for trip, answer in self.history:
            got = 0 if trip.chunk else len(answer.tokens)
            if n + got > keep:
                break
            kept.append((trip, answer))
            n += got
        res.retracted += len(res.tokens) - n
        del res.tokens[n:], res.logprobs[n:]
        self.history, self.answered = kept, len(kept)
        res.steps = max(self.answered - 1, 0)
        if kept:
            self._continue_after(*kept[-1])
        else:
            self.start, self.pending, self.n_guesses = 0, list(res.prompt_ids), 0
        self.done = bool(res.tokens) and (len(res.tokens) >= self.max_new or res.tokens[-1] in self.stop)

    def _replayed(self, answer: Answer) -> list[int]:
        original, want = self._replay.popleft()
        self.result.replayed_trips += 1
        if self.result.replay_diverged is None and not original.chunk and answer != want:
            self.result.replay_diverged = original.number
        return []

    def _count_guesses(self, k: int, accepted: int) -> None:
        res = self.result
        res.guesses_proposed += k
        res.guesses_accepted += accepted
        while len(self._proposed_at) < k:
            self._proposed_at.append(0)
            self._accepted_at.append(0)
        for j in range(k):
            self._proposed_at[j] += 1
            self._accepted_at[j] += j < accepted
        res.accepted_at = [a / p for a, p in zip(self._accepted_at, self._proposed_at)]


class GenerationLoop:
    """Several requests' loops, stepped together: each trip carries every unfinished request once."""

    def __init__(self, generations: Sequence[Generation]) -> None:
        self.generations = list(generations)
        self._by_index = {g.index: g for g in self.generations}
        self._trips: list[Trip] = []

    def trips(self) -> list[Trip]:
        """The next trip of every unfinished request (empty when all are done)."""
        self._trips = [g.next_trip() for g in self.generations if not g.done]
        return self._trips

    def finish(self, answers: Sequence[Answer | Rewind | None],
               now: float | None = None) -> list[tuple[int, list[int]]]:
        """Hand back the answers to the last :meth:`trips`, in order; returns (index, new tokens) of every request
        that emitted some."""
        if len(answers) != len(self._trips):
            raise ValueError(f"{len(answers)} answers for {len(self._trips)} trips")
        emitted = []
        for trip, answer in zip(self._trips, answers):
            new = self._by_index[trip.index].finish(trip, answer, now)
            if new:
                emitted.append((trip.index, new))
        return emitted
