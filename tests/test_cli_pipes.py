"""``sangama-peer`` as one part of a shell pipeline: progress goes to stderr only (never into the text or the JSON),
and a reader that goes away (``| head -1``) ends a generation without a traceback and leaves a stage serving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "sangama_p2p.cli.main"]
ENV = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from sangama_p2p.model.make import make_model

    return make_model(tmp_path_factory.mktemp("pipes") / "llama-tiny", "llama", "tiny")


def _ids(n: int) -> str:
    return ",".join(str(1 + i % 100) for i in range(n))


def test_progress_is_on_stderr_only_with_the_flag_and_never_in_the_json(model: Path) -> None:
    argv = [*CLI, "generate", "--local", str(model), "--prompt-ids", _ids(300), "--max-new-tokens", "4", "--json"]
    shown = subprocess.run([*argv, "--progress"], capture_output=True, text=True, env=ENV, timeout=120)
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)  # one document, nothing else on stdout
    assert len(doc["tokens"]) == 4
    assert f"loading 6 layers of {model.name} ..." in shown.stderr
    assert "prefill of 300 prompt tokens ..." in shown.stderr
    assert "prefill of 300 prompt tokens: done in" in shown.stderr and "tokens/s)" in shown.stderr
    quiet = subprocess.run(argv, capture_output=True, text=True, env=ENV, timeout=120)  # stderr is no terminal here
    assert quiet.returncode == 0 and json.loads(quiet.stdout)["tokens"] == doc["tokens"]
    assert "prefill" not in quiet.stderr and "loading" not in quiet.stderr


def test_a_short_prompt_says_no_prefill(model: Path) -> None:
    out = subprocess.run([*CLI, "generate", "--local", str(model), "--prompt-ids", _ids(5), "--max-new-tokens", "2",
                          "--progress"], capture_output=True, text=True, env=ENV, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "loading 6 layers" in out.stderr and "prefill of" not in out.stderr


def test_generate_into_a_closed_pipe_stops_without_a_traceback(model: Path) -> None:
    proc = subprocess.Popen([*CLI, "generate", "--local", str(model), "--prompt-ids", _ids(3), "--max-new-tokens",
                             "400", "--ignore-eos", "--jsonl"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)
    assert proc.stdout is not None and proc.stderr is not None
    first = json.loads(proc.stdout.readline())  # `| head -1`
    proc.stdout.close()
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert "token" in first
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert rc == 141  # 128 + SIGPIPE, as a process the signal killed


def test_join_serves_on_after_its_output_pipe_closes(model: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen([*CLI, "join", "--model", str(model), "--layers", "0:4", "--listen",
                             "/ip4/127.0.0.1/tcp/0", "--key", str(tmp_path / "k"), "--run-for", "3", "--progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None and proc.stderr is not None
    t0 = time.monotonic()
    ready = proc.stdout.readline()
    proc.stdout.close()  # `join ... | head -1`
    rc = proc.wait(timeout=120)
    err = proc.stderr.read()
    assert ready.startswith("ready ") and ready.split()[2:] == [model.name, "0:4"], err
    assert rc == 0, err
    assert "Traceback" not in err, err
    assert "stdout closed; serving on without output" in err
    assert time.monotonic() - t0 >= 3  # it served its whole --run-for
    assert "loading layers 0:4 of llama-tiny ..." in err and "loading layers 0:4 of llama-tiny: done in" in err


def test_a_fleet_coming_up_says_each_member_as_it_is_ready(model: Path, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture) -> None:
    """The demo's progress (``--progress``, or stderr a terminal): the bootstrap node, then each stage, with the
    time since the start."""
    from sangama_p2p.cli.demo import _fleet_progress
    from sangama_p2p.cli.local_fleet import LocalFleet

    with LocalFleet(model, ["0:3", "3:6"], tmp_path, on_ready=_fleet_progress(2)) as fleet:
        ids = fleet.stage_ids
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "starting a bootstrap node and 2 stage processes ..."
    assert err[1].startswith("  [1/3] bootstrap node ready after ")
    assert err[2].startswith(f"  [2/3] stage 0:3 (peer …{ids[0][-8:]}) ready after ")
    assert err[3].startswith(f"  [3/3] stage 3:6 (peer …{ids[1][-8:]}) ready after ")
    seconds = [float(line.rsplit(" ", 2)[-2]) for line in err[1:4]]
    assert seconds == sorted(seconds) and seconds[0] > 0


def test_on_a_terminal_progress_shows_by_default(model: Path) -> None:
    """stderr a terminal (a pseudo-terminal here): the spinner and the done lines, without --progress; the JSON on
    stdout is as without them."""
    import pty
    import threading

    primary, secondary = pty.openpty()
    seen = bytearray()

    def pump() -> None:
        while True:
            try:
                chunk = os.read(primary, 4096)
            except OSError:
                return
            if not chunk:
                return
            seen.extend(chunk)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        out = subprocess.run([*CLI, "generate", "--local", str(model), "--prompt-ids", _ids(300), "--max-new-tokens",
                              "3", "--json"], stdout=subprocess.PIPE, stderr=secondary, text=True, env=ENV,
                             timeout=120)
    finally:
        os.close(secondary)
        reader.join(timeout=10)
        os.close(primary)
    assert out.returncode == 0
    assert len(json.loads(out.stdout)["tokens"]) == 3
    text = seen.decode(errors="replace")
    assert "loading 6 layers of llama-tiny: done in" in text
    assert "prefill of 300 prompt tokens: done in" in text
