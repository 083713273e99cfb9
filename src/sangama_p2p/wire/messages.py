"""The typed messages of ``/sangama/stage/6`` and ``/sangama/info/6`` (and the ``LaneOffer`` of ``/sangama/lane/7``).

Each message is a frozen dataclass with explicit fields and a stable numeric ``TAG`` (the class name never travels).
Constructors validate every field (see :mod:`sangama_p2p.wire.limits`), so a message that exists is one a peer may
send: decoding builds messages through the same constructors. Lists are accepted and frozen into tuples.

Every frame of a session (``Step``, ``StepResult``, ``CloseSession``, ``ErrorMessage``) carries its
``session_id``, so one long-lived stream between two neighbouring peers carries many sessions interleaved.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar, Final, TypeAlias

from sangama_p2p.errors import ErrorCode, InvalidMessageError
from sangama_p2p.wire.limits import (
    MAX_GUESSES,
    MAX_RING_STOP,
    MAX_WINDOWS,
    MAX_TEXT_BYTES,
    MAX_TOKENS,
    MAX_GRAMMAR_BYTES,
    MAX_TOP_LOGPROBS,
    MAX_TRACE,
    MAX_U64,
    check_bool,
    check_bytes,
    check_float,
    check_opt_session_id,
    check_opt_text,
    check_opt_uint,
    check_session_id,
    check_text,
    check_tokens,
    check_tuple_of,
    check_uint,
)
from sangama_p2p.wire.tensor import Tensor

_HEX32: Final = re.compile(r"[0-9a-f]{32}")

__all__ = [
    "CloseSession",
    "ErrorMessage",
    "InfoRequest",
    "InfoResponse",
    "LANE_KEY_BYTES",
    "LANE_TOKEN_BYTES",
    "LaneOffer",
    "Message",
    "OpenSession",
    "SessionOpened",
    "Step",
    "StepResult",
    "TokenLogprobs",
    "TraceStamp",
]


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True, slots=True)
class TraceStamp:
    """One stage's timing for one trip, each on that stage's own monotonic clock (no clock sync needed)."""

    peer: str
    recv_ns: int
    compute_start_ns: int
    compute_end_ns: int
    send_ns: int
    batch_size: int

    def __post_init__(self) -> None:
        check_text("trace peer", self.peer)
        check_uint("trace recv_ns", self.recv_ns, MAX_U64)
        check_uint("trace compute_start_ns", self.compute_start_ns, MAX_U64)
        check_uint("trace compute_end_ns", self.compute_end_ns, MAX_U64)
        check_uint("trace send_ns", self.send_ns, MAX_U64)
        check_uint("trace batch_size", self.batch_size)


@dataclass(frozen=True, slots=True)
class OpenSession:
    """Client -> stage: reserve state for a session on layers ``[start, end)``."""

    TAG: ClassVar[int] = 1
    session_id: bytes
    model_id: str
    start: int
    end: int
    next_hop: str | None  # peer id of the next stage; None = the last stage, reply to the client
    prev_hop: str | None  # peer id of the stage that feeds this one; None = only the client steps it (first stage)
    client_id: str
    max_length: int
    temperature: float
    top_p: float
    seed: int
    max_guesses: int
    adaptive_guesses: bool
    top_logprobs: int | None = None  # None: no log-probabilities; n: each token's and its n best alternatives'
    # the last stage samples only tokens this grammar allows (llguidance's JSON form), from position grammar_start
    # (the prompt's length) on; None: no constraint. A constrained session drafts no guesses.
    grammar: str | None = None
    grammar_start: int = 0
    # the checkpoint fingerprint the client chose this chain for (32 lowercase hex digits): a stage of another
    # checkpoint refuses with WRONG_MODEL (a record that lies or went stale); None: not checked
    fingerprint: str | None = None
    # the ring (wire version 6): on the first stage, the last stage, which may step the session too; on the last
    # stage, the first stage, to which it hands each next trip of a Step marked ``ring`` itself (a one-stage chain
    # names itself). None: every trip comes from the client.
    ring: str | None = None
    # the last stage hands a trip on only while the new token's position + 1 < ring_until (the prompt's length +
    # the most new tokens) and no token of the answer is in ring_stop (the request's stop tokens)
    ring_until: int = 0
    ring_stop: tuple[int, ...] = ()
    # guess windows a ring may have in flight at once (the last stage drafts one past the next while it is on its
    # way, greedy and fixed guesses only); every stage keeps rollback snapshots for all of them
    windows: int = 1

    def __post_init__(self) -> None:
        check_session_id("session_id", self.session_id)
        check_text("model_id", self.model_id)
        check_uint("start", self.start)
        check_uint("end", self.end)
        if self.end <= self.start:
            raise InvalidMessageError(f"layer range [{self.start}, {self.end}) is empty")
        check_opt_text("next_hop", self.next_hop)
        check_opt_text("prev_hop", self.prev_hop)
        check_text("client_id", self.client_id)
        check_uint("max_length", self.max_length)
        _set(self, "temperature", check_float("temperature", self.temperature))
        if self.temperature < 0.0:
            raise InvalidMessageError(f"temperature must be >= 0, got {self.temperature}")
        _set(self, "top_p", check_float("top_p", self.top_p))
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidMessageError(f"top_p must lie in (0, 1], got {self.top_p}")
        check_uint("seed", self.seed, MAX_U64)
        check_uint("max_guesses", self.max_guesses, MAX_GUESSES + 1)
        check_bool("adaptive_guesses", self.adaptive_guesses)
        check_opt_uint("top_logprobs", self.top_logprobs, MAX_TOP_LOGPROBS + 1)
        check_opt_text("grammar", self.grammar, MAX_GRAMMAR_BYTES)
        check_uint("grammar_start", self.grammar_start)
        check_opt_text("fingerprint", self.fingerprint, 32)
        if self.fingerprint is not None and not _HEX32.fullmatch(self.fingerprint):
            raise InvalidMessageError(f"fingerprint must be 32 lowercase hex digits, got {self.fingerprint!r}")
        if self.grammar is not None and self.max_guesses:
            raise InvalidMessageError("a session held to a grammar drafts no guesses (max_guesses must be 0)")
        check_opt_text("ring", self.ring)
        check_uint("ring_until", self.ring_until)
        _set(self, "ring_stop", check_tokens("ring_stop", self.ring_stop, MAX_RING_STOP))
        check_uint("windows", self.windows, MAX_WINDOWS + 1)
        if self.windows < 1:
            raise InvalidMessageError("windows must be 1 or more")


@dataclass(frozen=True, slots=True)
class SessionOpened:
    """Stage -> client: the session is open; ``free_sessions`` is what the stage can still take."""

    TAG: ClassVar[int] = 2
    session_id: bytes
    free_sessions: int

    def __post_init__(self) -> None:
        check_session_id("session_id", self.session_id)
        check_uint("free_sessions", self.free_sessions)


@dataclass(frozen=True, slots=True)
class Step:
    """One trip's input for a stage: positions ``start_pos ..`` of a session.

    The first stage gets ``token_ids`` and no ``hidden``; later stages get ``hidden`` (e.g. bf16 ``[T, D]``). A
    ``start_pos`` behind the stage's cache rolls it back. ``guesses`` are the drafted tokens this trip checks.
    """

    TAG: ClassVar[int] = 3
    session_id: bytes
    step: int  # per-session sequence number
    start_pos: int
    token_ids: tuple[int, ...]
    hidden: Tensor | None
    guesses: tuple[int, ...]
    trace: tuple[TraceStamp, ...]
    # the last stage hands the next trip on to the first stage itself (OpenSession.ring), and the first stage
    # echoes it (no hidden states) to the session's owner
    ring: bool = False

    def __post_init__(self) -> None:
        check_session_id("session_id", self.session_id)
        check_uint("step", self.step, MAX_U64)
        check_uint("start_pos", self.start_pos)
        _set(self, "token_ids", check_tokens("token_ids", self.token_ids, MAX_TOKENS))
        if self.hidden is not None and type(self.hidden) is not Tensor:
            raise InvalidMessageError(f"hidden must be a Tensor or None, got {type(self.hidden).__name__}")
        _set(self, "guesses", check_tokens("guesses", self.guesses, MAX_GUESSES))
        _set(self, "trace", check_tuple_of("trace", self.trace, TraceStamp, MAX_TRACE))
        check_bool("ring", self.ring)


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """One returned token's natural-log probability under the model (float32 log-softmax of the logits it was
    chosen from, before temperature and top-p), and the ``top_ids`` with the highest ones, best first."""

    logprob: float
    top_ids: tuple[int, ...]
    top_logprobs: tuple[float, ...]

    def __post_init__(self) -> None:
        _set(self, "logprob", check_float("logprob", self.logprob))
        _set(self, "top_ids", check_tokens("top_ids", self.top_ids, MAX_TOP_LOGPROBS))
        if type(self.top_logprobs) not in (tuple, list):
            raise InvalidMessageError(f"top_logprobs must be a tuple, got {type(self.top_logprobs).__name__}")
        tops = tuple(check_float("top_logprobs", v) for v in self.top_logprobs)
        if len(tops) != len(self.top_ids):
            raise InvalidMessageError(f"{len(tops)} top_logprobs for {len(self.top_ids)} top_ids")
        if max((self.logprob, *tops)) > 0.0:
            raise InvalidMessageError(f"log-probabilities must be <= 0, got {max((self.logprob, *tops))}")
        _set(self, "top_logprobs", tops)


@dataclass(frozen=True, slots=True)
class StepResult:
    """Last stage -> client: ``tokens`` = accepted guesses + one new token; ``guesses`` = next drafts;
    ``logprobs``: one per token when the session asked for them (``OpenSession.top_logprobs``), else empty."""

    TAG: ClassVar[int] = 4
    session_id: bytes
    step: int
    tokens: tuple[int, ...]
    guesses: tuple[int, ...]
    trace: tuple[TraceStamp, ...]
    logprobs: tuple[TokenLogprobs, ...] = ()

    def __post_init__(self) -> None:
        check_session_id("session_id", self.session_id)
        check_uint("step", self.step, MAX_U64)
        _set(self, "tokens", check_tokens("tokens", self.tokens, MAX_GUESSES + 1))
        _set(self, "guesses", check_tokens("guesses", self.guesses, MAX_GUESSES))
        _set(self, "trace", check_tuple_of("trace", self.trace, TraceStamp, MAX_TRACE))
        _set(self, "logprobs", check_tuple_of("logprobs", self.logprobs, TokenLogprobs, MAX_GUESSES + 1))
        if self.logprobs and len(self.logprobs) != len(self.tokens):
            raise InvalidMessageError(f"{len(self.logprobs)} logprobs for {len(self.tokens)} tokens")


@dataclass(frozen=True, slots=True)
class CloseSession:
    """Client -> each stage of the chain (the client sends it to every stage itself; stages do not forward it): free
    the session's state."""

    TAG: ClassVar[int] = 5
    session_id: bytes

    def __post_init__(self) -> None:
        check_session_id("session_id", self.session_id)


@dataclass(frozen=True, slots=True)
class ErrorMessage:
    """A refused or failed request. ``session_id``/``step`` are None when the error is about the stream itself."""

    TAG: ClassVar[int] = 6
    session_id: bytes | None
    step: int | None
    code: ErrorCode
    message: str

    def __post_init__(self) -> None:
        check_opt_session_id("session_id", self.session_id)
        check_opt_uint("step", self.step, MAX_U64)
        code = self.code
        if type(code) is not int and type(code) is not ErrorCode:
            raise InvalidMessageError(f"code must be an int, got {type(code).__name__}")
        try:
            _set(self, "code", ErrorCode(code))
        except ValueError as exc:
            raise InvalidMessageError(f"unknown error code {code}") from exc
        check_text("message", self.message, MAX_TEXT_BYTES, empty=True)


@dataclass(frozen=True, slots=True)
class InfoRequest:
    """Ask a peer what it serves (``/sangama/info/2``)."""

    TAG: ClassVar[int] = 16


@dataclass(frozen=True, slots=True)
class InfoResponse:
    """A peer's served range, measured throughput and load, straight from the peer (fresher than the DHT).

    ``throughput``: steps per second one session gets at the stage (1 / its smoothed step time; one token per step
    without guesses), see :attr:`sangama_p2p.stage.server.StageServer.throughput`."""

    TAG: ClassVar[int] = 17
    peer: str
    model_id: str
    start: int
    end: int
    throughput: float
    free_sessions: int
    queue: int
    version: str

    def __post_init__(self) -> None:
        check_text("peer", self.peer)
        check_text("model_id", self.model_id)
        check_uint("start", self.start)
        check_uint("end", self.end)
        if self.end <= self.start:
            raise InvalidMessageError(f"layer range [{self.start}, {self.end}) is empty")
        _set(self, "throughput", check_float("throughput", self.throughput))
        if self.throughput < 0.0:
            raise InvalidMessageError(f"throughput must be >= 0, got {self.throughput}")
        check_uint("free_sessions", self.free_sessions)
        check_uint("queue", self.queue)
        check_text("version", self.version)


LANE_TOKEN_BYTES: Final = 16
LANE_KEY_BYTES: Final = 32


@dataclass(frozen=True, slots=True)
class LaneOffer:
    """Stage -> upstream peer on ``/sangama/lane/3``: dial ``port`` (at the address this libp2p connection came
    from) for a direct lane, present ``token`` and encrypt every record with ``key`` (AES-256-GCM). The offer
    travels inside the Noise-encrypted stream to the authenticated peer, so only that peer can use it; it is
    single-use and short-lived (see :mod:`sangama_p2p.net.lane`)."""

    TAG: ClassVar[int] = 18
    port: int
    token: bytes
    key: bytes

    def __post_init__(self) -> None:
        check_uint("port", self.port, 65536)
        if self.port == 0:
            raise InvalidMessageError("port must be in 1..65535")
        check_bytes("token", self.token, LANE_TOKEN_BYTES)
        check_bytes("key", self.key, LANE_KEY_BYTES)

Message: TypeAlias = (
    OpenSession | SessionOpened | Step | StepResult | CloseSession | ErrorMessage | InfoRequest | InfoResponse
    | LaneOffer
)
"""Every message that travels as a frame payload."""

MESSAGE_TYPES: tuple[type[Message], ...] = (
    OpenSession,
    SessionOpened,
    Step,
    StepResult,
    CloseSession,
    ErrorMessage,
    InfoRequest,
    InfoResponse,
    LaneOffer,
)
