"""A peer's identity: one Ed25519 key, persisted so that the peer id survives restarts.

Why persisted: DHT records, routing tables and other peers' address books all name a peer by the id derived from its
public key; a fresh key on every start would orphan all of them. The file holds libp2p's protobuf encoding of the
private key (the format go-libp2p and kubo use), is written with mode 0600 inside a directory created 0700, and is
replaced atomically so that a crash never leaves half a key behind.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from ..errors import NetworkError

__all__ = [
    "DEFAULT_KEY_PATH",
    "default_key_path",
    "generate_key_pair",
    "load_key_pair",
    "load_or_create_key_pair",
    "peer_id_of",
    "save_key_pair",
]

DEFAULT_KEY_PATH = Path("~/.sangama/peer.key")


def default_key_path() -> Path:
    """The key file used when none is given: ``~/.sangama/peer.key``."""
    return DEFAULT_KEY_PATH.expanduser()


def generate_key_pair() -> KeyPair:
    """A fresh Ed25519 key pair (not written anywhere)."""
    private = Ed25519PrivateKey.new()
    return KeyPair(private, private.get_public_key())


def load_key_pair(path: Path) -> KeyPair:
    """Read the key at ``path``; a missing, unreadable or corrupt file is a :class:`NetworkError`."""
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise NetworkError(f"cannot read peer key {path}: {exc}") from exc
    try:
        private = deserialize_private_key(data)
    except Exception as exc:  # protobuf and key-parsing errors of several kinds
        raise NetworkError(f"peer key {path} is corrupt (not a libp2p private key): {exc}") from exc
    if private.get_type() != KeyType.Ed25519:
        raise NetworkError(f"peer key {path} is a {private.get_type().name} key; Sangama uses Ed25519 keys")
    return KeyPair(private, private.get_public_key())


def save_key_pair(key_pair: KeyPair, path: Path) -> None:
    """Write ``key_pair`` to ``path`` atomically, mode 0600, creating the parent directory with mode 0700."""
    path = Path(path)
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".peer-key-", dir=path.parent)
        try:
            os.fchmod(fd, 0o600)
            with os.fdopen(fd, "wb") as handle:
                handle.write(key_pair.private_key.serialize())
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise NetworkError(f"cannot write peer key {path}: {exc}") from exc


def load_or_create_key_pair(path: Path | None = None) -> KeyPair:
    """Load the key at ``path`` (default :func:`default_key_path`), creating and saving a new one if absent."""
    path = Path(path).expanduser() if path is not None else default_key_path()
    if path.exists():
        return load_key_pair(path)
    key_pair = generate_key_pair()
    save_key_pair(key_pair, path)
    return key_pair


def peer_id_of(key_pair: KeyPair) -> ID:
    """The libp2p peer id of ``key_pair`` (an identity multihash of the Ed25519 public key)."""
    return ID.from_pubkey(key_pair.public_key)
