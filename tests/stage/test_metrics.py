"""A stage's ``/metrics`` server (``join --metrics-port``): Prometheus text that parses, figures read at scrape time."""

from __future__ import annotations

from types import SimpleNamespace

import trio
from prometheus_client.parser import text_string_to_metric_families

from sangama_p2p.stage.metrics import serve_metrics, stage_registry


def fake_server(steps: int) -> SimpleNamespace:
    stats = SimpleNamespace(steps=steps, jobs=2 * steps, tokens=3 * steps, compute_s=0.5, queue_s=0.25)
    return SimpleNamespace(config=SimpleNamespace(model_id="m", start=0, end=4), scheduler=SimpleNamespace(stats=stats),
                           throughput=40.0, queue_length=1, open_sessions=2, free_sessions=6,
                           link_kinds=lambda: {"lane": 1, "libp2p": 0, "local": 0})


async def http_get(url: str) -> tuple[str, str]:
    host, port = url.removeprefix("http://").split("/", 1)[0].split(":")
    stream = await trio.open_tcp_stream(host, int(port))
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    await stream.aclose()
    head, _, body = data.partition(b"\r\n\r\n")
    return head.decode().split("\r\n")[0], body.decode()


def test_metrics_parse_and_follow_the_stage(tmp_path) -> None:
    trio.run(_scrape, tmp_path)


async def _scrape(tmp_path) -> None:
    servers = [fake_server(5)]
    async with trio.open_nursery() as nursery:
        base = await nursery.start(serve_metrics, stage_registry(lambda: servers, tmp_path / "bans.json"),
                                   "127.0.0.1", 0)
        status, body = await http_get(base + "/metrics")
        assert status == "HTTP/1.1 200 OK"
        got = {(s.name, s.labels.get("kind", "")): s for f in text_string_to_metric_families(body) for s in f.samples}
        assert got["sangama_stage_steps_total", ""].value == 5
        assert got["sangama_stage_steps_total", ""].labels == {"model": "m", "layers": "0:4"}
        assert got["sangama_stage_queue_wait_seconds_total", ""].value == 0.25
        assert got["sangama_stage_steps_per_second", ""].value == 40.0
        assert got["sangama_stage_streams", "lane"].value == 1
        assert got["sangama_bans", ""].value == 0
        servers[0].scheduler.stats.steps = 9  # read at scrape time
        _, body = await http_get(base + "/metrics")
        assert "sangama_stage_steps_total{layers=\"0:4\",model=\"m\"} 9.0" in body
        assert (await http_get(base + "/health"))[0] == "HTTP/1.1 200 OK"
        assert (await http_get(base + "/nothing"))[0] == "HTTP/1.1 404 Not Found"
        nursery.cancel_scope.cancel()
