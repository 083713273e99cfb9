"""Property tests: valid messages round-trip; random and mutated bytes raise only WireError."""

from __future__ import annotations

import contextlib
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sangama_p2p.errors import ErrorCode, WireError
from sangama_p2p.wire import (
    WIRE_VERSION,
    CloseSession,
    ErrorMessage,
    FrameDecoder,
    InfoRequest,
    InfoResponse,
    LaneOffer,
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
    Tensor,
    TokenLogprobs,
    TraceStamp,
    decode,
    encode,
    encode_frame,
)
from sangama_p2p.wire.tensor import DTYPE_SIZES
from sangama_p2p.wire.limits import MAX_GUESSES

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

sids = st.binary(min_size=16, max_size=16)
idx = st.integers(0, 2**31 - 1)
u64 = st.integers(0, 2**64 - 1)
tokens = st.integers(0, 2**31 - 1)
ids = st.text(min_size=1, max_size=40)
finite = st.floats(allow_nan=False, allow_infinity=False)
stamps = st.builds(TraceStamp, ids, u64, u64, u64, u64, idx)
traces = st.lists(stamps, max_size=4).map(tuple)
guesses = st.lists(tokens, max_size=8).map(tuple)


@st.composite
def tensors(draw: st.DrawFn) -> Tensor:
    dtype = draw(st.sampled_from(sorted(DTYPE_SIZES)))
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    data = draw(st.binary(min_size=math.prod(shape) * DTYPE_SIZES[dtype], max_size=math.prod(shape) * 4))
    return Tensor(dtype, shape, data[: math.prod(shape) * DTYPE_SIZES[dtype]])


@st.composite
def open_sessions(draw: st.DrawFn) -> OpenSession:
    start = draw(st.integers(0, 1000))
    return OpenSession(
        draw(sids), draw(ids), start, draw(st.integers(start + 1, 2000)), draw(st.none() | ids), draw(st.none() | ids),
        draw(ids),
        draw(idx), draw(st.floats(0, 10)), draw(st.floats(0.01, 1.0)), draw(u64), draw(st.integers(0, MAX_GUESSES)),
        draw(st.booleans()), draw(st.none() | st.integers(0, 20)),
    )  # fmt: skip


@st.composite
def step_results(draw: st.DrawFn) -> StepResult:
    toks = draw(st.lists(tokens, min_size=1, max_size=MAX_GUESSES + 1).map(tuple))
    lp = st.floats(-1e4, 0.0)
    top = draw(st.integers(0, 20))
    score = st.builds(TokenLogprobs, lp, st.lists(tokens, min_size=top, max_size=top).map(tuple),
                      st.lists(lp, min_size=top, max_size=top).map(tuple))
    scores = draw(st.just(()) | st.lists(score, min_size=len(toks), max_size=len(toks)).map(tuple))
    return StepResult(draw(sids), draw(u64), toks, draw(guesses), draw(traces), scores)


@st.composite
def infos(draw: st.DrawFn) -> InfoResponse:
    start = draw(st.integers(0, 1000))
    end = draw(st.integers(start + 1, 2000))
    tps = draw(st.floats(0, 1e6))
    return InfoResponse(draw(ids), draw(ids), start, end, tps, draw(idx), draw(idx), draw(ids))


messages = st.one_of(
    open_sessions(),
    st.builds(SessionOpened, sids, idx),
    st.builds(Step, sids, u64, idx, st.lists(tokens, max_size=32).map(tuple), st.none() | tensors(), guesses, traces),
    st.builds(StepResult, sids, u64, guesses, guesses, traces),
    step_results(),
    st.builds(CloseSession, sids),
    st.builds(ErrorMessage, st.none() | sids, st.none() | u64, st.sampled_from(list(ErrorCode)), st.text(max_size=60)),
    st.just(InfoRequest()),
    infos(),
    st.builds(LaneOffer, st.integers(1, 65535), st.binary(min_size=16, max_size=16), st.binary(min_size=32, max_size=32)),
)


def _decode_or_wire_error(data: bytes) -> None:
    with contextlib.suppress(WireError):
        decode(data)


@FUZZ
@given(messages)
def test_valid_messages_round_trip(msg: object) -> None:
    assert decode(encode(msg)) == msg  # type: ignore[arg-type]


@FUZZ
@given(st.binary(max_size=200))
def test_random_bytes_raise_only_wire_errors(data: bytes) -> None:
    _decode_or_wire_error(data)
    _decode_or_wire_error(bytes([WIRE_VERSION]) + data)  # right version, random rest
    _decode_or_wire_error(bytes([WIRE_VERSION, 3]) + data)  # a Step tag, random rest


@FUZZ
@given(messages, st.data())
def test_mutated_frames_raise_only_wire_errors(msg: object, data: st.DataObject) -> None:
    buf = bytearray(encode(msg))  # type: ignore[arg-type]
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "truncate"]))
        pos = data.draw(st.integers(0, max(0, len(buf) - 1)))
        if kind == "flip" and buf:
            buf[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "set" and buf:
            buf[pos] = data.draw(st.integers(0, 255))
        elif kind == "insert":
            buf[pos:pos] = data.draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del buf[pos : pos + data.draw(st.integers(1, 4))]
        else:
            del buf[pos:]
    _decode_or_wire_error(bytes(buf))


@FUZZ
@given(st.lists(messages, min_size=1, max_size=5), st.data())
def test_frame_stream_in_random_chunks(msgs: list[object], data: st.DataObject) -> None:
    stream = b"".join(encode_frame(encode(m)) for m in msgs)  # type: ignore[arg-type]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=6)))
    dec = FrameDecoder()
    got = []
    for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
        got.extend(decode(p) for p in dec.feed(stream[a:b]))
    assert got == msgs
    dec.finish()


@FUZZ
@given(st.lists(st.binary(max_size=40), max_size=6))
def test_decoder_on_random_chunks_raises_only_wire_errors(chunks: list[bytes]) -> None:
    dec = FrameDecoder(max_frame=64)
    try:
        for chunk in chunks:
            for frame in dec.feed(chunk):
                _decode_or_wire_error(frame)
        dec.finish()
    except WireError:
        pass
