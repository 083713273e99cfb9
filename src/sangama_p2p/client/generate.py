"""``ChainClient``: generate tokens through a chain of stage peers found in the DHT.

Usage (trio; ``node`` from :func:`sangama_p2p.net.open_host`)::

    from sangama_p2p.client import ChainClient, ClientConfig

    async with ChainClient(node, ClientConfig(model_id="org/model")) as client:
        result = await client.generate(prompt_ids, max_new_tokens=64, temperature=0.0, guesses="auto",
                                       stop_tokens=spec.eos_token_ids)
        result.tokens                 # new token ids (equal to LocalChain's for the same model, split and settings)
        result.trips                  # [TripTiming]: per trip, each stage's queue/compute/send and the network
        summarize_trips(result.trips) # "where the time goes", mean ms per trip
        async for token in client.stream(prompt_ids, 64):   # tokens as soon as each trip returns
            ...

What ``generate`` does: find the peers serving ``model_id`` (DHT), measure each one's RTT with an
``/sangama/info/1`` round trip (which also brings its fresh throughput and queue), pick the cheapest chain
(:func:`~sangama_p2p.client.routing.plan_route`), open a session on every stage, then run trips: STEP to the first
stage, which forwards hidden states stage to stage; the last stage checks the guesses, samples, drafts new guesses
and answers the client directly. ``guesses`` is a fixed count (0..8) or ``"auto"`` (adaptive, up to 6). When a
stage fails (stream reset, peer gone, timeout), the client probes the chain, re-routes around the dead peers and
replays the prompt plus the tokens produced so far to the new chain, so the generation completes with the same
tokens (exactly so for greedy decoding).

Many ``generate`` calls may run concurrently on one client: they share one long-lived stream per stage peer, and
the stages batch their steps.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import trio

from ..errors import ModelError
from .config import ClientConfig
from .timing import TripTiming

__all__ = ["AUTO_MAX_GUESSES", "MAX_GUESSES", "ChainClient", "GenerationResult", "parse_guesses"]

MAX_GUESSES = 8  # the most guesses one step may carry (as model.chain.MAX_GUESSES)
AUTO_MAX_GUESSES = 6  # the adaptive policy's ceiling (as model.chain.AUTO_MAX_GUESSES)


def parse_guesses(value: int | str) -> tuple[int, bool]:
    """``4`` -> (4, fixed); ``"auto"`` -> (AUTO_MAX_GUESSES, adaptive). Same rule as ``model.chain.parse_guesses``."""
    if value == "auto":
        return AUTO_MAX_GUESSES, True
    try:
        k = int(value)
    except (TypeError, ValueError) as exc:
        raise ModelError(f"guesses must be an integer >= 0 or 'auto', got {value!r}") from exc
    if k < 0 or k > MAX_GUESSES:
        raise ModelError(f"guesses must be in 0..{MAX_GUESSES} or 'auto', got {k}")
    return k, False


@dataclass
class GenerationResult:
    """One request's outcome over the network."""

    prompt_ids: list[int]
    tokens: list[int]  # new token ids
    trips: list[TripTiming] = field(default_factory=list)  # every trip, the prefill first
    route: list[str] = field(default_factory=list)  # peer ids of the final chain, in order
    failovers: int = 0  # re-routes this generation needed
    prefill_s: float = 0.0  # until the first new token
    decode_s: float = 0.0  # from the first new token to the last
    guesses_proposed: int = 0
    guesses_accepted: int = 0

    @property
    def steps(self) -> int:
        """Trips after the prefill (replays after a failover count as trips too)."""
        return max(len(self.trips) - 1, 0)

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(len(self.tokens) - 1, 0)
        return n / self.decode_s if self.decode_s > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        from .timing import summarize_trips

        return {
            "prompt_ids": self.prompt_ids,
            "tokens": self.tokens,
            "route": self.route,
            "failovers": self.failovers,
            "prefill_ms": round(self.prefill_s * 1e3, 3),
            "decode_ms": round(self.decode_s * 1e3, 3),
            "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
            "steps": self.steps,
            "guesses_proposed": self.guesses_proposed,
            "guesses_accepted": self.guesses_accepted,
            "where_the_time_goes": summarize_trips(self.trips),
        }


class ChainClient:
    """Drives generations through the swarm; an ``async with`` object owning its links' tasks (see module doc)."""

    def __init__(self, node: Any, config: ClientConfig) -> None:
        self.node = node
        self.config = config

    async def __aenter__(self) -> ChainClient:
        raise NotImplementedError

    async def __aexit__(self, *exc: object) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close every session and stream this client opened."""
        raise NotImplementedError

    async def generate(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int,
        *,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        guesses: int | str = 0,
        stop_tokens: Sequence[int] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` after ``prompt_ids``; stop early at any of ``stop_tokens``.

        ``on_tokens`` is called with each trip's new tokens as soon as they arrive. Raises
        :class:`~sangama_p2p.errors.RouteError` when no chain covers the model (also after ``max_failovers``
        re-routes), :class:`~sangama_p2p.errors.StageError` (with its ``code``) when a stage refuses the request
        for a reason a re-route cannot fix (e.g. ``CAPACITY`` on every candidate, ``BAD_POSITION``).
        """
        raise NotImplementedError

    async def stream(self, prompt_ids: Sequence[int], max_new_tokens: int, **kwargs: Any) -> AsyncIterator[int]:
        """Like :meth:`generate`, yielding each new token id as soon as its trip returns."""
        raise NotImplementedError
        yield 0  # pragma: no cover

    async def survey(self) -> list[Any]:
        """The peers serving ``model_id`` as :class:`~sangama_p2p.client.routing.PeerOffer` (DHT records refreshed
        with each peer's own ``/sangama/info/1`` answer and the measured RTT)."""
        raise NotImplementedError


_ = trio  # used by the implementation
