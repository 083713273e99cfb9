"""HostConfig: validation, TOML loading (the shipped bootstrap config), and the net package's public surface."""

from __future__ import annotations

from pathlib import Path

import pytest

import sangama_p2p.net as net
from sangama_p2p.cli.net_cmds import default_bootstrap_addrs
from sangama_p2p.errors import NetworkError
from sangama_p2p.net.config import HostConfig, Limits

ROOT = Path(__file__).resolve().parents[2]


def test_bad_values_are_network_errors():
    with pytest.raises(NetworkError, match="bad multiaddr in announce_addrs"):
        HostConfig(announce_addrs=("not/an/addr",))
    with pytest.raises(NetworkError, match="listen_addrs is empty"):
        HostConfig(listen_addrs=())
    with pytest.raises(NetworkError, match="too short"):
        HostConfig(fleet_secret=b"short")
    with pytest.raises(NetworkError, match="positive"):
        HostConfig(handshake_timeout=0)
    cfg = HostConfig(listen_addrs=["/ip4/127.0.0.1/tcp/0"])  # lists become tuples: the config stays hashable
    assert cfg.listen_addrs == ("/ip4/127.0.0.1/tcp/0",) and hash(cfg)
    assert cfg.replace(dht_server=False).dht_server is False


def test_shipped_bootstrap_toml_loads_and_flags_override_it(tmp_path):
    cfg = HostConfig.from_toml(ROOT / "bootstrap" / "bootstrap.toml")
    assert cfg.listen_addrs == ("/ip4/0.0.0.0/tcp/4001",)
    assert cfg.limits == Limits(max_connections=1024, max_streams=16384, max_connections_per_peer=4)
    assert cfg.key_path == Path("~/.sangama/bootstrap.key").expanduser()
    over = HostConfig.from_toml(ROOT / "bootstrap" / "bootstrap.toml", listen_addrs=("/ip4/127.0.0.1/tcp/9",))
    assert over.listen_addrs == ("/ip4/127.0.0.1/tcp/9",)
    secret = tmp_path / "fleet.secret"
    secret.write_text("s" * 32)
    toml = tmp_path / "host.toml"
    toml.write_text('[host]\nfleet_secret_file = "fleet.secret"\nannounce_addrs = ["/ip4/203.0.113.7/tcp/4001"]\n')
    cfg = HostConfig.from_toml(toml)
    assert cfg.fleet_secret == b"s" * 32 and cfg.announce_addrs == ("/ip4/203.0.113.7/tcp/4001",)
    toml.write_text("[host]\nlisten = 3\n")
    with pytest.raises(NetworkError, match="unknown keys"):
        HostConfig.from_toml(toml)
    toml.write_text("[host\n")
    with pytest.raises(NetworkError, match="cannot read host config"):
        HostConfig.from_toml(toml)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("[host.limits]\nmax_conections = 3\n", r"unknown keys in \[host.limits\].*max_conections"),
        ("[host]\nlimits = 3\n", "limits must be a table"),
        ('[host.limits]\nmax_connections = "many"\n', "max_connections must be an integer, got 'many'"),
        ('[host]\nlisten_addrs = "/ip4/0.0.0.0/tcp/4001"\n', "listen_addrs must be a list of multiaddr strings"),
        ("[host]\nbootstrap_addrs = [4001]\n", "bootstrap_addrs must be a list of multiaddr strings"),
        ('[host]\ndht_server = "yes"\n', "dht_server must be true or false, got 'yes'"),
        ("[host]\nhandshake_timeout = true\n", "handshake_timeout must be a number, got True"),
        ("[host]\nkey_path = 7\n", "key_path must be a path string, got 7"),
    ],
)
def test_a_wrong_type_in_the_host_table_is_named(tmp_path, body, message):
    """Each of these was a TypeError traceback or a misleading error ("bad multiaddr 'i'") before."""
    toml = tmp_path / "host.toml"
    toml.write_text(body)
    with pytest.raises(NetworkError, match=message):
        HostConfig.from_toml(toml)
    toml.write_text("[host]\nhandshake_timeout = 2\n[host.limits]\nmax_streams = 64\n")  # an int for a float: fine
    cfg = HostConfig.from_toml(toml)
    assert cfg.handshake_timeout == 2 and cfg.limits.max_streams == 64


def test_public_bootstrap_list_is_empty_until_public_nodes_exist():
    assert (ROOT / "bootstrap" / "public.txt").exists()
    assert default_bootstrap_addrs() == ()


def test_net_public_surface_is_pinned():
    assert sorted(net.__all__) == [
        "Announcer", "HostConfig", "Limits", "Node", "ServingOffer", "ServingRecord", "decode_record",
        "default_key_path", "find_serving_peers", "load_or_create_key_pair", "open_host", "peer_id_of", "record_key", "sign_record",
    ]
    for name in net.__all__:
        assert getattr(net, name) is not None
