"""A stage process stops on SIGTERM (issue 15, item 6): it stops serving and exits 0. How fast (1.5-3 s on the idle
dev machine) is printed, not asserted: a test asserts behaviour, however loaded the machine (issue 22, item 4)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sangama_p2p.cli.local_fleet import LocalFleet
from sangama_p2p.model.make import make_model


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_a_stage_stops_serving_on_sigterm_and_exits_0(tmp_path: Path) -> None:
    model = make_model(tmp_path / "tiny", "qwen3_5_moe", "tiny")
    with LocalFleet(model, ["0:8"], tmp_path / "procs") as fleet:
        # a second stage of its own (the fleet's first one stays, so the bootstrap keeps a peer)
        proc = subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "join", "--model", str(model),
                                 "--layers", "0:8", "--bootstrap", fleet.bootstrap_addr, "--listen",
                                 "/ip4/127.0.0.1/tcp/0", "--key", str(tmp_path / "stage.key")],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, OMP_NUM_THREADS="1"))
        try:
            assert proc.stdout is not None and proc.stderr is not None
            assert proc.stdout.readline().startswith("ready ")
            addr = proc.stdout.readline().split()[1].split("/")  # "  listening /ip4/127.0.0.1/tcp/N/p2p/..."
            host, port = addr[2], int(addr[4])
            assert _accepts(host, port)
            # a client's generation through it, so that it holds connections, lanes and a finished session
            gen = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "generate", "hello", "--model",
                                  str(model), "--bootstrap", fleet.bootstrap_addr, "--max-new-tokens", "4"],
                                 capture_output=True, text=True, timeout=120)
            assert gen.returncode == 0, gen.stderr[-2000:]
            t0 = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            while _accepts(host, port) and time.monotonic() - t0 < 60:  # a bound against a hang, not a timing
                time.sleep(0.05)
            stopped = time.monotonic() - t0
            assert not _accepts(host, port), "still serving 60 s after SIGTERM"
            assert proc.wait(timeout=60) == 0, proc.stderr.read()[-3000:]
            exited = time.monotonic() - t0
            # measured 1.5-3.7 s before the CLI skipped the interpreter's teardown (os._exit in cli/main.py)
            print(f"SIGTERM: stopped serving after {stopped:.2f} s, exited after {exited:.2f} s")
            assert "stopping" in proc.stdout.read()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
