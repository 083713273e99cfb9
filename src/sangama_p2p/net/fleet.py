"""Private fleets: a shared secret that keeps strangers out.

Every connection of a fleet member is wrapped in libp2p's private-network layer (in py-libp2p 0.8.1: Salsa20 with an
8-byte random nonce per direction, keyed by a pre-shared key; not the XSalsa20 of libp2p's spec) before Noise runs, so
a peer without the secret cannot even complete a handshake. Only TCP connections go through that layer; QUIC does
not, so ``open_host`` refuses other transports while a secret is set (``host.check_fleet_transports``). The key is derived from the
secret with a domain-separated SHA-256, so the secret file may hold any text (e.g. ``openssl rand -hex 32``).

py-libp2p does not fail on a wrong key: both sides decrypt garbage and wait for bytes that never come. Sangama
bounds every handshake (``HostConfig.handshake_timeout``) and reports a timed-out handshake on a TCP connection that
opened as :func:`mismatch_error`, which names the likely cause.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from ..errors import NetworkError, translate

__all__ = ["mismatch_error", "psk_from_secret", "read_fleet_secret"]

_DOMAIN = b"sangama/fleet-psk/v1\x00"


def read_fleet_secret(path: Path) -> bytes:
    """The secret in ``path`` with surrounding whitespace removed; an unreadable or short file is a NetworkError."""
    try:
        secret = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise translate(exc, NetworkError, f"cannot read fleet secret file {path}")
    if len(secret) < 16:
        raise NetworkError(f"fleet secret in {path} is too short (need at least 16 bytes, e.g. `openssl rand -hex 32`)")
    return secret


def psk_from_secret(secret: bytes) -> str:
    """The 32-byte pre-shared key (as the 64 hex digits py-libp2p expects) derived from a fleet secret."""
    return hashlib.sha256(_DOMAIN + secret).hexdigest()


def mismatch_error(peer: str, addr: str, timeout: float, *, have_secret: bool) -> NetworkError:
    """The error for a handshake that failed or did not finish within ``timeout`` seconds.

    With different pre-shared keys both sides read garbage: usually the handshake hangs, sometimes the garbage
    fails the security negotiation at once. Either way the cause is named the same.
    """
    cause = (
        "this node and the peer use different fleet secrets, or the peer belongs to no private fleet"
        if have_secret
        else "the peer belongs to a private fleet and this node has no --fleet-secret-file"
    )
    return NetworkError(
        f"handshake with {peer} at {addr} failed or did not complete within {timeout:g} s: "
        f"fleet secret mismatch ({cause}), or the peer is unreachable or not a Sangama node"
    )
