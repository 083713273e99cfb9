"""Issue 26: a ban follows a liar's address and checkpoint, not only its key (keys are free, addresses are not).

Two honest stages of the tiny model (one namespace, 198.18.0.2) and a liar (another, 198.18.0.1) that computes and
answers a constant token, announcing a high speed; a client behind a NAT generates with ``--verify 1``: its tokens
are ``generate --local``'s and the liar is banned with the address the client's own link saw. The liar comes back
under a fresh key from the same address; the next generation, unverified (``--verify 0``), never chains it: its
tokens are right again, and on the old code (bans by key only) they were the liar's. Real processes, real
addresses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .netns import NatLab, netns_unavailable_reason
from .cli_fleet import status
from .test_nat_fleet import PROMPT, TOKENS, _bootstrap, _cli, _local_tokens, _make_tiny, _Proc

_REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _liar(lab: NatLab, tiny: Path, boot: str, key: Path, token: int) -> tuple[_Proc, str]:
    proc = _Proc(["ip", "netns", "exec", lab.ns["relay"], sys.executable, str(Path(__file__).with_name(
        "liar_agent.py")), str(tiny), boot, str(key), "4201", str(token)])
    line, _ = proc.wait_for("ready ", 90)
    return proc, line.split()[1]


def _seen(lab: NatLab, boot: str, peer: str, timeout: float = 60.0) -> None:
    """Wait until the client's namespace finds ``peer`` in the swarm (a generation started before a fresh peer's
    record is found chains the others: the test would prove nothing)."""
    deadline = time.monotonic() + timeout
    while peer not in status(boot, lab.ns["priva"]):
        assert time.monotonic() < deadline, f"{peer} never found from the client's namespace"
        time.sleep(1.0)


def _generate(lab: NatLab, tiny: Path, boot: str, home: Path, verify: str) -> list[int]:
    gen = subprocess.run(_cli("generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot,
                              "--prompt-ids", PROMPT, "--max-new-tokens", str(TOKENS), "--ignore-eos", "--guesses",
                              "0", "--verify", verify, "--json", ns=lab.ns["priva"]),
                         capture_output=True, text=True, timeout=180, env=dict(os.environ, HOME=str(home)))
    assert gen.returncode == 0, gen.stderr[-3000:]
    return json.loads(gen.stdout.strip().splitlines()[-1])["tokens"]


def test_a_liar_back_under_a_new_key_from_its_address_is_never_chained(tmp_path: Path) -> None:
    tiny = _make_tiny(tmp_path / "tiny")
    expected = _local_tokens(tiny, TOKENS)
    bad = (expected[0] + 1) % 16
    home = tmp_path / "home"  # the client's ~/.sangama/bans.json
    with NatLab(sides="a") as lab:
        procs: list[_Proc] = []
        try:
            boot_p, boot = _bootstrap(lab, tmp_path)
            procs.append(boot_p)
            for i in (1, 2):
                procs.append(_Proc(_cli("join", "--model", str(tiny), "--layers", "0:8", "--bootstrap", boot,
                                        "--listen", f"/ip4/0.0.0.0/tcp/410{i}", "--key", str(tmp_path / f"h{i}.key"),
                                        "--no-lanes", "--threads", "1", ns=lab.ns["pub"])))
                procs[-1].wait_for("ready ", 90)
            liar, first = _liar(lab, tiny, boot, tmp_path / "liar1.key", bad)
            procs.append(liar)
            _seen(lab, boot, first)
            bans = home / ".sangama" / "bans.json"
            for _ in range(4):  # chained first, or drawn as the verifier (one of the two others)
                assert _generate(lab, tiny, boot, home, "1") == expected
                if bans.exists():
                    break
            (ban,) = json.loads(bans.read_text())["bans"]
            assert (ban["peer_id"], ban["address"], ban["layers"]) == (first, "198.18.0.1", "0:8"), ban
            liar.stop()
            liar, second = _liar(lab, tiny, boot, tmp_path / "liar2.key", bad)  # a fresh key, the same address
            procs.append(liar)
            assert second != first
            _seen(lab, boot, second)
            assert _generate(lab, tiny, boot, home, "0") == expected  # never chained, though nothing checks
        finally:
            for p in procs:
                p.stop()
