"""Signed serving records: what a peer serves, how fast, where to reach it, until when.

A serving peer publishes one :class:`ServingRecord` per model under ``record_key(model_id, peer_id)`` in the DHT.
Records are signed with the peer's Ed25519 key and carry the public key, so anyone can check that the record was
written by the peer its key names. py-libp2p keeps DHT values for a fixed 24 h, so the record carries its own
``expires_at`` and the validator rejects stale records; ``seq`` orders re-publications, and :func:`select_best`
keeps the newest, so a stale copy never replaces a fresh one.

Encoding: ``msgpack([body, signature])`` where ``body`` is a msgpack map with a fixed set of fields and the
signature covers ``SIGNING_DOMAIN + body``. Pure functions only (no I/O), so tests call them directly.
"""

from __future__ import annotations

import hashlib
import heapq
import math
import re
from dataclasses import dataclass
from typing import Any

import msgpack
import multiaddr
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_public_key
from libp2p.peer.id import ID
from libp2p.records.validator import Validator

from .. import clock
from .._version import __version__
from ..errors import RecordError, translate

__all__ = [
    "DEFAULT_TTL",
    "MAX_DEPTH",
    "MAX_TTL",
    "NAMESPACE",
    "RecordLedger",
    "RecordValidator",
    "ServingRecord",
    "SignedRecord",
    "decode_record",
    "provider_key",
    "record_key",
    "select_best",
    "sign_record",
]

NAMESPACE = "sangama"  # the DHT key namespace: keys look like /sangama/<hash of model id and peer id>
SCHEMA = "sangama/serving/3"  # 2 added the checkpoint's identity (fp, depth, lh); 3 the measured links (links);
# records of an older schema are refused
SIGNING_DOMAIN = b"sangama-serving-record-v1\x00"
DEFAULT_TTL = 180.0
MAX_TTL = 3600.0  # a record claiming to live longer is rejected (no near-immortal records)
MAX_RECORD_BYTES = 8192
MAX_ADDRS = 16
MAX_DEPTH = 1_000_000  # layer indices and the model's depth stay below this
MAX_LINKS = 16  # measured round trips a record carries (to the stages that can follow this one)
MAX_LINK_US = 60_000_000  # a measured round trip over a minute is refused (microseconds)
_FIELDS = frozenset(
    {"schema", "model", "peer", "pk", "start", "end", "tps", "free", "addrs", "reach", "sw", "exp", "seq",
     "fp", "depth", "lh", "links"}
)
_PART_NAMES = ("embed", "head")
_LAYER_KEY = re.compile(r"0|[1-9][0-9]{0,6}")  # ASCII, canonical decimal, below MAX_DEPTH


@dataclass(frozen=True)
class ServingRecord:
    """One peer's offer for one model: layers ``[start, end)``; ``reachability`` is ``"direct"`` or a relay's id."""

    model_id: str
    peer_id: str
    start: int
    end: int
    throughput: float  # steps per second one session gets (``StageServer.throughput``; record key "tps")
    free_sessions: int  # sessions it can still open (record key "free")
    addrs: tuple[str, ...]  # announced public addresses first
    reachability: str
    version: str
    expires_at: float  # unix seconds
    seq: int
    fingerprint: str = ""  # the checkpoint's model fingerprint, 32 hex digits (model.fingerprint)
    num_layers: int = 0  # the model's depth, from the fingerprinted config
    layer_hashes: tuple[tuple[str, str], ...] = ()  # (part, 32 hex digits) for the parts this stage holds
    links: tuple[tuple[str, float], ...] = ()  # (peer id, round trip in s) it measured to stages that can follow it

    @property
    def ttl_left(self) -> float:
        return self.expires_at - clock.wall()


@dataclass(frozen=True)
class SignedRecord:
    """A record with the bytes it was decoded from (what travels in the DHT)."""

    record: ServingRecord
    value: bytes


def record_key(model_id: str, peer_id: ID | str) -> str:
    """The DHT key of ``peer_id``'s record for ``model_id``: ``/sangama/<32 hex digits>``.

    Hashed because model ids contain ``/``, and short because py-libp2p's DHT servers ignore FIND_NODE lookups
    for keys over 50 bytes, which would leave the record on no peer but its author.
    """
    digest = hashlib.sha256(b"sangama/record\x00" + model_id.encode() + b"\x00" + str(peer_id).encode())
    return f"/{NAMESPACE}/{digest.hexdigest()[:32]}"


def provider_key(model_id: str) -> str:
    """The DHT provider key of ``model_id``: 64 hex digits, i.e. a 32-byte key, the same on every peer."""
    return hashlib.sha256(b"sangama/provide\x00" + model_id.encode()).hexdigest()


def sign_record(
    key_pair: KeyPair,
    *,
    model_id: str,
    start: int,
    end: int,
    throughput: float,
    free_sessions: int,
    addrs: tuple[str, ...] | list[str],
    reachability: str = "direct",
    version: str = "",
    ttl: float = DEFAULT_TTL,
    seq: int = 0,
    now: float | None = None,
    fingerprint: str,
    num_layers: int,
    layer_hashes: tuple[tuple[str, str], ...] | list[tuple[str, str]] = (),
    links: tuple[tuple[str, float], ...] | list[tuple[str, float]] = (),
) -> SignedRecord:
    """Build, sign and encode a record; the result decodes with :func:`decode_record` (which checks everything).

    ``fingerprint`` (32 hex digits), ``num_layers`` and ``layer_hashes`` are the checkpoint's identity
    (:class:`sangama_p2p.model.fingerprint.ModelIdentity`); a malformed one raises :class:`RecordError`. ``links``:
    the round trips (seconds) this stage measured to the stages that can follow it (at most ``MAX_LINKS``; stored in
    whole microseconds).
    """
    if version == "":
        version = __version__
    peer_id = ID.from_pubkey(key_pair.public_key)
    exp = (clock.wall() if now is None else now) + ttl
    body = {
        "schema": SCHEMA,
        "model": model_id,
        "peer": peer_id.to_base58(),
        "pk": key_pair.public_key.serialize(),
        "start": int(start),
        "end": int(end),
        "tps": float(throughput),
        "free": int(free_sessions),
        "addrs": [str(a) for a in addrs][:MAX_ADDRS],
        "reach": reachability,
        "sw": version,
        "exp": float(exp),
        "seq": int(seq),
        "fp": _unhex(fingerprint, "fingerprint"),
        "depth": int(num_layers),
        "lh": {str(part): _unhex(digest, f"layer hash of {part}") for part, digest in layer_hashes},
        "links": {str(peer): max(1, round(float(rtt) * 1e6)) for peer, rtt in list(links)[:MAX_LINKS]},
    }
    body_bytes = msgpack.packb(body, use_bin_type=True)
    signature = key_pair.private_key.sign(SIGNING_DOMAIN + body_bytes)
    value = msgpack.packb([body_bytes, signature], use_bin_type=True)
    return SignedRecord(decode_record(record_key(model_id, peer_id), value, now=now), value)


def decode_record(key: str, value: bytes, *, now: float | None = None) -> ServingRecord:
    """Check ``value`` against ``key`` and return its record, or raise :class:`RecordError` saying why.

    Rejects: oversized or undecodable bytes, a body that breaks the schema, a key outside our namespace or not
    derived from the record's model and peer, a public key that does not hash to the record's peer id, a bad
    signature, and an expired record (or one claiming to live longer than ``MAX_TTL``).
    """
    if not key.startswith(f"/{NAMESPACE}/"):
        raise RecordError(f"record key {key!r} is not in the /{NAMESPACE}/ namespace")
    if len(value) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
    try:
        envelope = msgpack.unpackb(value, raw=False, strict_map_key=True, max_bin_len=MAX_RECORD_BYTES)
        body_bytes, signature = envelope
        if not isinstance(body_bytes, bytes) or not isinstance(signature, bytes):
            raise TypeError("envelope fields are not bytes")
        body = msgpack.unpackb(body_bytes, raw=False, strict_map_key=True)
    except Exception as exc:  # untrusted bytes: msgpack raises several types, unpacking a non-pair ValueError/TypeError
        raise translate(exc, RecordError, "record is not a msgpack [body, signature] envelope")
    record, public_key_bytes = _parse_body(body)
    if key != record_key(record.model_id, record.peer_id):
        raise RecordError(f"record for {record.peer_id} / {record.model_id!r} is stored under the wrong key {key!r}")
    try:
        public_key = deserialize_public_key(public_key_bytes)
    except Exception as exc:  # untrusted bytes: libp2p's key parsers raise protobuf's, cryptography's and others
        raise translate(exc, RecordError, "record's public key does not parse")
    if public_key.get_type() != KeyType.Ed25519:
        raise RecordError("record's public key is not Ed25519")
    if ID.from_pubkey(public_key).to_base58() != record.peer_id:
        raise RecordError(f"record's public key is not the key of peer {record.peer_id} (forged signer)")
    try:
        valid = public_key.verify(SIGNING_DOMAIN + body_bytes, signature)
    except Exception as exc:  # untrusted signature bytes: the verifier's own errors
        raise translate(exc, RecordError, "record signature check failed")
    if not valid:
        raise RecordError(f"record signature of {record.peer_id} is invalid (tampered or forged)")
    now = clock.wall() if now is None else now
    if record.expires_at <= now:
        raise RecordError(f"record of {record.peer_id} expired {now - record.expires_at:.1f} s ago")
    if record.expires_at > now + MAX_TTL + 60:  # 60 s allowance for clock skew
        raise RecordError(f"record of {record.peer_id} claims to live {record.expires_at - now:.0f} s (> {MAX_TTL:g})")
    return record


def _parse_body(body: Any) -> tuple[ServingRecord, bytes]:
    if not isinstance(body, dict):
        raise RecordError("record body is not a map")
    if set(body) != _FIELDS:
        raise RecordError(f"record fields {sorted(body)} differ from the schema's {sorted(_FIELDS)}")
    if body["schema"] != SCHEMA:
        raise RecordError(f"record schema {body['schema']!r} is not {SCHEMA!r}")
    _check(body, "model", str, lambda v: 0 < len(v) <= 256)
    _check(body, "peer", str, lambda v: 0 < len(v) <= 128)
    _check(body, "pk", bytes, lambda v: 0 < len(v) <= 128)
    _check(body, "start", int, lambda v: 0 <= v < MAX_DEPTH)
    _check(body, "end", int, lambda v: body["start"] < v <= MAX_DEPTH)
    _check(body, "tps", float, lambda v: math.isfinite(v) and v >= 0)
    _check(body, "free", int, lambda v: 0 <= v < 2**63)
    _check(body, "addrs", list, lambda v: len(v) <= MAX_ADDRS and all(_is_multiaddr(a) for a in v))
    _check(body, "reach", str, lambda v: v == "direct" or _is_peer_id(v))
    _check(body, "sw", str, lambda v: len(v) <= 64)
    _check(body, "exp", float, math.isfinite)
    _check(body, "seq", int, lambda v: 0 <= v < 2**63)
    _check(body, "fp", bytes, lambda v: len(v) == 16)
    _check(body, "depth", int, lambda v: 0 < v <= MAX_DEPTH)
    _check(body, "lh", dict, lambda v: all(_is_part(k, body) and isinstance(h, bytes) and len(h) == 16
                                           for k, h in v.items()))
    _check(body, "links", dict, lambda v: len(v) <= MAX_LINKS and all(
        isinstance(k, str) and _is_peer_id(k) and k != body["peer"] and isinstance(us, int) and not isinstance(us, bool)
        and 0 < us <= MAX_LINK_US for k, us in v.items()))
    record = ServingRecord(
        model_id=body["model"],
        peer_id=body["peer"],
        start=body["start"],
        end=body["end"],
        throughput=body["tps"],
        free_sessions=body["free"],
        addrs=tuple(body["addrs"]),
        reachability=body["reach"],
        version=body["sw"],
        expires_at=body["exp"],
        seq=body["seq"],
        fingerprint=body["fp"].hex(),
        num_layers=body["depth"],
        layer_hashes=tuple(sorted(((k, h.hex()) for k, h in body["lh"].items()), key=lambda kv: _part_key(kv[0]))),
        links=tuple(sorted((k, us / 1e6) for k, us in body["links"].items())),
    )
    return record, body["pk"]


def _check(body: dict[str, Any], name: str, kind: type, ok: Any) -> None:
    value = body[name]
    if not isinstance(value, kind) or isinstance(value, bool) or not ok(value):
        raise RecordError(f"record field {name!r} is invalid: {value!r:.80}")


def _unhex(text: str, what: str) -> bytes:
    try:
        raw = bytes.fromhex(text)
    except (TypeError, ValueError) as exc:
        raise translate(exc, RecordError, f"{what} {text!r:.40} is not hex")
    if len(raw) != 16:
        raise RecordError(f"{what} must be 16 bytes (32 hex digits), got {len(raw)}")
    return raw


def _is_part(key: Any, body: dict[str, Any]) -> bool:
    """A part a stage of ``[start, end)`` may hash: one of its layers (``"3"``), ``embed`` or ``head``."""
    if not isinstance(key, str):
        return False
    if key in _PART_NAMES:
        return True
    return _LAYER_KEY.fullmatch(key) is not None and body["start"] <= int(key) < body["end"]


def _part_key(part: str) -> tuple[int, int]:
    if part == "embed":
        return (0, 0)
    return (1, int(part)) if part.isdigit() else (2, 0)


def _is_multiaddr(text: Any) -> bool:
    if not isinstance(text, str) or len(text) > 256:
        return False
    try:
        multiaddr.Multiaddr(text)
    except (ValueError, multiaddr.exceptions.Error):  # its parse errors (StringParseError is a ValueError)
        return False
    return True


def _is_peer_id(text: str) -> bool:
    try:
        ID.from_base58(text)
    except ValueError:  # not base58 (UnicodeEncodeError included), or not a multihash
        return False
    return True


def select_best(key: str, values: list[bytes], *, now: float | None = None) -> int:
    """Index of the newest valid value (highest ``seq``, then latest expiry); invalid values always lose."""
    best_index, best_rank = 0, (-1, -math.inf)
    for index, value in enumerate(values):
        try:
            record = decode_record(key, value, now=now)
        except RecordError:  # an invalid or expired copy never wins
            continue
        rank = (record.seq, record.expires_at)
        if rank > best_rank:
            best_index, best_rank = index, rank
    return best_index


class RecordValidator(Validator):
    """The DHT validator for the ``sangama`` namespace: py-libp2p stores and forwards only what passes.

    It remembers the record it decoded last, so that the store that takes the value right after (py-libp2p's
    PUT_VALUE handler validates, then stores) reads its author and expiry without checking the signature again.
    """

    def __init__(self) -> None:
        self._last: tuple[str, bytes, ServingRecord] | None = None

    def validate(self, key: str, value: bytes) -> None:
        self._last = (key, value, decode_record(key, value))

    def select(self, key: str, values: list[bytes]) -> int:
        return select_best(key, values)

    def checked(self, key: str, value: bytes) -> ServingRecord:
        """The record ``value`` holds: the one :meth:`validate` just decoded, else decoded (and checked) now."""
        last = self._last
        if last is not None and last[0] == key and last[1] == value and last[2].expires_at > clock.wall():
            return last[2]
        return decode_record(key, value)


class RecordLedger:
    """Who wrote each record a DHT server stores and when it expires: caps per author and in total, and the expiry
    order the sweep follows (a heap, so a sweep reads only what expired and never checks a signature again).

    Pure bookkeeping over keys (no store, no I/O): the caller drops what :meth:`admit` and :meth:`expired` return.
    Who makes room, for a new key: an author at ``max_per_peer`` gives up its own soonest-expiring record; in a store
    of ``max_records`` the author holding the most records does; if every author holds a single record, the new one
    is refused (:class:`RecordError`), so a flood of identities never costs a peer its only record.
    """

    def __init__(self, *, max_records: int, max_per_peer: int) -> None:
        self.max_records = max_records
        self.max_per_peer = max_per_peer
        self._expiry: dict[bytes, float] = {}
        self._author: dict[bytes, str] = {}
        self._by_author: dict[str, set[bytes]] = {}
        self._heap: list[tuple[float, bytes]] = []  # (expiry, key), stale entries skipped when popped

    def __len__(self) -> int:
        return len(self._expiry)

    def count(self, author: str) -> int:
        return len(self._by_author.get(author, ()))

    def admit(self, key: bytes, author: str, expires_at: float, *, own: bool = False) -> list[bytes]:
        """Account for ``key`` (new, or a re-publication); the keys to drop to make room, already forgotten here.

        Raises :class:`RecordError`, changing nothing, when the store is full of single records of other authors,
        unless the record is the node's ``own``: then the soonest-expiring record in the store gives way.
        """
        if self._author.get(key) not in (None, author):
            self.discard(key)
        evicted: list[bytes] = []
        if key not in self._expiry:
            if self.count(author) >= self.max_per_peer:
                evicted.append(self._soonest(author))
            elif len(self._expiry) >= self.max_records:
                biggest = max(self._by_author, key=lambda a: len(self._by_author[a]))
                if len(self._by_author[biggest]) >= 2:
                    evicted.append(self._soonest(biggest))
                elif own:
                    evicted.append(min(self._expiry, key=lambda k: (self._expiry[k], k)))
                else:
                    raise RecordError(f"DHT record store full ({len(self._expiry)} records, one per author): "
                                      f"record of {author} refused")
            for old in evicted:
                self.discard(old)
        self._expiry[key] = expires_at
        self._author[key] = author
        self._by_author.setdefault(author, set()).add(key)
        heapq.heappush(self._heap, (expires_at, key))
        if len(self._heap) > 2 * len(self._expiry) + 1024:  # re-publications left many stale entries: rebuild
            self._heap = [(exp, k) for k, exp in self._expiry.items()]
            heapq.heapify(self._heap)
        return evicted

    def discard(self, key: bytes) -> None:
        """Forget ``key`` (dropped from the store by anyone); its heap entry goes stale."""
        if self._expiry.pop(key, None) is None:
            return
        author = self._author.pop(key)
        keys = self._by_author[author]
        keys.discard(key)
        if not keys:
            del self._by_author[author]

    def expired(self, now: float, limit: int) -> list[bytes]:
        """Up to ``limit`` keys whose expiry is ``now`` or earlier, soonest first, forgotten here."""
        out: list[bytes] = []
        heap = self._heap
        while heap and heap[0][0] <= now and len(out) < limit:
            exp, key = heapq.heappop(heap)
            if self._expiry.get(key) == exp:
                self.discard(key)
                out.append(key)
        return out

    def _soonest(self, author: str) -> bytes:
        return min(self._by_author[author], key=lambda k: (self._expiry[k], k))
