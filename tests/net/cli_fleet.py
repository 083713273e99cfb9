"""The home fleet of the namespace tests, driven through the CLI only: a bootstrap/relay on the public host, stages
behind their NATs, short-lived clients (``generate``, ``status``). Shared by ``test_nat_fleet.py``, the other
namespace tests and ``benchmarks/dial_soak.py`` / ``benchmarks/nat_traversal.py`` (which put the repository root on
``sys.path`` and import ``tests.net.cli_fleet``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from .netns import RELAY_IP, NatLab

__all__ = ["PROMPT", "TOKENS", "Proc", "bootstrap", "cli", "generate", "join", "local_tokens", "make_tiny", "status"]

PROMPT = "5,17,300,42,7"
TOKENS = 16


def cli(*args: str, ns: str | None = None) -> list[str]:
    cmd = [sys.executable, "-c", "from sangama_p2p.cli.main import entry; entry()", *args]
    if ns:
        cmd[3:3] = ["-v"]  # top-level option: Sangama INFO lines (which addresses were reached, punches)
    return ["ip", "netns", "exec", ns, *cmd] if ns else cmd


class Proc:
    """A CLI process whose stdout lines are collected by a thread (``wait_for`` a prefix)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.lines: list[str] = []
        self.times: list[float] = []  # when each stdout line arrived
        self.err: list[str] = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines, self.times), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, self.err, []), daemon=True).start()

    @staticmethod
    def _pump(pipe, out: list[str], times: list[float]) -> None:  # type: ignore[no-untyped-def]
        for line in pipe:
            times.append(time.monotonic())
            out.append(line.rstrip("\n"))

    def wait_for(self, prefix: str, timeout: float) -> tuple[str, float]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            for line, at in zip(list(self.lines), list(self.times)):
                if line.startswith(prefix):
                    return line, at
            if self.proc.poll() is not None and not any(x.startswith(prefix) for x in self.lines):
                break
            time.sleep(0.05)
        raise AssertionError(f"no {prefix!r} line in {timeout} s; stdout {self.lines[-10:]}, stderr {self.err[-30:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def make_tiny(tiny: Path) -> Path:
    """qwen3_5_moe/tiny (8 layers and an MTP head) at ``tiny``, through the CLI."""
    subprocess.run(cli("make-model", "--arch", "qwen3_5_moe", "--preset", "tiny", str(tiny)), check=True,
                   capture_output=True, timeout=120)
    return tiny


def local_tokens(tiny: Path, n: int) -> list[int]:
    """The greedy tokens of ``generate --local`` for PROMPT (what every fleet generation must give)."""
    local = subprocess.run(cli("generate", "--local", str(tiny), "--prompt-ids", PROMPT, "--max-new-tokens",
                                str(n), "--ignore-eos", "--json", "--threads", "1"),
                           check=True, capture_output=True, text=True, timeout=120)
    return json.loads(local.stdout.strip().splitlines()[-1])["tokens"]


def bootstrap(lab: NatLab, tmp: Path) -> tuple[Proc, str]:
    """A bootstrap node on the public relay host: the process and its address on the relay network."""
    boot_p = Proc(cli("bootstrap", "--listen", "/ip4/0.0.0.0/tcp/4001", "--key", str(tmp / "boot.key"),
                        ns=lab.ns["relay"]))
    boot_p.wait_for("  --bootstrap ", 60)
    boots = [x.split()[1] for x in boot_p.lines if x.startswith("  --bootstrap ") and RELAY_IP in x]
    assert boots, boot_p.lines
    return boot_p, boots[0]


def join(tiny: Path, boot: str, layers: str, key: Path, ns: str, *extra: str) -> Proc:
    """A stage behind its NAT (no lanes, one torch thread), serving ``layers``."""
    return Proc(cli("join", "--model", str(tiny), "--layers", layers, "--bootstrap", boot, "--listen",
                      "/ip4/0.0.0.0/tcp/4101", "--key", str(key), "--no-lanes", "--threads", "1", *extra, ns=ns))


def status(boot: str, ns: str) -> dict[str, dict]:
    """``status --json`` from ``ns``: each peer's entry by peer id."""
    out = subprocess.run(cli("status", "--bootstrap", boot, "--model", "tiny", "--json", "--timeout", "10",
                             ns=ns),
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return {p["peer_id"]: p for p in json.loads(out.stdout)["peers"]}


def generate(tiny: Path, boot: str, ns: str, guesses: int) -> tuple[list[int], float, dict]:
    t0 = time.monotonic()
    gen = subprocess.run(cli("generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot,
                              "--prompt-ids", PROMPT, "--max-new-tokens", str(TOKENS), "--ignore-eos",
                              "--guesses", str(guesses), "--json", ns=ns),
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr[-3000:]
    result = json.loads(gen.stdout.strip().splitlines()[-1])
    return result["tokens"], time.monotonic() - t0, result
