"""``sangama-peer demo`` runs end to end within the CI budget and leaves no process behind, also on Ctrl-C."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO = [sys.executable, "-m", "sangama_p2p.cli.main", "demo"]


def _pids(text: str) -> list[int]:
    m = re.search(r"\(pids ([\d, ]+)\)", text)
    assert m, text
    return [int(p) for p in m.group(1).split(",")]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_demo_end_to_end_under_three_minutes(tmp_path: Path) -> None:
    t0 = time.monotonic()
    out = subprocess.run([*DEMO, "--json", str(tmp_path / "demo.json")], capture_output=True, text=True,
                         timeout=180)
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert elapsed < 180
    for title in ("tokens/s by guesses", "Many requests at once", "Where the time goes"):
        assert title in out.stdout
    assert "equal the one-process run: yes" in out.stdout
    results = json.loads((tmp_path / "demo.json").read_text())
    assert [r["guesses"] for r in results["guesses"]] == [0, 2, 4, 6]
    assert [r["requests"] for r in results["requests"]] == [1, 4, 16]
    assert all(r["same_tokens"] for r in results["guesses"] + results["requests"])
    assert all(r["tokens_per_s"] > 0 for r in results["guesses"])
    assert len(results["where_the_time_goes"]["stages"]) == 3
    assert all(_gone(p) for p in _pids(out.stdout))


def test_demo_ctrl_c_stops_the_whole_fleet(tmp_path: Path) -> None:
    proc = subprocess.Popen([*DEMO, "--tokens", "400", "--guesses", "0", "--requests", "1",
                             "--workdir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        seen = ""
        deadline = time.monotonic() + 150
        while "first generation" not in seen and time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
        assert "first generation" in seen, seen + (proc.stderr.read() if proc.stderr else "")
        pids = _pids(seen)
        assert len(pids) == 4 and not any(_gone(p) for p in pids)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C delivers, mid-generation
        rc = proc.wait(timeout=60)
        assert rc == 130, (proc.stderr.read() if proc.stderr else "")[-6000:]
        time.sleep(0.5)
        assert all(_gone(p) for p in pids), "a fleet process outlived the interrupted demo"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_split_covers_every_layer_in_three_stages() -> None:
    from sangama_p2p.cli.demo import DEMO_SPLIT, demo_split
    from sangama_p2p.errors import ModelError

    assert demo_split(8) == DEMO_SPLIT
    assert demo_split(3) == ("0:1", "1:2", "2:3")
    assert demo_split(4) == ("0:2", "2:3", "3:4")
    assert demo_split(60) == ("0:20", "20:40", "40:60")
    with pytest.raises(ModelError, match="at least 3 layers"):
        demo_split(2)


def test_demo_refuses_guesses_on_a_model_without_mtp_before_starting_anything(tmp_path: Path) -> None:
    from sangama_p2p.model.make import make_model

    llama = make_model(tmp_path / "llama", "llama", "tiny")
    out = subprocess.run([*DEMO, "--model", str(llama), "--guesses", "0,2", "--workdir", str(tmp_path / "w")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no MTP layer" in out.stderr and "fleet up" not in out.stdout


def test_demo_runs_a_model_of_your_own(tmp_path: Path) -> None:
    # e.g. one that benchmarks/train_tiny.py trained; here the small llama, split 0:2 2:4 4:6, without guesses
    from sangama_p2p.model.make import make_model

    llama = make_model(tmp_path / "llama", "llama", "tiny")
    out = subprocess.run([*DEMO, "--model", str(llama), "--guesses", "0", "--requests", "1,2", "--tokens", "8",
                          "--workdir", str(tmp_path / "w"), "--json", str(tmp_path / "d.json")],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stages 0:2, 2:4, 4:6" in out.stdout
    results = json.loads((tmp_path / "d.json").read_text())
    assert results["model"] == "llama" and results["split"] == ["0:2", "2:4", "4:6"]
    assert all(r["same_tokens"] for r in results["guesses"] + results["requests"])
    assert llama.exists()  # the user's model is never deleted with the demo's work dir
