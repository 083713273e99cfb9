"""Stage peers as separate OS processes: tokens equal LocalChain's, and a SIGKILLed stage is routed around."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair

from .fleet import MODEL, host_config, local_chain

SPLIT = [(0, 3), (3, 5), (5, 8)]
PROMPT = [2, 7, 1, 8, 2, 8]


@pytest.mark.slow
def test_three_stage_processes_and_a_spare_survive_a_sigkill(ckpt, tmp_path):
    want = local_chain(ckpt, SPLIT, batch_invariant=True).generate(PROMPT, 20, guesses=2).tokens
    script = Path(__file__).with_name("stage_peer.py")
    procs: dict[str, subprocess.Popen] = {}

    async def main():
        with trio.fail_after(150):
            async with open_host(host_config(), key_pair=generate_key_pair()) as boot:
                addr = str(boot.advertised_addrs()[0])
                for i, (a, b) in enumerate([*SPLIT, (3, 5)]):
                    cmd = [sys.executable, str(script), str(ckpt), str(a), str(b), addr, MODEL,
                           str(tmp_path / f"k{i}.key")]
                    with open(tmp_path / f"stage{i}.log", "w") as log:
                        procs[f"pending{i}"] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                                env={**os.environ})
                ids = {}
                while len(ids) < 4:
                    await trio.sleep(0.2)
                    for i in range(4):
                        text = (tmp_path / f"stage{i}.log").read_text()
                        for line in text.splitlines():
                            if line.startswith("READY "):
                                ids[i] = line.split()[1]
                        assert procs[f"pending{i}"].poll() is None, text[-2000:]
                for i, pid in ids.items():
                    procs[pid] = procs.pop(f"pending{i}")
                async with open_host(host_config(bootstrap_addrs=(addr,)), key_pair=generate_key_pair()) as node:
                    async with ChainClient(node, ClientConfig(MODEL, step_timeout=15)) as client:
                        killed = []

                        def on_tokens(new):
                            seen.extend(new)
                            if not killed and len(seen) >= 6:
                                victim = client.routes[0][1]  # the middle stage of the running chain
                                procs[victim].kill()
                                killed.append(victim)

                        seen: list[int] = []
                        res = await client.generate(PROMPT, 20, guesses=2, on_tokens=on_tokens)
                return res, killed

    try:
        res, killed = trio.run(main)
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
    assert res.tokens == want
    assert res.failovers == 1 and killed and killed[0] not in res.route


