"""The dashboard's web server: starlette routes served by hypercorn's trio worker (as the OpenAI API is).

Routes: ``GET /`` (and ``/dashboard``) the page, ``GET /events`` the swarm's state as server-sent events (one
``data:`` JSON object per survey), ``GET /state.json`` the latest state, ``GET /metrics`` Prometheus text format,
``GET /health``. The page is one HTML file with its script and style inline, shipped in the package
(``dashboard/static/index.html``); it fetches nothing from elsewhere.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from typing import Any

import trio

from .live import SwarmWatch
from .metrics import swarm_registry

__all__ = ["build_app", "page_html", "serve_dashboard", "watched_app"]

log = logging.getLogger(__name__)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# starlette and hypercorn come with the `api` extra and take 0.5 s to import: imported where the server starts


def page_html() -> str:
    """The page, from the package's data."""
    return resources.files(__package__).joinpath("static/index.html").read_text(encoding="utf-8")


def build_app(watch: SwarmWatch) -> Any:
    """The ASGI app over ``watch`` (its refresh task runs elsewhere: :func:`serve_dashboard`)."""
    from prometheus_client import generate_latest
    from starlette.applications import Starlette
    from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    html = page_html()
    registry = swarm_registry(watch)

    async def page(request: Any) -> Any:
        # the latest state inside the page, so it is drawn as it loads (before, a browser that took the page's load
        # as done, as headless Chromium's --dump-dom may, showed "waiting for the first survey" beside a live swarm)
        state = json.dumps(watch.state()).replace("<", "\\u003c") if watch.version else "null"
        return HTMLResponse(html.replace("/*STATE*/null", state, 1), headers={"Cache-Control": "no-cache"})

    async def events(request: Any) -> Any:
        return StreamingResponse(watch.updates(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def state(request: Any) -> Any:
        return JSONResponse(watch.state())

    async def metrics(request: Any) -> Any:
        return Response(generate_latest(registry), media_type=METRICS_TYPE)

    async def health(request: Any) -> Any:
        ok = watch.version > 0 and watch.error is None
        return JSONResponse({"status": "ok" if ok else ("starting" if watch.version == 0 else "degraded"),
                             "surveys": watch.version, "error": watch.error}, status_code=200 if ok else 503)

    return Starlette(routes=[Route("/", page), Route("/dashboard", page), Route("/events", events),
                             Route("/state.json", state), Route("/metrics", metrics), Route("/health", health)])


async def watched_app(node: Any, models: Any, bootstrap_addrs: Any = (), generations: Any = None, *,
                      task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """A task: watch the swarm through ``node`` (only ``models``; the peers at ``bootstrap_addrs`` shown as the
    bootstrap) until cancelled; ``task_status.started`` gets the page's ASGI app, to mount under another server
    (``/dashboard`` of ``sangama-peer api``, whose client's recent generations ``generations()`` gives). Its URLs
    are relative: mounted at ``/dashboard``, the page is ``/dashboard/``."""
    from ..net.bans import default_bans_path

    ids = frozenset(a.rsplit("/p2p/", 1)[1].split("/", 1)[0] for a in bootstrap_addrs if "/p2p/" in a)
    watch = SwarmWatch(node, models=tuple(models), bans_path=default_bans_path(), bootstrap_ids=ids,
                       generations=generations)
    task_status.started(build_app(watch))
    await watch.run()


async def serve_dashboard(watch: SwarmWatch, host: str, port: int,
                          *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Refresh ``watch`` and serve the page on ``host:port`` until cancelled; ``task_status.started`` gets the base
    URL (``http://host:port``)."""
    from hypercorn.config import Config
    from hypercorn.trio import serve

    cfg = Config()
    cfg.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    cfg.accesslog = None
    cfg.errorlog = log
    cfg.graceful_timeout = 1.0

    class _Status:
        def started(self, binds: Any = None) -> None:
            task_status.started(binds[0] if binds else None)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch.run)
        await serve(build_app(watch), cfg, shutdown_trigger=trio.sleep_forever,
                    task_status=_Status())  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
