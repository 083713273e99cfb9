"""The examples run: the asyncio web app streams a generation to an HTTP client, the trio app builds a swarm and
generates, the private-fleet script keeps a stranger out. Each result is checked against the one-process chain."""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from sangama_p2p.cli.local_fleet import ThreadFleet
from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.model.spec import LayerRange

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("ex") / "ex-tiny", "qwen3_5_moe", "tiny")


def local(model: Path, prompt: str | list[int], n: int) -> tuple[list[int], str]:
    ckpt = open_checkpoint(model)
    ids = ckpt.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    tokens = LocalChain.load(ckpt, [LayerRange(0, ckpt.spec.num_layers)]).generate(ids, n, stop_at_eos=False).tokens
    return tokens, ckpt.tokenizer.decode(tokens)


def _read_line(proc: subprocess.Popen, prefix: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith(prefix):
            return line
    proc.kill()
    raise AssertionError(f"no {prefix!r} line; stderr: {proc.stderr.read() if proc.stderr else ''}")


def test_asyncio_web_app_streams_to_an_http_client(tiny: Path, tmp_path: Path) -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadFleet(tiny, [(0, 5), (5, 8)], tmp_path) as fleet:
            proc = subprocess.Popen(
                [sys.executable, str(EXAMPLES / "asyncio_web.py"), "--model", str(tiny), "--bootstrap",
                 fleet.bootstrap_addr, "--port", "0"],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                line = _read_line(proc, "listening on http://", 60)
                port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                conn.request("GET", "/generate?prompt=def%20hello(&tokens=12&guesses=0")
                resp = conn.getresponse()
                assert resp.status == 200
                assert resp.getheader("Transfer-Encoding") == "chunked"
                chunks = []
                while True:  # read chunk by chunk: the answer arrives in pieces, as generated
                    piece = resp.read1(65536)
                    if not piece:
                        break
                    chunks.append(piece)
                body = b"".join(chunks).decode()
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                conn.request("GET", "/nothing")
                assert conn.getresponse().status == 404
                conn.close()
                # bad numbers are a 400 before anything is generated (tokens=-5 was an empty 200, guesses=99 an
                # error written outside the chunked body, which clients dropped)
                for query in ("tokens=-5", "tokens=abc", "guesses=99", "tokens=100000"):
                    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                    conn.request("GET", f"/generate?prompt=x&{query}")
                    resp = conn.getresponse()
                    assert (resp.status, resp.read()) == (400, b"tokens must be an integer in 1..512, guesses 0..8 or "
                                                                b"auto\n"), query
                    conn.close()
                proc.send_signal(signal.SIGINT)
                assert proc.wait(timeout=30) == 130  # Ctrl-C: the server stops, with the shell's code for it
            finally:
                if proc.poll() is None:
                    proc.terminate()
                    proc.wait(timeout=30)
    finally:
        torch.set_num_threads(before)
    _, text = local(tiny, "def hello(", 12)
    assert body == text
    assert len(chunks) > 1  # streamed, not sent at the end in one piece


def _own_tmp(tmp_path: Path) -> dict[str, str]:
    """An environment whose temporary files go to a directory of the test's own, to see that none stay."""
    (tmp_path / "tmp").mkdir()
    return dict(os.environ, TMPDIR=str(tmp_path / "tmp"))


def test_trio_app(tiny: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "trio_app.py"), "--model", str(tiny), "--tokens", "10",
                          "--prompt", "hello"], capture_output=True, text=True, timeout=180, env=_own_tmp(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    assert list((tmp_path / "tmp").iterdir()) == []  # the peers' keys went with the run
    tokens, _ = local(tiny, "hello", 10)
    lines = {line.split(":", 1)[0]: line.split(":", 1)[1].split() for line in out.stdout.splitlines() if ":" in line}
    assert [int(t) for t in lines["streamed ids"]] == tokens
    assert [int(t) for t in lines["tokens"]] == tokens


def test_trio_app_on_a_model_without_mtp(tmp_path: Path) -> None:
    # "works with any checkpoint": it asked for guesses=auto, which a dense Llama refuses (a traceback)
    llama = make_model(tmp_path / "ex-llama", "llama", "tiny")
    out = subprocess.run([sys.executable, str(EXAMPLES / "trio_app.py"), "--model", str(llama), "--tokens", "6",
                          "--prompt", "hello"], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    tokens, _ = local(llama, "hello", 6)
    line = next(line for line in out.stdout.splitlines() if line.startswith("tokens:"))
    assert [int(t) for t in line.split(":", 1)[1].split()] == tokens
    assert "with guesses=0" in out.stdout


def test_examples_report_a_bad_model_in_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "trio_app.py"), "--model", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("trio_app: error: no config.json in")


@pytest.mark.slow
def test_private_fleet_script(tiny: Path, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(EXAMPLES / "private_fleet.py"), "--model", str(tiny), "--tokens", "8"],
                         capture_output=True, text=True, timeout=240, env=_own_tmp(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert list((tmp_path / "tmp").iterdir()) == []  # the secret, keys and logs went with the fleet
    assert "stranger refused" in out.stdout and "fleet stopped" in out.stdout
    tokens, _ = local(tiny, "def hello(", 8)
    member = next(line for line in out.stdout.splitlines() if line.startswith("member generated:"))
    assert [int(t) for t in member.split(":", 1)[1].split()] == tokens
