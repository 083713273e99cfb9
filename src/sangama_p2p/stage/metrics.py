"""Prometheus metrics of a stage process (``join --metrics-port P``): a collector read at scrape time, and a small
trio HTTP server that answers ``GET /metrics`` (text format 0.0.4) and ``GET /health``.

Nothing is instrumented on the hot path: the collector reads what the stage counts anyway (its scheduler's
:class:`~sangama_p2p.stage.scheduler._Stats`, its session table, its streams) and the process's byte counters
(:data:`sangama_p2p.net.streams.FRAME_BYTES` by link kind, :data:`sangama_p2p.net.movable.TRAFFIC` relayed or
direct) when Prometheus asks. Metric names are listed in docs/operations.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import trio
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .. import clock
from ..net.bans import load_bans
from ..net.movable import TRAFFIC
from ..net.streams import FRAME_BYTES

__all__ = ["CONTENT_TYPE", "StageCollector", "serve_metrics", "stage_registry"]

log = logging.getLogger(__name__)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
MAX_REQUEST = 8192


class StageCollector:
    """The figures of the stages ``servers()`` returns (a peer's ``servers``: one, or two during a move)."""

    def __init__(self, servers: Callable[[], Sequence[Any]], bans_path: Path | None = None) -> None:
        self.servers = servers
        self.bans_path = bans_path

    def collect(self) -> Iterator[Any]:
        labels = ["model", "layers"]

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=labels)

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(name, doc, labels=labels)

        steps = counter("sangama_stage_steps", "batched steps the stage computed")
        jobs = counter("sangama_stage_jobs", "session steps computed (a batched step counts each of its sessions)")
        tokens = counter("sangama_stage_tokens", "positions computed (prompt and generated tokens, guesses)")
        compute = counter("sangama_stage_compute_seconds", "seconds the batched steps took")
        queued = counter("sangama_stage_queue_wait_seconds",
                         "seconds session steps waited between their frame's arrival and their step's start")
        tps = gauge("sangama_stage_steps_per_second", "measured steps per second one session gets (announced)")
        queue = gauge("sangama_stage_queue", "steps queued or computing")
        open_ = gauge("sangama_stage_sessions_open", "sessions open")
        free = gauge("sangama_stage_sessions_free", "sessions the stage can still open")
        streams = GaugeMetricFamily("sangama_stage_streams", "stage streams open, by what carries them",
                                    labels=[*labels, "kind"])
        for server in self.servers():
            key = [server.config.model_id, f"{server.config.start}:{server.config.end}"]
            s = server.scheduler.stats
            steps.add_metric(key, s.steps)
            jobs.add_metric(key, s.jobs)
            tokens.add_metric(key, s.tokens)
            compute.add_metric(key, s.compute_s)
            queued.add_metric(key, s.queue_s)
            tps.add_metric(key, float(server.throughput))
            queue.add_metric(key, server.queue_length)
            open_.add_metric(key, server.open_sessions)
            free.add_metric(key, server.free_sessions)
            for kind, n in server.link_kinds().items():
                streams.add_metric([*key, kind], n)
        yield from (steps, jobs, tokens, compute, queued, tps, queue, open_, free, streams)
        frames = CounterMetricFamily("sangama_stage_frame_bytes", "bytes of frames on this process's framed "
                                     "streams, by link kind (lane, libp2p, local) and direction",
                                     labels=["kind", "direction"])
        for (kind, direction), n in sorted(FRAME_BYTES.items()):
            frames.add_metric([kind, direction], n)
        yield frames
        moved = CounterMetricFamily("sangama_stage_stream_bytes", "bytes of stage frames on movable libp2p "
                                    "streams, relayed or direct, by direction", labels=["link", "direction"])
        for name, n in sorted(TRAFFIC.bytes.items()):
            link, _, direction = name.partition("_")
            moved.add_metric([link, direction], n)
        yield moved
        if self.bans_path is not None:
            bans = GaugeMetricFamily("sangama_bans", "peers banned on this machine (its ban file), in force")
            try:
                bans.add_metric([], len(load_bans(self.bans_path, now=clock.wall())) if self.bans_path.exists()
                                else 0)
            except Exception as exc:  # an unreadable ban file must not fail the scrape
                log.debug("ban file %s: %s", self.bans_path, exc)
                bans.add_metric([], 0)
            yield bans


def stage_registry(servers: Callable[[], Sequence[Any]], bans_path: Path | None = None) -> CollectorRegistry:
    """A registry of its own (not prometheus_client's global one) holding a :class:`StageCollector`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StageCollector(servers, bans_path))
    return registry


async def serve_metrics(registry: CollectorRegistry, host: str, port: int,
                        *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Answer ``GET /metrics`` and ``GET /health`` on ``host:port`` until cancelled; ``task_status.started`` gets
    the base URL. One request per connection (``Connection: close``), each bounded in size and time."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    bound = listeners[0].socket.getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    task_status.started(f"http://{shown}:{bound[1]}")

    async def one(stream: trio.SocketStream) -> None:
        try:
            with trio.move_on_after(10):
                head = b""
                while b"\r\n\r\n" not in head and len(head) < MAX_REQUEST:
                    chunk = await stream.receive_some(4096)
                    if not chunk:
                        return
                    head += chunk
                method, _, rest = head.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
                path = rest.split(" ", 1)[0].split("?", 1)[0]
                if method not in ("GET", "HEAD"):
                    status, ctype, body = "405 Method Not Allowed", "text/plain", b"GET only\n"
                elif path == "/metrics":
                    status, ctype, body = "200 OK", CONTENT_TYPE, generate_latest(registry)
                elif path == "/health":
                    status, ctype, body = "200 OK", "application/json", b'{"status": "ok"}\n'
                else:
                    status, ctype, body = "404 Not Found", "text/plain", b"/metrics or /health\n"
                header = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                          "Connection: close\r\n\r\n").encode()
                await stream.send_all(header + (b"" if method == "HEAD" else body))
        except (trio.BrokenResourceError, OSError) as exc:  # the scraper went away
            log.debug("metrics request failed: %s", exc)
        finally:
            await stream.aclose()

    await trio.serve_listeners(one, listeners)
