"""Issue 27, item 2: a home fleet whose only bootstrap and relay is go-libp2p's daemon (``p2pd``, go-libp2p v0.32,
from the hivemind wheel that ``.ci/fetch-models`` unpacks), in network namespaces with real NATs.

go-libp2p answers no ``/sangama/dialback/1`` and keeps no ``/sangama/`` DHT values, and its AutoNAT refuses to dial
private addresses. Before: every stage stayed ``reachability: unknown`` and every generation failed ``no live peer
serves``: the providers that go handed out carried only the stages' private addresses (no circuit address), and no DHT
server held their records. Now the stages act as private peers (DHT clients with a reservation on the go relay) and
say why, a dial tries a circuit through the relays it knows once a peer's known addresses fail, and a survey asks a
provider itself for its record when no DHT server has it. Then a Sangama DHT server joins the go bootstrap, and the
fleet still gives ``generate --local``'s tokens.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from .netns import RELAY_IP, NatLab, netns_unavailable_reason
from .cli_fleet import TOKENS, Proc, cli, generate, join, local_tokens, make_tiny

_P2PD = Path(os.environ.get("SANGAMA_TEST_MODELS", Path.home() / ".cache" / "sangama-test")).expanduser() / "p2pd"
_REASON = netns_unavailable_reason() or (None if _P2PD.is_file() else f"no go-libp2p daemon at {_P2PD} (run "
                                                                      "`bash .ci/fetch-models`)")
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _p2pd(lab: NatLab, tmp: Path) -> tuple[Proc, str]:
    """go-libp2p's daemon on the public relay host: a DHT server, a relay (public by force: nobody can tell it) and an
    AutoNAT server. Returns the process and its address."""
    go = Proc(["ip", "netns", "exec", lab.ns["relay"], str(_P2PD), "-dhtServer", "-hostAddrs",
                "/ip4/0.0.0.0/tcp/4001", "-listen", f"/unix{tmp}/p2pd.sock", "-forceReachabilityPublic", "-autonat"])
    line, _ = go.wait_for("Peer ID:", 30)
    return go, f"/ip4/{RELAY_IP}/tcp/4001/p2p/{line.split()[-1]}"


def test_p2pd_as_the_only_bootstrap_and_relay_then_beside_a_sangama_dht_server(tmp_path: Path) -> None:
    tiny = make_tiny(tmp_path / "tiny")
    expected = local_tokens(tiny, TOKENS)
    procs: list[Proc] = []
    with NatLab(sides="abcd") as lab:
        try:
            go, boot = _p2pd(lab, tmp_path)
            procs.append(go)
            stages = [join(tiny, boot, layers, tmp_path / f"{side}.key", lab.ns[f"priv{side}"])
                      for side, layers in zip("abc", ("0:3", "3:6", "6:8"))]
            procs.extend(stages)
            for s in stages:
                s.wait_for("ready ", 90)
                assert s.wait_for("  reachable ", 5)[0].split()[1] == "relayed"  # a reservation on the go relay
            # undecided is said, and acted on as private (the stage is a DHT client, not a server nobody can dial)
            said = [x for x in stages[0].err if "reachability undecided" in x]
            assert said and "acting as not publicly reachable" in said[0], stages[0].err[-20:]

            got, took, result = generate(tiny, boot, lab.ns["privd"], 0)  # the client's only bootstrap: go
            assert got == expected
            assert len(result["route"]) == 3
            print(f"\np2pd alone: {TOKENS} tokens in {took:.2f} s (client process included)")

            # a Sangama DHT server joins the go bootstrap; clients still find the fleet through go alone
            (tmp_path / "dht.toml").write_text(f'[host]\nbootstrap_addrs = ["{boot}"]\n')
            dht = Proc(cli("bootstrap", "--config", str(tmp_path / "dht.toml"), "--listen", "/ip4/0.0.0.0/tcp/4001",
                             "--key", str(tmp_path / "dht.key"), ns=lab.ns["pub"]))
            procs.append(dht)
            dht.wait_for("  --bootstrap ", 60)
            got2, took2, _ = generate(tiny, boot, lab.ns["privd"], 2)
            assert got2 == expected
            print(f"p2pd beside a Sangama DHT server: {TOKENS} tokens with 2 guesses in {took2:.2f} s")
        finally:
            for p in procs:
                p.stop()


def test_p2pd_version_is_the_one_fetched() -> None:
    """The binary runs here (a wrong architecture or a truncated download fails loudly, not as a skipped test)."""
    out = subprocess.run([str(_P2PD), "-h"], capture_output=True, text=True, timeout=30)
    assert "-dhtServer" in out.stderr + out.stdout
