"""``sangama-peer id | bootstrap | status`` as a user runs them (subprocesses), and the survey behind ``status``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import trio

from sangama_p2p.cli.net_cmds import _coverage, _print_table
from sangama_p2p.net.discovery import Announcer, ServingOffer
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import load_key_pair, peer_id_of
from sangama_p2p.net.status import survey

from .net_swarm import config, swarm

CLI = [sys.executable, "-m", "sangama_p2p.cli.main"]
# Runs the bootstrap command in-process, then reports whether anything imported torch.
BOOTSTRAP = (
    "import sys; from sangama_p2p.cli.main import main; rc = main(sys.argv[1:]); "
    "print('TORCH-LOADED' if 'torch' in sys.modules else 'TORCH-ABSENT', flush=True); sys.exit(rc)"
)


def test_id_prints_the_persisted_peer_id(tmp_path):
    key = tmp_path / "keys" / "peer.key"
    first = subprocess.run([*CLI, "id", "--key", str(key)], capture_output=True, text=True, timeout=60)
    again = subprocess.run([*CLI, "id", "--key", str(key)], capture_output=True, text=True, timeout=60)
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip() == again.stdout.strip() == peer_id_of(load_key_pair(key)).to_base58()
    key.write_bytes(b"garbage")
    bad = subprocess.run([*CLI, "id", "--key", str(key)], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "corrupt" in bad.stderr


def test_bootstrap_node_serves_without_torch_and_status_reads_it(tmp_path):
    secret = tmp_path / "fleet.secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", BOOTSTRAP, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key",
         str(tmp_path / "boot.key"), "--fleet-secret-file", str(secret), "--run-for", "120"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        banner = proc.stdout.readline()
        assert "bootstrap node" in banner and "private fleet" in banner, proc.stderr.read() if proc.stderr else ""
        addr = proc.stdout.readline().split("--bootstrap", 1)[1].strip()
        boot_id = peer_id_of(load_key_pair(tmp_path / "boot.key")).to_base58()
        assert addr.endswith(f"/p2p/{boot_id}")
        status = subprocess.run(
            [*CLI, "status", "--bootstrap", addr, "--fleet-secret-file", str(secret), "--json", "--timeout", "3"],
            capture_output=True, text=True, timeout=60,
        )
        assert status.returncode == 0, status.stderr
        peers = {p["peer_id"]: p for p in json.loads(status.stdout)["peers"]}
        assert peers[boot_id]["link"] == "direct" and peers[boot_id]["records"] == []
        start = time.monotonic()
        refused = subprocess.run([*CLI, "status", "--bootstrap", addr, "--timeout", "2"],
                                 capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "fleet secret mismatch" in refused.stderr
        assert time.monotonic() - start < 15  # interpreter start-up + a 2 s handshake bound
        proc.send_signal(signal.SIGINT)  # Ctrl-C: the node stops through its normal exit path, saying so
        out, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err
        assert "stopping (SIGINT)" in out and "TORCH-ABSENT" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_survey_lists_peers_ranges_and_links_and_prints_a_table(capsys):
    async def main():
        with trio.fail_after(60):
            async with swarm(5) as nodes:
                for i, node in enumerate(nodes[1:3]):
                    await Announcer(node).update(ServingOffer("org/m", i * 4, i * 4 + 4, throughput=7.5,
                                                              free_sessions=2, fingerprint="5a" * 16, num_layers=8))
                # left out: a range beyond its checkpoint's depth, and another checkpoint under the same id
                await Announcer(nodes[3]).update(ServingOffer("org/m", 7, 1_000_000, fingerprint="5a" * 16,
                                                              num_layers=8))
                await Announcer(nodes[4]).update(ServingOffer("org/m", 0, 8, fingerprint="6b" * 16, num_layers=8))
                boot = nodes[0]
                async with open_host(config(dht_server=False, bootstrap_addrs=(str(boot.advertised_addrs()[0]),))) as me:
                    status = await survey(me, models=["org/m"], timeout=3)
                by_id = {p.peer_id: p for p in status.peers}
                assert set(by_id) == {n.peer_id.to_base58() for n in nodes}
                assert by_id[boot.peer_id.to_base58()].records == ()
                for i, node in enumerate(nodes[1:3]):
                    peer = by_id[node.peer_id.to_base58()]
                    (rec,) = peer.records
                    assert (rec.model_id, rec.start, rec.end, rec.throughput) == ("org/m", i * 4, i * 4 + 4, 7.5)
                    assert peer.link == "direct" and peer.rtt_ms is not None and peer.rtt_ms > 0
                ids = [n.peer_id.to_base58() for n in nodes]
                assert status.models() == {"org/m": [(ids[1], 0, 4), (ids[4], 0, 8), (ids[2], 4, 8),
                                                     (ids[3], 7, 1_000_000)]}
                lineup = status.lineups()["org/m"]
                assert (lineup.fingerprint, lineup.num_layers) == ("5a" * 16, 8)
                assert [r.peer_id for r in lineup.members] == ids[1:3]
                reasons = {o.peer_id: o.reason for o in lineup.left_out}
                assert set(reasons) == {ids[3], ids[4]}
                assert "beyond its checkpoint's 8 layers" in reasons[ids[3]]
                assert "another checkpoint serves this model id" in reasons[ids[4]]
                as_json = json.loads(json.dumps(status.to_json()))  # serialisable as is
                assert {o["peer_id"] for o in as_json["lineups"]["org/m"]["left_out"]} == {ids[3], ids[4]}
                _print_table(status)
                return ids

    ids = trio.run(main)
    out = capsys.readouterr().out
    assert "org/m" in out and "0:4" in out and "4:8" in out and "layers covered 0:1000000" in out
    assert "chained: fingerprint 5a5a5a5a5a5a, 8 layers, 2 peers, layers covered 0:8" in out
    assert f"left out …{ids[3][-8:]} 7:1000000: announces layers 7:1000000 beyond" in out
    assert f"left out …{ids[4][-8:]} 0:8: another checkpoint" in out
    assert all(i in out for i in ids)  # every peer's full id, under the table
    assert _coverage([("a", 0, 4), ("b", 6, 9), ("c", 3, 5)]) == "0:5, 6:9"
