"""Prometheus metrics of ``sangama-peer api`` (``GET /metrics``): what its client saw of the swarm, per model -
generations, tokens, failovers, trips a second chain checked or could not, liars banned - read at scrape time
from :class:`~sangama_p2p.client.stats.ClientStats` counters the client keeps anyway, and the requests running now.
Stages export their own (``join --metrics-port``: steps, queue, sessions, bytes); metric names in docs/operations.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "api_registry"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_COUNTERS = (("generations", "generations ended (failed ones included)"),
             ("failed", "generations that ended in an error"),
             ("tokens", "tokens the generations produced"),
             ("failovers", "re-routes around a failed or misbehaving stage"),
             ("verified_trips", "trips re-run on a second chain that agreed (--verify)"),
             ("unverified_trips", "trips drawn for a check that no second chain could check (--verify)"),
             ("liars_banned", "peers the verifier banned for wrong tokens"))


class _ApiCollector:
    def __init__(self, models: Callable[[], list[str]], stats: Callable[[], Mapping[str, Any]],
                 running: Callable[[], int]) -> None:
        self.models, self.stats, self.running = models, stats, running

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        for name, doc in _COUNTERS:
            family = CounterMetricFamily(f"sangama_client_{name}", doc, labels=["model"])
            for model in self.models():
                family.add_metric([model], getattr(stats.get(model), name, 0))
            yield family
        running = GaugeMetricFamily("sangama_api_requests_running", "completion requests running now")
        running.add_metric([], self.running())
        yield running


def api_registry(models: Callable[[], list[str]], stats: Callable[[], Mapping[str, Any]],
                 running: Callable[[], int]) -> CollectorRegistry:
    """A registry of its own (never prometheus_client's global one) over the server's live counters:
    ``stats()`` maps a model id to its client's ``ClientStats`` (absent: no request yet, all zero)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ApiCollector(models, stats, running))  # type: ignore[arg-type]
    return registry
