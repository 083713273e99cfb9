"""The client side of the pipeline: routing, chain sessions with failover, the generation loop and its timings.

Usage: see :mod:`sangama_p2p.client.generate`. Never imports ``stage/`` (they share only ``wire/``).
"""

from .config import ClientConfig
from .generate import ChainClient, GenerationResult, parse_guesses
from .routing import RouteCandidate, plan_route
from .timing import StageTime, TripTiming, summarize_trips

__all__ = [
    "ChainClient",
    "ClientConfig",
    "GenerationResult",
    "RouteCandidate",
    "StageTime",
    "TripTiming",
    "parse_guesses",
    "plan_route",
    "summarize_trips",
]
