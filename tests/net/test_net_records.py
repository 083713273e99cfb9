"""Signed serving records: round trip, and every way a record must be rejected."""

from __future__ import annotations

import time

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sangama_p2p.errors import RecordError
from sangama_p2p.net.identity import generate_key_pair, peer_id_of
from sangama_p2p.net.records import (
    MAX_TTL,
    SIGNING_DOMAIN,
    RecordValidator,
    decode_record,
    record_key,
    select_best,
    sign_record,
)

KP = generate_key_pair()
OTHER = generate_key_pair()
MODEL = "Qwen/Qwen3.5-35B-A3B"
FP = "5a" * 16
ADDRS = ["/ip4/203.0.113.7/tcp/4001", "/ip4/10.0.0.2/tcp/4001"]


def signed(**changes):
    args = dict(model_id=MODEL, start=0, end=20, throughput=42.5, free_sessions=7, addrs=ADDRS, seq=5, fingerprint=FP,
                num_layers=40, layer_hashes=[("0", "11" * 16), ("embed", "22" * 16)])
    args.update(changes)
    key_pair = args.pop("key_pair", KP)
    return sign_record(key_pair, **args)


def resign(body: dict, key_pair=KP) -> bytes:
    body_bytes = msgpack.packb(body, use_bin_type=True)
    return msgpack.packb([body_bytes, key_pair.private_key.sign(SIGNING_DOMAIN + body_bytes)], use_bin_type=True)


def body_of(value: bytes) -> dict:
    return msgpack.unpackb(msgpack.unpackb(value)[0])


KEY = record_key(MODEL, peer_id_of(KP))


def test_round_trip_keeps_every_field():
    rec = signed(reachability=peer_id_of(OTHER).to_base58(), ttl=90).record
    assert decode_record(KEY, signed().value).model_id == MODEL
    assert (rec.start, rec.end, rec.throughput, rec.free_sessions, rec.seq) == (0, 20, 42.5, 7, 5)
    assert rec.addrs == tuple(ADDRS)  # order kept: public first
    assert rec.peer_id == peer_id_of(KP).to_base58()
    assert rec.reachability == peer_id_of(OTHER).to_base58()
    assert 85 < rec.expires_at - time.time() <= 90
    assert len(KEY) <= 50  # py-libp2p's DHT ignores FIND_NODE for longer keys
    assert record_key(MODEL, peer_id_of(OTHER)) != KEY and record_key("other", peer_id_of(KP)) != KEY


def test_identity_round_trips_and_schema_1_records_are_refused():
    rec = signed().record
    assert (rec.fingerprint, rec.num_layers) == (FP, 40)
    assert rec.layer_hashes == (("embed", "22" * 16), ("0", "11" * 16))  # embed, layers in order, head
    # a record of the previous schema (no identity) is refused, not read as "unknown fingerprint"
    body = body_of(signed().value)
    for field in ("fp", "depth", "lh"):
        del body[field]
    body["schema"] = "sangama/serving/1"
    with pytest.raises(RecordError, match="fields"):
        decode_record(KEY, resign(body))
    with pytest.raises(RecordError, match="32 hex digits"):
        signed(fingerprint="5a" * 8)
    with pytest.raises(RecordError, match="not hex"):
        signed(layer_hashes=[("1", "zz" * 16)])


def test_forged_signer_is_rejected():
    # OTHER signs a body that claims to be KP's record (with KP's peer id, OTHER's public key).
    body = body_of(signed().value)
    body["pk"] = OTHER.public_key.serialize()
    with pytest.raises(RecordError, match="not the key of peer"):
        decode_record(KEY, resign(body, OTHER))
    # ... or keeps KP's public key but signs with OTHER's private key.
    body = body_of(signed().value)
    with pytest.raises(RecordError, match="signature"):
        decode_record(KEY, resign(body, OTHER))


def test_tampered_fields_are_rejected():
    value = signed().value
    body_bytes, sig = msgpack.unpackb(value)
    body = body_of(value)
    body["end"] = 40  # claim more layers without re-signing
    forged = msgpack.packb([msgpack.packb(body, use_bin_type=True), sig], use_bin_type=True)
    with pytest.raises(RecordError, match="signature"):
        decode_record(KEY, forged)
    flipped = bytearray(sig)
    flipped[0] ^= 1
    with pytest.raises(RecordError, match="signature"):
        decode_record(KEY, msgpack.packb([body_bytes, bytes(flipped)], use_bin_type=True))


def test_expired_and_far_future_records_are_rejected():
    old = signed(ttl=10, now=time.time() - 60).value
    with pytest.raises(RecordError, match="expired"):
        decode_record(KEY, old)
    with pytest.raises(RecordError, match="claims to live"):
        decode_record(KEY, signed(ttl=MAX_TTL * 10, now=time.time() + 0).value)
    value = signed(ttl=5).value
    assert decode_record(KEY, value, now=time.time() + 4)
    with pytest.raises(RecordError, match="expired"):
        decode_record(KEY, value, now=time.time() + 6)


@pytest.mark.parametrize(
    "change",
    [
        {"start": 20},  # empty range
        {"start": -1},
        {"tps": float("nan")},
        {"tps": 5},  # int where a float belongs
        {"free": True},
        {"addrs": ["not a multiaddr"]},
        {"addrs": ["/ip4/1.2.3.4/tcp/1"] * 17},
        {"reach": "relayed-somewhere"},
        {"schema": "sangama/serving/0"},
        {"model": ""},
        {"extra": 1},
        {"fp": b"\x01" * 15},  # a fingerprint is 16 bytes
        {"fp": "5a" * 16},  # ... as bin, not hex text
        {"depth": 0},
        {"depth": 1_000_001},
        {"lh": {"20": b"\x01" * 16}},  # a layer the stage does not serve (it serves 0:20)
        {"lh": {"01": b"\x01" * 16}},  # not the canonical spelling of layer 1
        {"lh": {"mtp": b"\x01" * 16}},  # parts are layers, embed and head
        {"lh": {"0": b"\x01" * 8}},
        {"lh": {"\u00b2": b"\x01" * 16}},  # a Unicode digit (str.isdigit says yes, int() refuses)
        {"lh": {"9" * 5000: b"\x01" * 16}},  # more digits than int() converts
        {"lh": {1: b"\x01" * 16}},
    ],
)
def test_schema_violations_are_rejected_even_when_signed(change):
    body = body_of(signed().value)
    body.update(change)
    with pytest.raises(RecordError):
        decode_record(KEY, resign(body))


def test_missing_field_and_garbage_are_rejected():
    body = body_of(signed().value)
    del body["seq"]
    with pytest.raises(RecordError, match="fields"):
        decode_record(KEY, resign(body))
    for garbage in (b"", b"\x00\x01", msgpack.packb([1, 2, 3]), msgpack.packb({"a": 1}), b"\xff" * 9000):
        with pytest.raises(RecordError):
            decode_record(KEY, garbage)
    with pytest.raises(RecordError, match=r"envelope: ValueError: too many values to unpack") as info:
        decode_record(KEY, msgpack.packb([1, 2, 3]))  # the parser's error is named, and kept as the cause
    assert isinstance(info.value.__cause__, ValueError)


def test_wrong_namespace_and_wrong_key_are_rejected():
    value = signed().value
    with pytest.raises(RecordError, match="namespace"):
        decode_record("/pk/" + KEY.split("/")[-1], value)
    with pytest.raises(RecordError, match="wrong key"):
        decode_record(record_key(MODEL, peer_id_of(OTHER)), value)  # replayed under another peer's key
    with pytest.raises(RecordError, match="wrong key"):
        decode_record(record_key("other/model", peer_id_of(KP)), value)


def test_select_keeps_the_newest_valid_record():
    v5, v9, v7 = signed(seq=5).value, signed(seq=9).value, signed(seq=7).value
    assert select_best(KEY, [v5, v9, v7]) == 1
    expired_high = signed(seq=99, ttl=1, now=time.time() - 30).value
    assert select_best(KEY, [expired_high, v5]) == 1
    assert select_best(KEY, [b"junk", v5]) == 1
    later = signed(seq=5, ttl=300).value
    assert select_best(KEY, [v5, later]) == 1  # same seq: the later expiry wins
    validator = RecordValidator()
    validator.validate(KEY, v9)
    assert validator.select(KEY, [v7, v9]) == 1
    with pytest.raises(RecordError):
        validator.validate(KEY, expired_high)


ORIGINAL = signed(ttl=MAX_TTL)


@settings(max_examples=60, deadline=None)
@given(position=st.integers(min_value=0), bit=st.integers(min_value=0, max_value=7))
def test_any_single_bit_flip_is_rejected_or_decodes_to_the_original(position, bit):
    value = bytearray(ORIGINAL.value)
    position %= len(value)
    value[position] ^= 1 << bit
    try:
        record = decode_record(KEY, bytes(value))
    except RecordError:
        return
    assert record == ORIGINAL.record  # only an encoding-level no-op may pass, never a changed field


def test_measured_links_round_trip_in_microseconds_and_malformed_ones_are_refused():
    a, b = (peer_id_of(generate_key_pair()).to_base58() for _ in range(2))
    rec = signed(links=[(a, 0.0213), (b, 0.0000004)]).record
    assert rec.links == tuple(sorted([(a, 0.0213), (b, 0.000001)]))  # whole microseconds, at least one
    assert signed().record.links == ()
    body = body_of(signed().value)
    me = peer_id_of(KP).to_base58()
    for bad in ({"not-a-peer-id": 100}, {a: 0}, {a: -5}, {a: 61_000_000}, {a: 1.5}, {a: True}, {me: 100},
                {peer_id_of(generate_key_pair()).to_base58(): 100 for _ in range(17)}, [a, 100]):
        with pytest.raises(RecordError, match="links"):
            decode_record(KEY, resign(dict(body, links=bad)))
    old = {k: v for k, v in body.items() if k != "links"}
    with pytest.raises(RecordError, match="fields"):  # a schema-2 record (no links) is refused with its fields named
        decode_record(KEY, resign(dict(old, schema="sangama/serving/2")))
