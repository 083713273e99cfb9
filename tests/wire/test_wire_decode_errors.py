"""Hostile payloads: every malformation raises a WireError subclass naming the problem, never anything else."""

from __future__ import annotations

import struct

import msgpack
import pytest

from sangama_p2p.errors import (
    FrameTooLargeError,
    InvalidMessageError,
    MalformedFrameError,
    UnsupportedVersionError,
    WireError,
)
from sangama_p2p.wire import WIRE_VERSION, CloseSession, FrameDecoder, Step, Tensor, TraceStamp, decode, encode

SID = b"S" * 16
STEP_FIELDS = [SID, 1, 0, [], ["bf16", [2, 4]], [7], [["peer", 1, 2, 3, 4, 1]], False]
HIDDEN = bytes(16)


def payload(tag: int, fields: object, blob: bytes = b"", version: int = WIRE_VERSION) -> bytes:
    header = msgpack.packb(fields, use_bin_type=True)
    return struct.pack(">BBI", version, tag, len(header)) + header + blob


def test_hand_built_step_decodes() -> None:
    msg = decode(payload(3, STEP_FIELDS, HIDDEN))
    assert msg == Step(SID, 1, 0, (), Tensor("bf16", (2, 4), HIDDEN), (7,), (TraceStamp("peer", 1, 2, 3, 4, 1),))


@pytest.mark.parametrize("cut", range(len(payload(3, STEP_FIELDS, HIDDEN))))
def test_every_truncation_is_a_wire_error(cut: int) -> None:
    with pytest.raises(WireError):
        decode(payload(3, STEP_FIELDS, HIDDEN)[:cut])


def test_short_prelude_and_cut_header_are_malformed() -> None:
    with pytest.raises(MalformedFrameError, match="prelude"):
        decode(bytes([WIRE_VERSION, 5, 0]))
    good = encode(CloseSession(SID))
    with pytest.raises(MalformedFrameError, match="runs past"):
        decode(good[:-1])


def test_wrong_version() -> None:
    with pytest.raises(UnsupportedVersionError):
        decode(payload(5, [SID], version=WIRE_VERSION + 1))
    with pytest.raises(UnsupportedVersionError):
        decode(payload(5, [SID], version=0))


def test_a_version_1_open_session_is_refused_by_its_version_byte() -> None:
    """Version 1's OpenSession had no prev_hop (12 fields): refused for its version before its arity is looked at."""
    v1 = [SID, "m", 4, 8, None, "client", 64, 0.0, 1.0, 0, 0, False]
    with pytest.raises(UnsupportedVersionError, match="version 1"):
        decode(payload(1, v1, version=1))
    with pytest.raises(MalformedFrameError, match="21 fields"):
        decode(payload(1, v1))


def test_a_version_3_open_session_is_refused_by_its_version_byte() -> None:
    """Version 3's OpenSession had no grammar (14 fields): a stage of version 3 would drop the constraint silently,
    so the versions never talk; at version 4 and later the same fields are refused for their arity."""
    v3 = [SID, "m", 4, 8, None, None, "client", 64, 0.0, 1.0, 0, 0, False, None]
    with pytest.raises(UnsupportedVersionError, match="version 3"):
        decode(payload(1, v3, version=3))
    with pytest.raises(MalformedFrameError, match="21 fields"):
        decode(payload(1, v3))


def test_a_version_4_open_session_is_refused_by_its_version_byte() -> None:
    """Version 4's OpenSession had no fingerprint (16 fields): its stage would not check the checkpoint."""
    v4 = [SID, "m", 4, 8, None, None, "client", 64, 0.0, 1.0, 0, 0, False, None, None, 0]
    with pytest.raises(UnsupportedVersionError, match="version 4"):
        decode(payload(1, v4, version=4))
    with pytest.raises(MalformedFrameError, match="21 fields"):
        decode(payload(1, v4))


def test_a_version_5_step_is_refused_by_its_version_byte() -> None:
    """Version 5's Step had no ring flag (7 fields), its OpenSession no ring (17): a stage of version 5 would answer
    the client where the ring hands the trip on, so the versions never talk."""
    v5 = STEP_FIELDS[:7]
    with pytest.raises(UnsupportedVersionError, match="version 5"):
        decode(payload(3, v5, HIDDEN, version=5))
    with pytest.raises(MalformedFrameError, match="8 fields"):
        decode(payload(3, v5, HIDDEN))


def test_a_version_2_step_result_is_refused_by_its_version_byte() -> None:
    """Version 2's StepResult had no logprobs (5 fields): refused for its version, and for its arity at version 3."""
    v2 = [SID, 1, [7], [], []]
    with pytest.raises(UnsupportedVersionError, match="version 2"):
        decode(payload(4, v2, version=2))
    with pytest.raises(MalformedFrameError, match="6 fields"):
        decode(payload(4, v2))


@pytest.mark.parametrize("tag", [0, 7, 15, 19, 255])
def test_unknown_tag(tag: int) -> None:
    with pytest.raises(MalformedFrameError, match="unknown message type"):
        decode(payload(tag, [SID]))


def test_trailing_bytes() -> None:
    with pytest.raises(MalformedFrameError, match="trailing"):
        decode(encode(CloseSession(SID)) + b"\x00")
    with pytest.raises(MalformedFrameError, match="trailing"):
        decode(payload(3, [*STEP_FIELDS[:4], None, *STEP_FIELDS[5:]], b"x"))
    with pytest.raises(InvalidMessageError, match="needs 16 bytes"):
        decode(payload(3, STEP_FIELDS, HIDDEN + b"x"))


def test_extra_msgpack_inside_the_header_is_malformed() -> None:
    header = msgpack.packb([SID]) + msgpack.packb(1)
    with pytest.raises(MalformedFrameError):
        decode(struct.pack(">BBI", WIRE_VERSION, 5, len(header)) + header)


@pytest.mark.parametrize(
    ("index", "value"),
    [
        (4, ["int8", [2, 4]]),  # wrong dtype
        (4, ["bf16", [2, 5]]),  # shape disagrees with the data
        (4, ["bf16", [32]]),  # wrong length
        (4, ["bf16", []]),  # rank 0
        (4, ["bf16", [1, 1, 1, 2, 4]]),  # rank 5
        (4, ["bf16"]),  # descriptor arity
        (4, "bf16"),
        (0, "S" * 16),  # session id as str
        (0, b"S" * 17),
        (1, 1.0),  # step as float
        (1, -1),
        (2, True),
        (3, {"a": 1}),  # token ids as a map
        (3, [1, "2"]),
        (5, [2**31]),
        (6, [["peer", 1, 2, 3]]),  # trace stamp arity
        (6, "trace"),
        (6, [[b"peer", 1, 2, 3, 4, 1]]),
    ],
)
def test_wrong_field_values_are_invalid(index: int, value: object) -> None:
    fields = list(STEP_FIELDS)
    fields[index] = value
    with pytest.raises(InvalidMessageError):
        decode(payload(3, fields, HIDDEN))


@pytest.mark.parametrize(
    "header",
    [
        msgpack.packb({"session_id": SID}),  # a map instead of an array
        msgpack.packb([SID, 1]),  # wrong arity
        msgpack.packb([]),
        msgpack.packb(SID),
        b"\xc1",  # never-used msgpack byte
        b"\xdd\xff\xff\xff\xff",  # array claiming 4 billion items
        b"\x91\xd9\x02\xff\xfe",  # invalid UTF-8 string
        msgpack.packb([msgpack.ExtType(5, b"x")]),
    ],
)
def test_garbage_headers_are_wire_errors(header: bytes) -> None:
    with pytest.raises(WireError) as info:
        decode(struct.pack(">BBI", WIRE_VERSION, 5, len(header)) + header)
    assert isinstance(info.value, (MalformedFrameError, InvalidMessageError))


def test_deeply_nested_header_is_a_wire_error() -> None:
    header = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(MalformedFrameError):
        decode(struct.pack(">BBI", WIRE_VERSION, 5, len(header)) + header)


def test_oversized_frame_is_refused_by_the_decoder() -> None:
    dec = FrameDecoder(max_frame=1024)
    with pytest.raises(FrameTooLargeError):
        dec.feed(struct.pack(">I", 1025) + b"x" * 100)


def test_huge_tensor_descriptor_is_refused() -> None:
    fields = list(STEP_FIELDS)
    fields[4] = ["fp32", [2**24, 2**24]]
    with pytest.raises(InvalidMessageError):
        decode(payload(3, fields, HIDDEN))


def test_invalid_message_names_its_session_when_it_can() -> None:
    fields = list(STEP_FIELDS)
    fields[5] = [2**31]  # a bad guess: the session and step are still known
    with pytest.raises(InvalidMessageError) as info:
        decode(payload(3, fields, HIDDEN))
    assert info.value.session_id == SID and info.value.step == 1
    fields[0] = b"short"
    with pytest.raises(InvalidMessageError) as info:
        decode(payload(3, fields, HIDDEN))
    assert info.value.session_id is None and info.value.step is None
    with pytest.raises(InvalidMessageError) as info:
        decode(payload(2, [SID, -1]))  # SessionOpened has no step
    assert info.value.session_id == SID and info.value.step is None
    with pytest.raises(InvalidMessageError) as info:
        decode(payload(17, ["p", "m", 0, 0, 1.0, 0, 0, "v"]))  # not session-scoped
    assert info.value.session_id is None
