"""Message <-> frame payload.

Payload layout (all integers big-endian)::

    offset  size  field
    0       1     wire version (WIRE_VERSION)
    1       1     message type tag (Message.TAG)
    2       4     header length H
    6       H     msgpack array: the message's fields in declaration order
    6+H     ...   raw tensor bytes (only a Step with ``hidden``); nothing else may follow the header

Why a fixed prelude: version and type are checked before msgpack runs, and the tensor bytes stay outside msgpack,
so encoding copies them once (into the output) and decoding once (out of the payload).

``decode`` raises only :class:`~sangama_p2p.errors.WireError` subclasses, whatever the bytes.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Callable
from typing import Any, Final

import msgpack

from sangama_p2p.errors import InvalidMessageError, MalformedFrameError, UnsupportedVersionError, translate
from sangama_p2p.wire.framing import DEFAULT_MAX_FRAME, encode_frame
from sangama_p2p.wire.limits import MAX_U64, SESSION_ID_BYTES
from sangama_p2p.wire.messages import MESSAGE_TYPES, Message, Step, StepResult, TokenLogprobs, TraceStamp
from sangama_p2p.wire.protocols import WIRE_VERSION
from sangama_p2p.wire.tensor import Tensor

__all__ = ["PRELUDE_SIZE", "decode", "encode", "encode_message_frame"]

_PRELUDE: Final = struct.Struct(">BBI")
PRELUDE_SIZE: Final = _PRELUDE.size
_TRACE_ARITY: Final = len(dataclasses.fields(TraceStamp))
_EMPTY: Final = b""

Header = tuple[Any, ...]
Blob = memoryview


def _trace_out(trace: tuple[TraceStamp, ...]) -> tuple[tuple[Any, ...], ...]:
    return tuple((s.peer, s.recv_ns, s.compute_start_ns, s.compute_end_ns, s.send_ns, s.batch_size) for s in trace)


def _trace_in(items: object) -> tuple[TraceStamp, ...]:
    if type(items) is not tuple:
        raise InvalidMessageError(f"trace must be an array, got {type(items).__name__}")
    stamps = []
    for item in items:
        if type(item) is not tuple or len(item) != _TRACE_ARITY:
            raise InvalidMessageError(f"trace stamp must be an array of {_TRACE_ARITY} fields")
        stamps.append(TraceStamp(*item))
    return tuple(stamps)


def _no_blob(blob: Blob) -> None:
    if blob.nbytes:
        raise MalformedFrameError(f"{blob.nbytes} trailing bytes after the message header")


def _step_out(m: Step) -> tuple[Header, bytes | memoryview]:
    h = m.hidden
    desc, blob = (None, _EMPTY) if h is None else ((h.dtype, h.shape), h.data)
    return (m.session_id, m.step, m.start_pos, m.token_ids, desc, m.guesses, _trace_out(m.trace), m.ring), blob


def _step_in(f: Header, blob: Blob) -> Step:
    desc = f[4]
    if desc is None:
        _no_blob(blob)
        hidden = None
    elif type(desc) is tuple and len(desc) == 2:
        hidden = Tensor(desc[0], desc[1], bytes(blob))
    else:
        raise InvalidMessageError("hidden must be nil or an array [dtype, shape]")
    return Step(f[0], f[1], f[2], f[3], hidden, f[5], _trace_in(f[6]), f[7])


def _result_out(m: StepResult) -> tuple[Header, bytes]:
    scores = tuple((s.logprob, s.top_ids, s.top_logprobs) for s in m.logprobs)
    return (m.session_id, m.step, m.tokens, m.guesses, _trace_out(m.trace), scores), _EMPTY


def _logprobs_in(items: object) -> tuple[TokenLogprobs, ...]:
    if type(items) is not tuple:
        raise InvalidMessageError(f"logprobs must be an array, got {type(items).__name__}")
    out = []
    for item in items:
        if type(item) is not tuple or len(item) != 3:
            raise InvalidMessageError("a token's logprobs must be an array [logprob, top_ids, top_logprobs]")
        out.append(TokenLogprobs(*item))
    return tuple(out)


def _result_in(f: Header, blob: Blob) -> StepResult:
    _no_blob(blob)
    return StepResult(f[0], f[1], f[2], f[3], _trace_in(f[4]), _logprobs_in(f[5]))


def _plain_out(names: tuple[str, ...]) -> Callable[[Any], tuple[Header, bytes]]:
    def out(m: Any) -> tuple[Header, bytes]:
        return tuple([getattr(m, n) for n in names]), _EMPTY

    return out


def _plain_in(cls: type[Message]) -> Callable[[Header, Blob], Message]:
    def into(f: Header, blob: Blob) -> Message:
        _no_blob(blob)
        return cls(*f)

    return into


@dataclasses.dataclass(frozen=True, slots=True)
class _Codec:
    cls: type[Any]
    names: tuple[str, ...]
    out: Callable[[Any], tuple[Header, bytes | memoryview]]
    into: Callable[[Header, Blob], Message]


def _codec(cls: type[Any]) -> _Codec:
    names = tuple(f.name for f in dataclasses.fields(cls))
    if cls is Step:
        return _Codec(cls, names, _step_out, _step_in)
    if cls is StepResult:
        return _Codec(cls, names, _result_out, _result_in)
    return _Codec(cls, names, _plain_out(names), _plain_in(cls))


_BY_TYPE: Final = {cls: _codec(cls) for cls in MESSAGE_TYPES}
_BY_TAG: Final = {cls.TAG: _BY_TYPE[cls] for cls in MESSAGE_TYPES}


def _parts(msg: Message) -> tuple[bytes, bytes, bytes | memoryview]:
    codec = _BY_TYPE.get(type(msg))
    if codec is None:
        raise InvalidMessageError(f"{type(msg).__name__} is not a wire message")
    fields, blob = codec.out(msg)
    header = msgpack.packb(fields, use_bin_type=True)
    return _PRELUDE.pack(WIRE_VERSION, msg.TAG, len(header)), header, blob


def encode(msg: Message) -> bytes:
    """The frame payload for ``msg`` (without the length prefix)."""
    return b"".join(_parts(msg))


def encode_message_frame(msg: Message, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Length prefix + payload in one buffer: the tensor bytes are copied once, straight into it."""
    return encode_frame(*_parts(msg), max_frame=max_frame)


def decode(payload: bytes | bytearray | memoryview) -> Message:
    """Parse and validate one frame payload; raise a WireError subclass for anything a peer got wrong."""
    view = memoryview(payload)
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    size = view.nbytes
    if size < PRELUDE_SIZE:
        raise MalformedFrameError(f"payload of {size} bytes is shorter than the {PRELUDE_SIZE}-byte prelude")
    version, tag, header_len = _PRELUDE.unpack_from(view)
    if version != WIRE_VERSION:
        raise UnsupportedVersionError(f"wire version {version} is not supported (this peer speaks {WIRE_VERSION})")
    codec = _BY_TAG.get(tag)
    if codec is None:
        raise MalformedFrameError(f"unknown message type tag {tag}")
    header_end = PRELUDE_SIZE + header_len
    if header_end > size:
        raise MalformedFrameError(f"header of {header_len} bytes runs past the {size}-byte payload")
    try:
        fields = msgpack.unpackb(view[PRELUDE_SIZE:header_end], use_list=False, raw=False)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise translate(exc, MalformedFrameError, f"bad msgpack header for {codec.cls.__name__}")
    if type(fields) is not tuple or len(fields) != len(codec.names):
        raise MalformedFrameError(f"{codec.cls.__name__} header must be an array of {len(codec.names)} fields")
    try:
        return codec.into(fields, view[header_end:])
    except InvalidMessageError as exc:
        _blame(exc, codec.names, fields)
        raise


def _blame(exc: InvalidMessageError, names: tuple[str, ...], fields: Header) -> None:
    """Record the session (and step) of an invalid message when they themselves are valid."""
    if names[:1] != ("session_id",):
        return
    sid = fields[0]
    if type(sid) is bytes and len(sid) == SESSION_ID_BYTES:
        exc.session_id = sid
        step = fields[1] if names[1:2] == ("step",) else None
        if type(step) is int and 0 <= step < MAX_U64:
            exc.step = step
