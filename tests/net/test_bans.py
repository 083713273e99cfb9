"""The local ban list (net/bans.py): reasons, expiry, a file that outlives the process, typed errors."""

from __future__ import annotations

import json

import pytest

from sangama_p2p.errors import NetworkError
from sangama_p2p.net.bans import Ban, BanList, load_bans


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_ban_holds_until_it_expires(tmp_path):
    clock = Clock()
    bans = BanList(clock=clock)
    b = bans.ban("peerA", "answered [5] where 3 chains answered [9]", duration=60, model_id="m")
    assert (b.since, b.until, b.model_id) == (1000.0, 1060.0, "m")
    assert bans.banned() == {"peerA"} and bans.reasons() == {"peerA": b.reason}
    clock.t = 1059.9
    assert bans.banned() == {"peerA"}
    clock.t = 1060.0
    assert bans.banned() == frozenset() and bans.active() == []
    with pytest.raises(NetworkError):
        bans.ban("peerA", "x", duration=0)


def test_a_second_ban_never_shortens_the_first():
    clock = Clock()
    bans = BanList(clock=clock)
    bans.ban("p", "first", duration=100)
    clock.t += 10
    b = bans.ban("p", "second", duration=5)
    assert b.until == 1100.0 and b.reason == "second"


def test_bans_outlive_the_process_in_their_file(tmp_path):
    path = tmp_path / "sub" / "bans.json"
    clock = Clock()
    BanList(path, clock=clock).ban("p1", "lied", duration=50)
    BanList(path, clock=clock).ban("p2", "lied too", duration=10)  # loads p1, adds p2
    again = BanList(path, clock=clock)
    assert again.reasons() == {"p1": "lied", "p2": "lied too"}
    clock.t += 20  # p2 expired: dropped from memory and file
    assert again.banned() == {"p1"}
    assert [b.peer_id for b in load_bans(path)] == ["p1"]
    assert load_bans(path, now=clock.t + 100) == []
    assert again.unban("p1") and not again.unban("p1") and load_bans(path) == []


@pytest.mark.parametrize("text", ["not json", "[]", '{"bans": 3}', '{"bans": [1]}',
                                  '{"bans": [{"peer_id": "p"}]}',
                                  '{"bans": [{"peer_id": "p", "reason": "r", "since": 5, "until": 1}]}'])
def test_a_file_that_is_no_ban_list_is_a_typed_error(tmp_path, text):
    path = tmp_path / "bans.json"
    path.write_text(text)
    with pytest.raises(NetworkError):
        load_bans(path)


def test_a_ban_needs_a_peer_and_a_reason():
    with pytest.raises(NetworkError):
        Ban("", "r", 0, 1)
    with pytest.raises(NetworkError):
        Ban("p", "", 0, 1)
    assert json.loads(json.dumps({"since": Ban("p", "r", 0, 1).since})) == {"since": 0}


def test_status_shows_this_nodes_bans_with_their_reasons(tmp_path, capsys):
    import time

    from sangama_p2p.cli.net_cmds import _print_table
    from sangama_p2p.net.status import PeerStatus, SwarmStatus, ban_lines

    path = tmp_path / "bans.json"
    BanList(path).ban("12D3KooWLiar", "wrong tokens for org/m (trip 1): answered [1] where 3 chains answered [9]",
                      duration=7200, model_id="org/m")
    BanList(path).ban("12D3KooWGone", "old", duration=1)
    time.sleep(1.05)  # the second ban has expired
    status = SwarmStatus((PeerStatus("12D3KooWLiar", "direct", 1.0, ()),), time.time()).with_bans(path)
    assert [b.peer_id for b in status.bans] == ["12D3KooWLiar"]
    lines = ban_lines(status)
    assert len(lines) == 1 and "12D3KooWLiar for org/m (in the swarm now; 2.0 h left)" in lines[0]
    assert "answered [1] where 3 chains answered [9]" in lines[0]
    assert status.to_json()["bans"][0]["reason"].startswith("wrong tokens")
    assert SwarmStatus((), 0.0).with_bans(tmp_path / "none.json").bans == ()
    _print_table(status)
    out = capsys.readouterr().out
    assert "banned here" in out and "12D3KooWLiar" in out and "wrong tokens" in out


def test_the_ban_list_creates_its_directory_private(tmp_path):
    """Issue 23, item 6: ~/.sangama was created 0755 when the ban list made it before the key file (docs: 0700)."""
    import os
    import stat

    old = os.umask(0o022)
    try:
        bans = BanList(path=tmp_path / ".sangama" / "bans.json")
        bans.ban("peerA", "lied", duration=60)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / ".sangama").st_mode) == 0o700
    assert [b.peer_id for b in load_bans(tmp_path / ".sangama" / "bans.json")] == ["peerA"]


def test_a_ban_follows_the_same_checkpoint_and_range_from_the_same_address(tmp_path: Path) -> None:
    """Issue 26: keys are free. A ban made with the address the client's link saw, the fingerprint and the range
    also leaves out another key serving that range of that checkpoint from that address - and nobody else."""
    path = tmp_path / "bans.json"
    bans = BanList(path)
    bans.ban("liar", "answered [5]", model_id="m", address="198.18.0.1", fingerprint="f" * 32, layers="0:8")
    src = ("address 198.18.0.1", "network 198.18.0.0/24")
    peers = [("liar2", src, "f" * 32, "0:8"),  # the liar under a new key
             ("other-range", src, "f" * 32, "0:4"),  # the same host serving another range (a home fleet's)
             ("other-model", src, "e" * 32, "0:8"),
             ("neighbour", ("address 198.18.0.7", "network 198.18.0.0/24"), "f" * 32, "0:8"),  # same /24 only
             ("loopback", (), "f" * 32, "0:8")]
    followed = BanList(path).follow(peers)  # from the file, as the next run reads it
    assert list(followed) == ["liar2"] and "from its address 198.18.0.1" in followed["liar2"]
    # a ban without an address (a loopback or relayed liar) follows nobody
    bans.ban("relayed", "answered [5]", model_id="m", fingerprint="f" * 32, layers="0:8")
    assert list(BanList(path).follow(peers)) == ["liar2"]


def test_routing_leaves_out_a_peer_a_ban_follows() -> None:
    from sangama_p2p.client.routing import RouteCandidate, plan_route
    from sangama_p2p.client.verifier import Verification

    src = ("address 198.18.0.1", "network 198.18.0.0/24")
    offers = [RouteCandidate("new-key", 0, 8, throughput=1e6, rtt=0.001, fingerprint="f" * 32, source=src),
              RouteCandidate("honest", 0, 8, throughput=10.0, rtt=0.001, fingerprint="f" * 32,
                             source=("address 198.18.0.2", "network 198.18.0.0/24"))]
    v = Verification(client=None)
    assert [o.peer_id for o in plan_route(offers, 8, banned=v.banned(offers))] == ["new-key"]
    v.bans.ban("old-key", "wrong tokens", address="198.18.0.1", fingerprint="f" * 32, layers="0:8")
    banned = v.banned(offers)
    assert set(banned) == {"old-key", "new-key"}
    assert [o.peer_id for o in plan_route(offers, 8, banned=banned)] == ["honest"]
