"""Issue 26, Sybils: keys are free, addresses are not. Four fresh keys from one host (its own network namespace,
198.18.0.1) ask a stage (another namespace, 198.18.0.2) for five sessions each; the stage counts them by address
as well as by peer id and gives that address its share (a quarter of ``max_sessions``: 16 of 64) and no more.
A client behind another address (a NAT's WAN address) still generates with `generate --local`'s tokens while the
Sybils hold their share. Real processes, a real wire, real addresses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .netns import NatLab, netns_unavailable_reason
from .test_nat_fleet import PROMPT, TOKENS, _bootstrap, _cli, _generate, _local_tokens, _make_tiny, _Proc

_REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_four_keys_from_one_address_hold_only_that_addresss_share_of_a_stage(tmp_path: Path) -> None:
    tiny = _make_tiny(tmp_path / "tiny")
    expected = _local_tokens(tiny, TOKENS)
    with NatLab(sides="a") as lab:
        procs: list[_Proc] = []
        try:
            boot_p, boot = _bootstrap(lab, tmp_path)
            procs.append(boot_p)
            stage = _Proc(_cli("join", "--model", str(tiny), "--layers", "0:8", "--bootstrap", boot, "--listen",
                               "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp_path / "s.key"), "--no-lanes",
                               "--threads", "1", ns=lab.ns["pub"]))
            procs.append(stage)
            peer = stage.wait_for("ready ", 90)[0].split()[1]
            sybils = subprocess.Popen(["ip", "netns", "exec", lab.ns["relay"], sys.executable,
                                       str(Path(__file__).with_name("sybil_agent.py")), peer,
                                       "/ip4/198.18.0.2/tcp/4101", "tiny", "0", "8", "4", "5"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                line = sybils.stdout.readline()  # type: ignore[union-attr]
                assert line, sybils.stderr.read()[-3000:]  # type: ignore[union-attr]
                got = json.loads(line)
                assert got["opened"] == 16, got  # 20 asked by 4 keys, each under its own per-peer quota of 16
                assert len(got["refused"]) == 4 and all("per-address quota: 198.18.0.1 already holds 16" in m
                                                        for m in got["refused"]), got
                tokens, _, _ = _generate(tiny, boot, lab.ns["priva"], 0)  # another address: served as before
                assert tokens == expected
            finally:
                sybils.stdin.close()  # type: ignore[union-attr]
                sybils.wait(timeout=30)
        finally:
            for p in procs:
                p.stop()
