"""Prometheus gauges of the swarm, read from the dashboard's latest view at scrape time (``GET /metrics``).

Names are listed in docs/operations.md; every series comes from the last finished survey, so a scrape never waits
for the network.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["SwarmCollector", "swarm_registry"]


class SwarmCollector:
    """Series of a :class:`~sangama_p2p.dashboard.live.SwarmWatch`'s state."""

    def __init__(self, watch: Any) -> None:
        self.watch = watch

    def collect(self) -> Iterator[Any]:
        w = self.watch
        view = w.view
        surveys = CounterMetricFamily("sangama_swarm_surveys", "surveys finished, by outcome", labels=["outcome"])
        surveys.add_metric(["ok"], w.version - w.failures)
        surveys.add_metric(["failed"], w.failures)
        yield surveys
        yield GaugeMetricFamily("sangama_swarm_survey_seconds", "how long the last survey took", value=w.survey_s)
        peers = GaugeMetricFamily("sangama_swarm_peers", "peers in the last survey: serving (up), probe failing "
                                  "(down), serving nothing (other)", labels=["state"])
        for state, key in (("up", "up"), ("down", "down"), ("other", "others")):
            peers.add_metric([state], view["counts"][key])
        yield peers
        stage = ["peer", "model", "layers", "reach", "version"]
        up = GaugeMetricFamily("sangama_swarm_stage_up", "1 for a stage that answers, 0 for one shown down",
                               labels=stage)
        tps = GaugeMetricFamily("sangama_swarm_stage_steps_per_second", "a stage's measured steps per second",
                                labels=stage)
        free = GaugeMetricFamily("sangama_swarm_stage_sessions_free", "sessions a stage can still open", labels=stage)
        queue = GaugeMetricFamily("sangama_swarm_stage_queue", "steps queued or computing at a stage", labels=stage)
        rtt = GaugeMetricFamily("sangama_swarm_stage_rtt_seconds", "round trip of the survey's records request",
                                labels=stage)
        moves = GaugeMetricFamily("sangama_swarm_stage_moves", "rebalancing moves a stage made", labels=stage)
        for row in view["peers"]:
            key = [row["id"], row["model"], row["layers"], row["reach"], row["version"]]
            up.add_metric(key, 1 if row["state"] == "up" else 0)
            if row["state"] != "up":
                continue
            tps.add_metric(key, row["steps_per_s"])
            free.add_metric(key, row["free_sessions"])
            if row["queue"] is not None:
                queue.add_metric(key, row["queue"])
            if row["rtt_ms"] is not None:
                rtt.add_metric(key, row["rtt_ms"] / 1000)
            moves.add_metric(key, row["moves"])
        yield from (up, tps, free, queue, rtt, moves)
        layers = GaugeMetricFamily("sangama_swarm_layers", "a model's depth", labels=["model"])
        covered = GaugeMetricFamily("sangama_swarm_layers_covered", "layers at least one stage serves",
                                    labels=["model"])
        gaps = GaugeMetricFamily("sangama_swarm_layer_gaps", "ranges of layers no stage serves", labels=["model"])
        for m in view["models"]:
            layers.add_metric([m["id"]], m["num_layers"])
            covered.add_metric([m["id"]], m["covered"])
            gaps.add_metric([m["id"]], len(m["gaps"]))
        yield from (layers, covered, gaps)
        link = GaugeMetricFamily("sangama_swarm_link_rtt_seconds", "round trip a stage measured to a successor",
                                 labels=["model", "src", "dst"])
        for ln in view["links"]:
            link.add_metric([ln["model"], ln["from"], ln["to"]], ln["rtt_ms"] / 1000)
        yield link
        yield GaugeMetricFamily("sangama_swarm_bans", "peers banned on this machine, in force", value=len(view["bans"]))


def swarm_registry(watch: Any) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(watch))
    return registry
