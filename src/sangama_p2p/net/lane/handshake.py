"""The bytes of a lane's handshake (``/sangama/lane/3``): pure functions, no trio, no sockets.

The offer (``LaneOffer``: port, token, offer key) travels inside an authenticated Noise stream. Then, on the lane's
own TCP connection::

    dialler -> stage   token (16) || dialler nonce (16) || record(offer key, nonce (0, 0), "sangama lane hello",
                                                                 aad = token || dialler nonce)
    stage -> dialler   stage nonce (16) || record(lane key, nonce (1, 0), "sangama lane ready")

    lane key = HKDF-SHA256(ikm = offer key, salt = dialler nonce || stage nonce, info = "sangama lane 3" || token)

A record is ``u32 big-endian length || AES-256-GCM ciphertext + 16-byte tag`` with the nonce ``direction byte || 3
zero bytes || u64 counter`` (see :mod:`sangama_p2p.net.lane`). Both nonces are fresh random bytes, so every
connection has a key of its own even if an offer were ever used twice, and a record taken from one lane never
authenticates on another. The stage reads the whole fixed-size hello before it looks the token up, then checks it
and claims the offer without yielding (:func:`open_hello` + the caller's ``pop``), so two connections presenting
the same token cannot both pass.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import Final

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from ...errors import NetworkError
from ...wire.messages import LANE_KEY_BYTES, LANE_TOKEN_BYTES

__all__ = [
    "HELLO", "HELLO_BYTES", "NONCE_BYTES", "READY", "READY_BYTES", "TAG_BYTES", "Hello", "lane_key", "open_hello",
    "parse_hello", "record_nonce", "seal_hello",
]

HELLO: Final = b"sangama lane hello"
READY: Final = b"sangama lane ready"
TAG_BYTES: Final = 16
NONCE_BYTES: Final = 16  # each side's fresh randomness for the lane key
UP: Final = 0  # direction byte of records from the dialling (upstream) side
DOWN: Final = 1
_NONCE = struct.Struct(">B3xQ")
_LEN = struct.Struct(">I")
_INFO: Final = b"sangama lane 3"
HELLO_BYTES: Final = LANE_TOKEN_BYTES + NONCE_BYTES + _LEN.size + len(HELLO) + TAG_BYTES
"""What the dialler sends before it waits: exactly this many bytes."""
READY_BYTES: Final = NONCE_BYTES + _LEN.size + len(READY) + TAG_BYTES


def record_nonce(direction: int, counter: int) -> bytes:
    return _NONCE.pack(direction, counter)


def lane_key(offer_key: bytes, token: bytes, dialler_nonce: bytes, stage_nonce: bytes) -> bytes:
    """The key of one lane connection: the offer's key mixed with both sides' fresh nonces."""
    if len(offer_key) != LANE_KEY_BYTES or len(dialler_nonce) != NONCE_BYTES or len(stage_nonce) != NONCE_BYTES:
        raise NetworkError("lane key material of the wrong size")
    hkdf = HKDF(algorithm=hashes.SHA256(), length=LANE_KEY_BYTES, salt=dialler_nonce + stage_nonce,
                info=_INFO + token)
    return hkdf.derive(offer_key)


def seal_hello(token: bytes, offer_key: bytes, dialler_nonce: bytes | None = None) -> tuple[bytes, bytes]:
    """The dialler's first bytes for an offer, and the dialler nonce in them (fresh unless given)."""
    nonce = os.urandom(NONCE_BYTES) if dialler_nonce is None else dialler_nonce
    body = AESGCM(offer_key).encrypt(record_nonce(UP, 0), HELLO, token + nonce)
    return token + nonce + _LEN.pack(len(body)) + body, nonce


@dataclass(frozen=True, slots=True)
class Hello:
    token: bytes
    dialler_nonce: bytes
    record: bytes  # the length-prefixed hello record, not yet authenticated


def parse_hello(data: bytes) -> Hello:
    """Split the dialler's ``HELLO_BYTES`` bytes (the caller read exactly that many)."""
    if len(data) != HELLO_BYTES:
        raise NetworkError(f"a lane hello of {len(data)} bytes, expected {HELLO_BYTES}")
    t, n = LANE_TOKEN_BYTES, LANE_TOKEN_BYTES + NONCE_BYTES
    return Hello(data[:t], data[t:n], data[n:])


def open_hello(hello: Hello, offer_key: bytes) -> bool:
    """Whether ``hello`` was sealed with ``offer_key`` (and its token and nonce were not swapped)."""
    (length,) = _LEN.unpack_from(hello.record)
    if length != len(hello.record) - _LEN.size:
        return False
    try:
        plain = AESGCM(offer_key).decrypt(record_nonce(UP, 0), hello.record[_LEN.size:],
                                          hello.token + hello.dialler_nonce)
    except InvalidTag:
        return False
    return plain == HELLO
