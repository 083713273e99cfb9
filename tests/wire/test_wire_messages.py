"""Messages: round trips of every type, pinned tags and layout, field validation on construction."""

from __future__ import annotations

import array
import dataclasses
import math
import struct

import msgpack
import pytest

from sangama_p2p.errors import ErrorCode, InvalidMessageError
from sangama_p2p.wire import (
    INFO_PROTOCOL,
    LANE_PROTOCOL,
    STAGE_PROTOCOL,
    WIRE_VERSION,
    CloseSession,
    ErrorMessage,
    InfoRequest,
    InfoResponse,
    LaneOffer,
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
    Tensor,
    TraceStamp,
    decode,
    encode,
    encode_message_frame,
)
from sangama_p2p.wire.messages import MESSAGE_TYPES

SID = bytes(range(16))
TRACE = (
    TraceStamp("12D3KooWA", 10, 20, 30, 40, 1),
    TraceStamp("12D3KooWB", 2**63, 2**63 + 5, 2**64 - 2, 2**64 - 1, 8),
)
HIDDEN = Tensor("bf16", (1, 4096), bytes(range(256)) * 32)

SAMPLES = [
    OpenSession(SID, "Qwen/Qwen3.5-35B-A3B", 0, 20, "12D3KooWNext", None, "client-1", 4096, 0.7, 0.95, 2**64 - 1, 4,
                True),
    OpenSession(SID, "m", 20, 40, None, "12D3KooWPrev", "c", 1, 0.0, 1.0, 0, 0, False),
    SessionOpened(SID, 7),
    Step(SID, 0, 0, (151643, 9707, 0, 2**31 - 1), None, (), ()),
    Step(SID, 3, 17, (), HIDDEN, (1, 2, 3), TRACE),
    Step(SID, 4, 18, (), Tensor("fp16", (2, 3), bytes(12)), (5,), TRACE[:1]),
    Step(SID, 5, 19, (), Tensor("fp32", (1, 2, 3, 1), bytes(24)), (), ()),
    StepResult(SID, 3, (11, 12), (13, 14, 15), TRACE),
    StepResult(SID, 0, (), (), ()),
    CloseSession(SID),
    ErrorMessage(SID, 3, ErrorCode.BAD_POSITION, "start 9 is ahead of cache position 4"),
    ErrorMessage(None, None, ErrorCode.OVERLOADED, ""),
    InfoRequest(),
    InfoResponse("12D3KooWA", "Qwen/Qwen3.5-35B-A3B", 0, 20, 41.5, 3, 2, "0.1.0"),
    LaneOffer(65535, bytes(range(16)), bytes(range(32))),
    OpenSession(SID, "m", 20, 40, None, "12D3KooWPrev", "c", 9, 0.0, 1.0, 0, 2, False, ring="12D3KooWFirst",
                ring_until=9, ring_stop=(2, 151645), windows=2),
    Step(SID, 6, 20, (7, 8), None, (8,), (), ring=True),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: object) -> None:
    payload = encode(msg)  # type: ignore[arg-type]
    back = decode(payload)
    assert back == msg
    assert type(back) is type(msg)
    assert decode(bytearray(payload)) == msg
    assert decode(memoryview(payload)) == msg
    assert encode_message_frame(msg)[4:] == payload  # type: ignore[arg-type]
    assert struct.unpack(">I", encode_message_frame(msg)[:4])[0] == len(payload)  # type: ignore[arg-type]


def test_the_grammar_bound_is_the_one_the_api_and_the_model_check() -> None:
    from sangama_p2p.model.constraint import MAX_GRAMMAR_BYTES as MODEL_BOUND
    from sangama_p2p.wire.limits import MAX_GRAMMAR_BYTES

    assert MODEL_BOUND == MAX_GRAMMAR_BYTES


def test_a_constrained_open_session_round_trips() -> None:
    msg = OpenSession(SID, "m", 20, 40, None, None, "c", 64, 0.0, 1.0, 0, 0, False, None, '{"grammars": []}', 17)
    assert decode(encode(msg)) == msg


def test_an_open_session_carries_the_checkpoint_fingerprint_it_was_chosen_for() -> None:
    fp = "0123456789abcdef" * 2
    msg = OpenSession(SID, "m", 0, 4, None, None, "c", 64, 0.0, 1.0, 0, 0, False, None, None, 0, fp)
    assert decode(encode(msg)) == msg and msg.fingerprint == fp
    for bad in ("0123", fp.upper(), fp[:-1] + "g", 7):
        with pytest.raises(InvalidMessageError, match="fingerprint"):
            OpenSession(SID, "m", 0, 4, None, None, "c", 64, 0.0, 1.0, 0, 0, False, None, None, 0, bad)


def test_every_message_type_is_sampled() -> None:
    assert {type(m) for m in SAMPLES} == set(MESSAGE_TYPES)


def test_type_tags_are_pinned() -> None:
    # Renumbering a tag breaks every deployed peer: this test must only change with a protocol version bump.
    tags = {cls.__name__: cls.TAG for cls in MESSAGE_TYPES}
    assert tags == {
        "OpenSession": 1,
        "SessionOpened": 2,
        "Step": 3,
        "StepResult": 4,
        "CloseSession": 5,
        "ErrorMessage": 6,
        "InfoRequest": 16,
        "InfoResponse": 17,
        "LaneOffer": 18,
    }
    assert WIRE_VERSION == 6
    assert (STAGE_PROTOCOL, INFO_PROTOCOL, LANE_PROTOCOL) == ("/sangama/stage/6", "/sangama/info/6", "/sangama/lane/7")


def test_payload_layout_is_pinned() -> None:
    header = msgpack.packb((SID,), use_bin_type=True)
    assert encode(CloseSession(SID)) == bytes([6, 5]) + struct.pack(">I", len(header)) + header
    step = encode(Step(SID, 1, 2, (), Tensor("fp16", (2,), b"\x01\x02\x03\x04"), (), ()))
    assert step.endswith(b"\x01\x02\x03\x04")
    (hlen,) = struct.unpack(">I", step[2:6])
    assert msgpack.unpackb(step[6 : 6 + hlen]) == [SID, 1, 2, [], ["fp16", [2]], [], [], False]


def test_info_response_bytes_are_pinned() -> None:
    # Field names never travel: renaming ``throughput_tps`` to ``throughput`` changed no byte (bytes from before it;
    # only the version byte moved, 2 -> 3 -> 4 -> 5 -> 6).
    msg = InfoResponse("12D3KooWA", "m", 0, 20, 41.5, 3, 2, "0.1.0")
    assert encode(msg).hex() == "06110000002098a9313244334b6f6f5741a16d0014cb4044c000000000000302a5302e312e30"
    assert [f.name for f in dataclasses.fields(InfoResponse)] == [
        "peer", "model_id", "start", "end", "throughput", "free_sessions", "queue", "version"]


def test_decoded_fields_have_wire_types() -> None:
    err = decode(encode(ErrorMessage(None, None, 3, "x")))
    assert isinstance(err, ErrorMessage) and err.code is ErrorCode.UNKNOWN_SESSION
    step = decode(encode(SAMPLES[4]))
    assert isinstance(step, Step) and type(step.hidden.data) is bytes  # type: ignore[union-attr]
    assert type(step.token_ids) is tuple and type(step.trace[0]) is TraceStamp


def test_lists_and_ints_are_normalised() -> None:
    msg = Step(SID, 0, 0, [1, 2], None, [3], [])  # type: ignore[arg-type]
    assert msg.token_ids == (1, 2) and msg.guesses == (3,) and msg.trace == ()
    opened = OpenSession(SID, "m", 0, 1, None, None, "c", 8, 1, 1, 0, 0, False)  # type: ignore[arg-type]
    assert type(opened.temperature) is float and type(opened.top_p) is float
    assert hash(msg) == hash(Step(SID, 0, 0, (1, 2), None, (3,), ()))


def test_memoryview_tensor_data_encodes_like_bytes() -> None:
    floats = array.array("f", [1.0, 2.0, 3.0, 4.0])
    by_view = Tensor("fp32", (2, 2), memoryview(floats))
    by_bytes = Tensor("fp32", (2, 2), floats.tobytes())
    assert by_view.nbytes == 16 and by_view.numel == 4 and by_view.itemsize == 4
    a = encode(Step(SID, 0, 0, (), by_view, (), ()))
    assert a == encode(Step(SID, 0, 0, (), by_bytes, (), ()))
    assert decode(a).hidden == by_bytes  # type: ignore[union-attr]


def _replace(msg: object, **changes: object) -> object:
    return dataclasses.replace(msg, **changes)  # type: ignore[type-var]


OPEN, STEP, RESULT, INFO, LANE = SAMPLES[0], SAMPLES[4], SAMPLES[7], SAMPLES[13], SAMPLES[14]
BAD_FIELDS = [
    (OPEN, {"session_id": bytes(15)}),
    (OPEN, {"session_id": "0" * 16}),
    (OPEN, {"model_id": ""}),
    (OPEN, {"model_id": "x" * 257}),
    (OPEN, {"model_id": "\ud800"}),
    (OPEN, {"start": -1}),
    (OPEN, {"end": 0}),
    (OPEN, {"start": True}),
    (OPEN, {"next_hop": 5}),
    (OPEN, {"max_length": 2**31}),
    (OPEN, {"temperature": math.nan}),
    (OPEN, {"temperature": -0.5}),
    (OPEN, {"top_p": 0.0}),
    (OPEN, {"top_p": math.inf}),
    (OPEN, {"seed": 2**64}),
    (OPEN, {"max_guesses": 65}),
    (OPEN, {"adaptive_guesses": 1}),
    (OPEN, {"grammar": "{}"}),  # OPEN drafts 4 guesses: a constrained session drafts none
    (OPEN, {"grammar": "x" * (64 * 1024 + 1), "max_guesses": 0}),
    (OPEN, {"grammar": b"{}", "max_guesses": 0}),
    (OPEN, {"grammar_start": -1}),
    (STEP, {"step": -1}),
    (STEP, {"start_pos": 1.0}),
    (STEP, {"token_ids": (2**31,)}),
    (STEP, {"token_ids": (-1,)}),
    (STEP, {"token_ids": "abc"}),
    (STEP, {"guesses": tuple(range(65))}),
    (STEP, {"hidden": b"raw"}),
    (STEP, {"trace": (("p", 1, 2, 3, 4, 5),)}),
    (STEP, {"trace": (TRACE[0],) * 65}),
    (STEP, {"ring": 1}),
    (OPEN, {"ring": ""}),
    (OPEN, {"ring_until": -1}),
    (OPEN, {"ring_stop": tuple(range(65))}),
    (OPEN, {"ring_stop": (-1,)}),
    (OPEN, {"windows": 0}),
    (OPEN, {"windows": 5}),
    (RESULT, {"tokens": tuple(range(66))}),
    (INFO, {"throughput": -1.0}),
    (INFO, {"version": b"0.1"}),
    (LANE, {"port": 0}),
    (LANE, {"port": 65536}),
    (LANE, {"token": bytes(15)}),
    (LANE, {"token": "t" * 16}),
    (LANE, {"key": bytes(16)}),
]


@pytest.mark.parametrize(("msg", "changes"), BAD_FIELDS, ids=lambda v: repr(v)[:40])
def test_bad_fields_raise_invalid_message(msg: object, changes: dict[str, object]) -> None:
    with pytest.raises(InvalidMessageError):
        _replace(msg, **changes)


@pytest.mark.parametrize(
    ("dtype", "shape", "data"),
    [
        ("int8", (4,), bytes(4)),
        ("bfloat16", (4,), bytes(8)),
        ("bf16", (), b""),
        ("bf16", (1, 1, 1, 1, 1), bytes(2)),
        ("bf16", (4,), bytes(7)),
        ("bf16", (4,), bytes(10)),
        ("fp32", (2**24 + 1,), b""),
        ("fp32", (2**20, 2**8), b""),
        ("fp16", (-1,), b""),
        ("fp16", (2,), [0, 0, 0, 0]),
    ],
)
def test_bad_tensors_raise_invalid_message(dtype: str, shape: tuple[int, ...], data: object) -> None:
    with pytest.raises(InvalidMessageError):
        Tensor(dtype, shape, data)  # type: ignore[arg-type]


def test_bad_trace_stamp_and_error_code() -> None:
    with pytest.raises(InvalidMessageError):
        TraceStamp("p", -1, 0, 0, 0, 1)
    with pytest.raises(InvalidMessageError):
        ErrorMessage(SID, 0, 999, "no such code")  # type: ignore[arg-type]
    with pytest.raises(InvalidMessageError):
        ErrorMessage(SID, 0, ErrorCode.INTERNAL, "x" * 4097)


def test_encoding_a_non_message_is_refused() -> None:
    with pytest.raises(InvalidMessageError):
        encode(TRACE[0])  # type: ignore[arg-type]


def test_step_result_logprobs_round_trip_and_are_checked() -> None:
    from sangama_p2p.wire import TokenLogprobs

    scores = (TokenLogprobs(-0.25, (7, 3), (-0.25, -1.5)), TokenLogprobs(-2.0, (1, 2), (-0.5, -2.0)))
    res = StepResult(SID, 4, (7, 9), (), (), scores)
    back = decode(encode(res))
    assert back == res and back.logprobs[0].top_ids == (7, 3)
    assert decode(encode(StepResult(SID, 4, (7,), (), ()))).logprobs == ()
    with pytest.raises(InvalidMessageError, match="logprobs for 1 tokens"):
        StepResult(SID, 4, (7,), (), (), scores)
    with pytest.raises(InvalidMessageError, match="<= 0"):
        TokenLogprobs(0.5, (), ())
    with pytest.raises(InvalidMessageError, match="top_logprobs for"):
        TokenLogprobs(-1.0, (1, 2), (-1.0,))
    with pytest.raises(InvalidMessageError, match="top_ids"):
        TokenLogprobs(-1.0, tuple(range(21)), (-1.0,) * 21)
    with pytest.raises(InvalidMessageError, match="top_logprobs must lie"):
        OpenSession(SID, "m", 0, 4, None, None, "c", 64, 0.0, 1.0, 0, 0, False, 21)
