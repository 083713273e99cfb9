"""A peer's identity: one Ed25519 key, persisted so that the peer id survives restarts.

Why persisted: DHT records, routing tables and other peers' address books all name a peer by the id derived from its
public key; a fresh key on every start would orphan all of them. The file holds libp2p's protobuf encoding of the
private key (the format go-libp2p and kubo use), is written with mode 0600 inside a directory created 0700, and is
replaced atomically so that a crash never leaves half a key behind. A key file that others may read (mode 0644,
0666: copied, or written by hand) is still used, with a warning saying to ``chmod 600`` it: anyone who reads it can
act as this peer.

Two running peers with one key would share one peer id, and the swarm keeps only one of them (the other silently
vanishes): a node that loads its key from a file holds a lock on it (:func:`lock_key_file`), so a second peer started
with the same file on the same machine is refused, naming the file. (Copies of one key file on two machines are not
detected.)
"""

from __future__ import annotations

import logging
import os
import re
import stat
import tempfile
from pathlib import Path
from typing import IO

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from ..errors import KeyInUse, NetworkError

__all__ = [
    "DEFAULT_KEY_PATH",
    "KeyInUse",
    "default_key_path",
    "generate_key_pair",
    "load_key_pair",
    "load_or_create_key_pair",
    "lock_key_file",
    "peer_id_of",
    "save_key_pair",
    "wrong_peer_id",
]

DEFAULT_KEY_PATH = Path("~/.sangama/peer.key")

log = logging.getLogger(__name__)


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
        with open(path, "rb") as handle:
            mode = stat.S_IMODE(os.fstat(handle.fileno()).st_mode)
            data = handle.read()
    except OSError as exc:
        raise NetworkError(f"cannot read peer key {path}: {exc}") from exc
    if mode & 0o077:
        log.warning("peer key %s has mode %04o: other users of this machine may read it and act as this peer; "
                    "run `chmod 600 %s`", path, mode, path)
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


_ACTUAL_ID = re.compile(r"remote_peer_id_from_pubkey=(\w+)")


def wrong_peer_id(exc: BaseException | None) -> str | None:
    """The peer id that really answered, if ``exc`` (or what caused it) is Noise proving another identity than the
    one dialled (a wrong ``/p2p/<id>`` in an address); ``None`` otherwise."""
    for _ in range(16):
        if exc is None:
            return None
        if type(exc).__name__ == "PeerIDMismatchesPubkey":
            found = _ACTUAL_ID.search(str(exc))
            return found.group(1) if found else "another peer"
        exc = exc.__cause__ or exc.__context__
    return None


def lock_key_file(path: Path) -> IO[str]:
    """Hold an exclusive lock on ``path``'s ``.lock`` sibling for as long as the returned file stays open; raises
    :class:`KeyInUse`, naming the key file and the holder's pid, when another process holds it."""
    import fcntl

    path = Path(path).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # as save_key_pair would create it
    handle = open(path.with_name(path.name + ".lock"), "a+")  # noqa: SIM115 - held for the node's lifetime
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "?"
        handle.close()
        raise KeyInUse(f"key file {path} is in use by another running peer (pid {holder}): two peers with one key "
                       "share one peer id and knock each other off the swarm; give this one its own --key FILE") from None
    handle.seek(0)
    handle.truncate()
    handle.write(str(os.getpid()))
    handle.flush()
    return handle
