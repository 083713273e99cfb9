"""Issue 13 acceptance: a home fleet. A bootstrap on a public host, three stages each behind its own port-preserving
NAT (MASQUERADE, unsolicited inbound dropped), a client behind a fourth NAT - all through the CLI only.

The first generation right after all three stages print ``ready`` must succeed, with the greedy tokens of
``generate --local``. Prints the time from the last ``ready`` to the first generation's end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from .netns import RELAY_IP, NatLab, netns_unavailable_reason

_REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

PROMPT = "5,17,300,42,7"
TOKENS = 8


def _cli(*args: str, ns: str | None = None) -> list[str]:
    cmd = [sys.executable, "-c", "from sangama_p2p.cli.main import entry; entry()", *args]
    if ns:
        cmd[3:3] = ["-v"]  # top-level option: Sangama INFO lines (which addresses were reached, punches)
    return ["ip", "netns", "exec", ns, *cmd] if ns else cmd


class _Proc:
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


def test_three_natted_stages_and_a_natted_client_generate_right_after_ready(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    subprocess.run(_cli("make-model", "--arch", "llama", "--preset", "tiny", str(tiny)), check=True,
                   capture_output=True, timeout=120)
    local = subprocess.run(_cli("generate", "--local", str(tiny), "--prompt-ids", PROMPT, "--max-new-tokens",
                                str(TOKENS), "--ignore-eos", "--json", "--threads", "1"),
                           check=True, capture_output=True, text=True, timeout=120)
    expected = json.loads(local.stdout.strip().splitlines()[-1])["tokens"]
    procs: list[_Proc] = []
    with NatLab(sides="abcd") as lab:
        try:
            boot_p = _Proc(_cli("bootstrap", "--listen", "/ip4/0.0.0.0/tcp/4001", "--key", str(tmp_path / "boot.key"),
                                ns=lab.ns["relay"]))
            procs.append(boot_p)
            line, _ = boot_p.wait_for("  --bootstrap ", 60)
            boots = [x.split()[1] for x in boot_p.lines if x.startswith("  --bootstrap ") and RELAY_IP in x]
            assert boots, boot_p.lines
            boot = boots[0]
            stages = []
            for side, layers in zip("abc", ("0:2", "2:4", "4:6")):
                stages.append(_Proc(_cli("join", "--model", str(tiny), "--layers", layers, "--bootstrap", boot,
                                         "--listen", "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp_path / f"{side}.key"),
                                         "--no-lanes", "--threads", "1", ns=lab.ns[f"priv{side}"])))
            procs.extend(stages)
            readies = [s.wait_for("ready ", 90)[1] for s in stages]
            reach = [s.wait_for("  reachable ", 5)[0].split()[1] for s in stages]
            assert reach == ["relayed"] * 3, reach  # each is behind its NAT: reachable through its reservation
            t_ready = max(readies)
            t0 = time.monotonic()
            gen = subprocess.run(_cli("generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot,
                                      "--prompt-ids", PROMPT, "--max-new-tokens", str(TOKENS), "--ignore-eos",
                                      "--json", ns=lab.ns["privd"]),
                                 capture_output=True, text=True, timeout=120)
            t1 = time.monotonic()
            ours = [x for s in stages for x in s.err if "sangama" in x]
            assert gen.returncode == 0, gen.stderr[-3000:] + "\n" + "\n".join(ours[-40:])
            got = json.loads(gen.stdout.strip().splitlines()[-1])["tokens"]
            assert got == expected
            print(f"\nready -> generate started {t0 - t_ready:.2f} s; first generation ({TOKENS} tokens, "
                  f"client process start included) took {t1 - t0:.2f} s")
            dials = [x for x in gen.stderr.splitlines() if "reached " in x]
            print("client dials:", *dials[-6:], sep="\n  ")
            for s in stages:
                print("stage dials:", *[x for x in s.err if "reached " in x or "hole punch" in x][-4:], sep="\n  ")
        finally:
            for p in procs:
                p.stop()
