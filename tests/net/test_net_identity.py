"""Identity: a persisted Ed25519 key, reloaded to the same peer id; corrupt files are typed errors."""

from __future__ import annotations

import os
import stat

import pytest

from sangama_p2p.errors import NetworkError
from sangama_p2p.net.identity import load_key_pair, load_or_create_key_pair, peer_id_of, save_key_pair
from libp2p.crypto.secp256k1 import create_new_key_pair as new_secp256k1


def test_key_is_created_private_and_reloaded(tmp_path):
    path = tmp_path / "fresh" / "peer.key"
    first = load_or_create_key_pair(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    again = load_or_create_key_pair(path)
    assert peer_id_of(again) == peer_id_of(first)
    assert peer_id_of(first).to_base58().startswith("12D3KooW")  # Ed25519 identity multihash


def test_corrupt_and_truncated_key_files_are_network_errors(tmp_path):
    path = tmp_path / "peer.key"
    load_or_create_key_pair(path)
    good = path.read_bytes()
    for bad in (b"not a key", good[: len(good) // 2], b""):
        path.write_bytes(bad)
        with pytest.raises(NetworkError, match="corrupt"):
            load_key_pair(path)


def test_missing_file_and_wrong_key_type_are_network_errors(tmp_path):
    with pytest.raises(NetworkError, match="cannot read"):
        load_key_pair(tmp_path / "absent.key")
    path = tmp_path / "secp.key"
    save_key_pair(new_secp256k1(), path)
    with pytest.raises(NetworkError, match="Ed25519"):
        load_key_pair(path)
