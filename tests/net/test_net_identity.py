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


@pytest.mark.parametrize("mode", [0o644, 0o666, 0o640])
def test_a_key_file_others_may_read_is_used_with_a_warning_to_chmod_it(tmp_path, caplog, mode):
    """Issue 23, item 6: a key file of mode 0644/0666 was used without a word; anyone who reads it is this peer."""
    path = tmp_path / "peer.key"
    first = load_or_create_key_pair(path)
    os.chmod(path, mode)
    with caplog.at_level("WARNING", logger="sangama_p2p.net.identity"):
        again = load_key_pair(path)
    assert peer_id_of(again) == peer_id_of(first)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warned) == 1 and f"chmod 600 {path}" in warned[0] and f"{mode:04o}" in warned[0]


def test_a_private_key_file_loads_without_a_warning(tmp_path, caplog):
    path = tmp_path / "peer.key"
    load_or_create_key_pair(path)
    with caplog.at_level("WARNING", logger="sangama_p2p.net.identity"):
        load_key_pair(path)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_the_key_lock_creates_its_directory_private(tmp_path):
    """The lock may be the first to create ~/.sangama (a key passed in, a lock taken first): 0700 as documented."""
    from sangama_p2p.net.identity import lock_key_file

    old = os.umask(0o022)
    try:
        handle = lock_key_file(tmp_path / "new" / "peer.key")
    finally:
        os.umask(old)
    handle.close()
    assert stat.S_IMODE(os.stat(tmp_path / "new").st_mode) == 0o700
