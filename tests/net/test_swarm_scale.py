"""The swarm-scale harness (issue 25, item 3) run small: real peers in several processes on loopback, fresh clients
generating in a loop, and a peer process killed with SIGKILL and replaced while they do. Every generation gives the
local run's tokens, no survey asks more peers than the bound, and no killed peer is chosen after it died."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parents[2] / "benchmarks" / "swarm_scale.py"


@pytest.mark.slow
def test_a_small_swarm_with_churn_completes_every_generation_with_local_tokens(tmp_path: Path) -> None:
    out = tmp_path / "swarm.json"
    # 3 peer processes at a churn of 0.5: one kill, 40 s into the minute (at 0.34 it fell 1.2 s before the end, and
    # a loaded machine's polling passed the end first: no kill)
    proc = subprocess.run(
        [sys.executable, str(HERE), "--peers", "12", "--per-process", "4", "--boots", "1", "--clients", "2",
         "--client-processes", "1", "--minutes", "1", "--churn", "0.5", "--warmup-s", "5", "--workdir",
         str(tmp_path / "work"), "--json", str(out)], capture_output=True, text=True, timeout=400)
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["started"] >= 5, summary
    assert summary["completed_fraction"] == 1.0 and summary["wrong_tokens"] == 0, summary
    assert summary["killed_processes"] == 1 and summary["departed_peers"] == 4, summary
    assert summary["ghost_chosen_s"] == 0.0, summary  # a killed peer's probe fails: it is never chained
    assert summary["max_dials_per_survey"] <= 30, summary
    assert summary["directory_lookups_per_survey"] == 3.0, summary
    assert proc.returncode == 0, proc.stdout[-2000:]
