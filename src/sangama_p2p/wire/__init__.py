"""Wire format: bytes only (framing, messages, tensor codec, protocol ids). No torch, no trio, no libp2p.

Sending: ``await stream.write(encode_message_frame(msg))``. Receiving on a long-lived stream:
``reader = FrameReader(read)`` then ``decode(await reader.next_frame())``. See docs/protocol.md.
"""

from sangama_p2p.wire.codec import decode, encode, encode_message_frame
from sangama_p2p.wire.framing import (
    DEFAULT_MAX_FRAME,
    FrameDecoder,
    FrameReader,
    encode_frame,
    read_exactly,
    read_frame,
)
from sangama_p2p.wire.messages import (
    CloseSession,
    ErrorMessage,
    InfoRequest,
    InfoResponse,
    LaneOffer,
    Message,
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
    TokenLogprobs,
    TraceStamp,
)
from sangama_p2p.wire.protocols import INFO_PROTOCOL, LANE_PROTOCOL, STAGE_PROTOCOL, WIRE_VERSION
from sangama_p2p.wire.tensor import DTYPE_SIZES, Tensor

__all__ = [
    "DEFAULT_MAX_FRAME",
    "DTYPE_SIZES",
    "INFO_PROTOCOL",
    "LANE_PROTOCOL",
    "STAGE_PROTOCOL",
    "WIRE_VERSION",
    "CloseSession",
    "ErrorMessage",
    "FrameDecoder",
    "FrameReader",
    "InfoRequest",
    "InfoResponse",
    "LaneOffer",
    "Message",
    "OpenSession",
    "SessionOpened",
    "Step",
    "StepResult",
    "Tensor",
    "TokenLogprobs",
    "TraceStamp",
    "decode",
    "encode",
    "encode_frame",
    "encode_message_frame",
    "read_exactly",
    "read_frame",
]
