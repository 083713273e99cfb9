"""``sangama-peer dashboard`` against a real fleet: a bootstrap node and three ``join`` processes (``--metrics-port``)
of a tiny made model, the dashboard as its own process, the page rendered by headless Chromium.

The page lists the three stages with their ranges; ``/metrics`` (the dashboard's and each stage's) parses as
Prometheus text and the stages' step counters grow under a generation; after a stage is SIGKILLed the page shows it
down and its layers as a gap, long before its record (TTL 180 s) would have expired.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sangama_p2p.cli.local_fleet import LocalFleet
from sangama_p2p.model.make import make_model

pytestmark = pytest.mark.slow  # four processes, a generation and two browser runs: ~40-60 s
SPLIT = ["0:3", "3:6", "6:8"]
CHROMIUM = next((p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p), None)


def get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Metric family name -> [(labels, value)], through prometheus_client's own parser."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def wait_state(url: str, ok, timeout: float) -> tuple[dict, float]:
    t0 = time.monotonic()
    last: dict = {}
    while time.monotonic() - t0 < timeout:
        try:
            last = json.loads(get(url + "/state.json"))
            if ok(last):
                return last, time.monotonic() - t0
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"state not reached in {timeout} s: {json.dumps(last)[:2000]}")


def chromium(url: str, *extra: str) -> str:
    """Headless Chromium's DOM of ``url`` once the page's script rendered a state (``<body data-version=...>``).

    ``--timeout`` ends the page's load (its event stream stays open, so ``--virtual-time-budget`` never runs out);
    on a loaded machine the browser may dump before the first state arrived: then it tries again, waiting longer."""
    for wait_ms in (8000, 20000, 60000):  # the two-worker suite once starved it past 30 s
        out = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                              "--enable-logging=stderr", f"--timeout={wait_ms}", *extra, url],
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        assert "data-error=" not in out.stdout, out.stdout[:3000]  # the page could not draw a state
        if "--dump-dom" not in extra or "<body data-version=" in out.stdout:
            return out.stdout
    with urllib.request.urlopen(url.rstrip("/") + "/state.json", timeout=30) as r:
        state = r.read().decode()[:3000]
    raise AssertionError(f"the page never rendered a state (state.json: {state}); the browser's log: "
                         f"{out.stderr[-3000:]}")


def events(url: str, n: int) -> list[dict]:
    """The first ``n`` server-sent events of ``/events``."""
    got = []
    with urllib.request.urlopen(url + "/events", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        for line in r:
            if line.startswith(b"data: "):
                got.append(json.loads(line[6:]))
                if len(got) == n:
                    return got
    raise AssertionError(f"the event stream ended after {len(got)} events")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("dash")
    model = make_model(work / "tiny", "qwen3_5_moe", "tiny")
    fleet = LocalFleet(model, SPLIT, work / "procs", join_args=["--metrics-port", "0"])
    dash = None
    with fleet:
        metrics = [c.wait_for("metrics http", 30).split()[-1] for c in fleet.children[1:]]
        dash = subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "dashboard", "--bootstrap",
                                 fleet.bootstrap_addr, "--port", "0", "--refresh", "1", "--timeout", "2"],
                                stdout=subprocess.PIPE, stderr=open(work / "dash.stderr", "wb"), text=True,
                                start_new_session=True)
        try:
            line = dash.stdout.readline()
            assert line.startswith("dashboard listening http://"), (work / "dash.stderr").read_text()[-3000:]
            url = line.split()[-1]
            yield {"model": model, "fleet": fleet, "url": url, "metrics": metrics, "work": work}
        finally:
            dash.send_signal(signal.SIGINT)
            try:
                dash.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(dash.pid, signal.SIGKILL)
                dash.wait(5)
    assert dash.returncode == 0, (work / "dash.stderr").read_text()[-3000:]


def all_up(n: int):
    return lambda s: s["counts"]["up"] == n and all(p["queue"] is not None for p in s["peers"])


def test_health_state_and_swarm_metrics(swarm) -> None:
    state, _ = wait_state(swarm["url"], all_up(3), 60)
    ids = swarm["fleet"].stage_ids
    assert [(p["id"], p["layers"], p["state"]) for p in state["peers"]] == list(zip(ids, SPLIT, ["up"] * 3))
    assert all(p["reach"] == "public" and p["steps_per_s"] > 0 for p in state["peers"])
    (m,) = state["models"]
    assert (m["num_layers"], m["covered"], m["gaps"]) == (8, 8, [])
    assert json.loads(get(swarm["url"] + "/health"))["status"] == "ok"
    got = samples(get(swarm["url"] + "/metrics"))
    up = {s[0]["peer"]: s[1] for s in got["sangama_swarm_stage_up"]}
    assert up == {i: 1.0 for i in ids}
    assert got["sangama_swarm_layers_covered"] == [({"model": m["id"]}, 8.0)]
    assert got["sangama_swarm_surveys_total"][0][1] >= 1
    first, second, third = events(swarm["url"], 3)  # the current state at once, then one per survey (--refresh 1)
    assert first["version"] < second["version"] < third["version"] and third["counts"]["up"] == 3


def test_stage_metrics_move_under_a_generation(swarm) -> None:
    before = [samples(get(u)) for u in swarm["metrics"]]
    assert json.loads(get(swarm["metrics"][0].replace("/metrics", "/health")))["status"] == "ok"
    out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "generate", "--model", str(swarm["model"]),
                          "--bootstrap", swarm["fleet"].bootstrap_addr, "--prompt-ids", "7,300,41", "--max-new-tokens",
                          "6", "--ignore-eos", "--guesses", "0", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    after = [samples(get(u)) for u in swarm["metrics"]]

    def total(m: dict, name: str) -> float:
        return sum(v for _, v in m.get(name, []))

    for b, a in zip(before, after):
        assert total(a, "sangama_stage_steps_total") >= total(b, "sangama_stage_steps_total") + 6
        assert total(a, "sangama_stage_tokens_total") > total(b, "sangama_stage_tokens_total")
        assert total(a, "sangama_stage_compute_seconds_total") > total(b, "sangama_stage_compute_seconds_total")
        assert total(a, "sangama_stage_frame_bytes_total") > total(b, "sangama_stage_frame_bytes_total")
        assert total(a, "sangama_stage_steps_per_second") > 0
        assert "sangama_stage_queue" in a and "sangama_stage_sessions_open" in a


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_the_api_serves_the_same_page_at_dashboard(swarm) -> None:
    """``sangama-peer api --dashboard``: the page, its state and health under ``/dashboard/`` beside ``/v1``."""
    work, ids = swarm["work"], swarm["fleet"].stage_ids
    api = subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "api", "--model", str(swarm["model"]),
                            "--bootstrap", swarm["fleet"].bootstrap_addr, "--port", "0", "--dashboard"],
                           stdout=subprocess.PIPE, stderr=open(work / "api.stderr", "wb"), text=True,
                           start_new_session=True)
    try:
        line = api.stdout.readline()
        assert line.startswith("api listening http://"), (work / "api.stderr").read_text()[-3000:]
        url = line.split()[2]
        state, _ = wait_state(url + "/dashboard", all_up(3), 60)
        assert [p["id"] for p in state["peers"]] == ids
        with urllib.request.urlopen(url + "/dashboard", timeout=10) as r:  # redirected to the page
            assert r.url.endswith("/dashboard/") and "<html" in r.read().decode().lower()
        assert json.loads(get(url + "/dashboard/health"))["status"] == "ok"
        assert "sangama_swarm_stage_up" in samples(get(url + "/dashboard/metrics"))
        models = json.loads(get(url + "/v1/models"))["data"]
        assert state["generations"] == []  # the API's own generations: none yet
        body = json.dumps({"model": models[0]["id"], "prompt": [7, 300, 41], "max_tokens": 5, "ignore_eos": True,
                           "temperature": 0}).encode()
        request = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 5
        (gen,) = json.loads(get(url + "/dashboard/state.json"))["generations"]
        assert (gen["prompt_tokens"], gen["tokens"], gen["failed"], len(gen["route"])) == (3, 5, False, 3)
        dom = chromium(url + "/dashboard/", "--dump-dom")
        rows = re.findall(r'<tr class="peer (\w+)" data-peer="(\w+)" data-layers="([\d:]+)"', dom)
        assert rows == [("up", i, r) for i, r in zip(ids, SPLIT)], dom[-3000:]
        assert dom.count('<tr class="generation">') == 1  # the recent generations table, drawn in the browser
    finally:
        api.send_signal(signal.SIGINT)
        try:
            api.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(api.pid, signal.SIGKILL)
            api.wait(5)


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary (apt-get install chromium)")
def test_the_page_in_a_browser_shows_the_stages_then_one_down(swarm, tmp_path: Path) -> None:
    url, ids = swarm["url"], swarm["fleet"].stage_ids
    wait_state(url, all_up(3), 60)
    dom = chromium(url + "/", "--dump-dom")
    rows = re.findall(r'<tr class="peer (\w+)" data-peer="(\w+)" data-layers="([\d:]+)"', dom)
    assert rows == [("up", i, r) for i, r in zip(ids, SPLIT)], dom[-3000:]
    segs = re.findall(r'class="seg (\w+)" data-range="([\d:]+)" data-count="(\d+)"', dom)
    assert segs == [("c1", r, "1") for r in SPLIT]  # the coverage bar: each range served once
    shot = tmp_path / "dashboard.png"
    chromium(url + "/", f"--screenshot={shot}", "--window-size=1280,900")
    assert shot.stat().st_size > 10_000

    victim = swarm["fleet"].children[3]  # the 6:8 stage
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    state, took = wait_state(url, lambda s: s["counts"]["down"] == 1, 60)
    print(f"the page's state showed the killed stage down {took:.1f} s after SIGKILL")
    row = next(p for p in state["peers"] if p["id"] == ids[2])
    assert row["state"] == "down" and row["ttl_s"] > 0  # shown down while its record would still be valid
    dom = chromium(url + "/", "--dump-dom")
    rows = re.findall(r'<tr class="peer (\w+)" data-peer="(\w+)" data-layers="([\d:]+)"', dom)
    assert rows == [("up", ids[0], "0:3"), ("up", ids[1], "3:6"), ("down", ids[2], "6:8")], dom[-3000:]
    segs = re.findall(r'class="seg (\w+)" data-range="([\d:]+)" data-count="(\d+)"', dom)
    assert segs == [("c1", "0:3", "1"), ("c1", "3:6", "1"), ("gap", "6:8", "0")] and "gaps: 6:8" in dom
