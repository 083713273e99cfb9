"""Issue 24, the near/far case in the delay lab: a client in region A, the only first-range stage in B, the next range
served in B (2 ms from it) and in C (80 ms from it, 40 ms from the client like B). The client's own round trips
cannot tell the two apart; the first stage's measured links can, so the client chains the near stage, and says the
stage-to-stage hop was measured. Tokens equal ``generate --local``. Timings: ``benchmarks/delaylab.py``."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from .delaylab import DelayLab, delaylab_unavailable_reason

_REASON = delaylab_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_the_client_chains_the_near_successor_by_the_stages_measured_links(tmp_path: Path) -> None:
    from .test_delaylab import _fleet_cli
    from .test_nat_fleet import PROMPT, TOKENS, _local_tokens, _make_tiny, _Proc

    tiny = _make_tiny(tmp_path / "tiny")
    expected = _local_tokens(tiny, TOKENS)
    hosts = {"boot": "A", "client": "A", "s0": "B", "near": "B", "far": "C"}
    rtt = {("A", "A"): 2, ("B", "B"): 2, ("C", "C"): 2, ("A", "B"): 40, ("A", "C"): 40, ("B", "C"): 80}
    with DelayLab(hosts, rtt_ms=rtt) as lab:
        procs: list[_Proc] = []

        def start(host: str, *args: str) -> _Proc:
            proc = _Proc(["ip", "netns", "exec", lab.ns[host], *_fleet_cli(*args)])
            procs.append(proc)
            return proc

        def cli(host: str, *args: str) -> dict:
            out = subprocess.run(["ip", "netns", "exec", lab.ns[host], *_fleet_cli(*args)], capture_output=True,
                                 text=True, timeout=180)
            assert out.returncode == 0, out.stderr[-3000:]
            try:
                return json.loads(out.stdout)  # status: one document over many lines
            except json.JSONDecodeError:
                return json.loads(out.stdout.strip().splitlines()[-1])  # generate: the last line

        try:
            boot_p = start("boot", "bootstrap", "--listen", "/ip4/0.0.0.0/tcp/4001", "--key", str(tmp_path / "b.key"))
            boot_p.wait_for("  --bootstrap ", 60)
            boot = next(x.split()[1] for x in boot_p.lines if x.startswith("  --bootstrap ") and lab.ip["boot"] in x)
            stages = {host: start(host, "join", "--model", str(tiny), "--layers", layers, "--bootstrap", boot,
                                  "--listen", "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp_path / f"{host}.key"),
                                  "--no-lanes", "--threads", "1")
                      for host, layers in (("near", "4:8"), ("far", "4:8"), ("s0", "0:4"))}
            ids = {host: s.wait_for("ready ", 120)[0].split()[1] for host, s in stages.items()}
            deadline = time.monotonic() + 60  # the first stage measures both successors, and publishes it
            while True:
                peers = {p["peer_id"]: p for p in cli("client", "status", "--bootstrap", boot, "--model", tiny.name,
                                                      "--json", "--timeout", "10")["peers"]}
                records = peers.get(ids["s0"], {}).get("records") or [{"links": []}]
                links = dict(records[0]["links"])
                if {ids["near"], ids["far"]} <= set(links) or time.monotonic() > deadline:
                    break
                time.sleep(1)
            assert {ids["near"], ids["far"]} <= set(links), links
            assert links[ids["near"]] < 0.020 < 0.060 < links[ids["far"]], links  # 2 and 80 ms configured
            result = cli("client", "generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot,
                         "--prompt-ids", PROMPT, "--max-new-tokens", str(TOKENS), "--ignore-eos", "--guesses", "0",
                         "--json")
        finally:
            for proc in procs:
                proc.stop()
    assert result["tokens"] == expected
    assert result["route"] == [ids["s0"], ids["near"]], (result["route"], ids)
    hop = result["hops"][1]
    assert (hop["from"], hop["to"], hop["measured"]) == (ids["s0"], ids["near"], True) and hop["ms"] < 10, hop
    print(f"\nnear/far: chained {ids['near'][-6:]} ({1e3 * links[ids['near']]:.1f} ms from the first stage, the far one "
          f"{1e3 * links[ids['far']]:.1f} ms); decode {result['decode_ms'] / max(1, result['steps']):.1f} ms per token")
