"""The exception tree of Sangama.

Every error that Sangama raises on purpose derives from :class:`SangamaError`, so an
application can catch one class. Errors that cross the wire carry a numeric ``code``
(see :class:`ErrorCode`), so that nobody matches message strings::

    SangamaError
    +-- ModelError            checkpoints, specs, layer ranges, runtime state
    |   +-- CheckpointError       missing, corrupt or inconsistent weight files
    |   +-- UnsupportedModelError unknown architecture, dtype or quantization type
    |   +-- LayerRangeError       a stage range outside the model
    |   +-- CapacityError         a session asked for more than it was given
    |   +-- SessionStateError     a step that does not fit the session's state
    |   +-- TooManyGuessesError   a step with more guesses than the session allows
    |   +-- ChatTemplateError     a checkpoint's chat template that does not render
    |   +-- DeviceError           a --device that is malformed or absent here (cuda without CUDA)
    +-- WireError             malformed, oversized or inconsistent frames from a peer
    |   +-- FrameTooLargeError     a length prefix above the configured maximum
    |   +-- TruncatedFrameError    the stream ended inside a frame
    |   +-- MalformedFrameError    bytes that do not parse as a message (garbage, unknown tag)
    |   +-- UnsupportedVersionError a message of a wire version this peer does not speak
    |   +-- InvalidMessageError    a field breaks the wire rules (type, bound, dtype, shape)
    |   +-- BufferBudgetError      a frame being read would exceed the stage's input budget
    +-- NetworkError          identity, dialling, records, relays, private fleets
    |   +-- RecordError           a signed DHT record failed validation
    |   +-- ListenError           a listen address refused (not covered by the fleet secret) or not listened on
    |   +-- DownloadError         a Hub file that could not be fetched, or whose bytes fail the Hub's sha256/etag
    |   +-- StreamClosed          a stream (libp2p, lane or in-process) ended or was reset
    |   +-- LaneError             a direct lane not set up (the caller uses libp2p), or a lane record forged
    |   +-- RelayError            a relay refused or failed a reservation or circuit (carries its status)
    |       +-- NotARelayError        the peer offers no relay service at all
    |   +-- KeyInUse              a key file that another running peer holds (one identity, one peer)
    |   +-- PeerBackedOff         a peer that failed to answer, not dialled again until its backoff ends
    |   +-- OutboxFull            a stream's queue of outgoing frames at its bound while its writes do not drain
    |   +-- ChainBroken           a chain that cannot finish a trip (a stream ended, a next hop failed, a stall)
    +-- RouteError            no chain of peers covers the model
    |   +-- VerifyingTripLate     a second chain did not answer a verifying trip in time
    +-- TokensRetracted       a verifier took back tokens that a stream had already yielded (a peer lied)
    +-- StageError            a stage refused or failed a request (carries a code)
    |   +-- StageRefused          a stage answered with an ErrorMessage (carries the code and the peer)
    |       +-- NonFiniteHidden       a stage refused NaN/Inf hidden states (names the stage that computed them)
    +-- ApiError              an HTTP API request refused (carries the HTTP status and OpenAI's error fields)

Foreign errors (libp2p's, trio's, ``OSError``, a parser's) are translated where they are caught by one helper,
:func:`translate`: an error of ours passes through unchanged (its class and wire code survive), a foreign one
becomes the class that the catching layer names, with a message that says what failed and the foreign type, and
is raised ``from`` the original exception.
"""

from __future__ import annotations

import enum

__all__ = [
    "ApiError",
    "BufferBudgetError",
    "CapacityError",
    "ChainBroken",
    "ChatTemplateError",
    "DeviceError",
    "CheckpointError",
    "DownloadError",
    "ErrorCode",
    "FrameTooLargeError",
    "InvalidMessageError",
    "KeyInUse",
    "LaneError",
    "LayerRangeError",
    "ListenError",
    "MalformedFrameError",
    "ModelError",
    "NetworkError",
    "NonFiniteHidden",
    "NotARelayError",
    "OutboxFull",
    "PeerBackedOff",
    "RecordError",
    "RelayError",
    "RouteError",
    "SangamaError",
    "SessionStateError",
    "StageError",
    "StageRefused",
    "TokensRetracted",
    "StreamClosed",
    "TooManyGuessesError",
    "TruncatedFrameError",
    "UnsupportedModelError",
    "UnsupportedVersionError",
    "VerifyingTripLate",
    "WireError",
    "describe",
    "group_leaves",
    "translate",
]


class ErrorCode(enum.IntEnum):
    """Stable numeric codes for errors that travel between peers."""

    INTERNAL = 1
    BAD_FRAME = 2
    UNKNOWN_SESSION = 3
    NOT_OWNER = 4
    CAPACITY = 5
    BAD_POSITION = 6
    TOO_MANY_GUESSES = 7
    WRONG_MODEL = 8
    OVERLOADED = 9
    NON_FINITE = 10
    EXPIRED = 11


class SangamaError(Exception):
    """Base class of every error Sangama raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL


class ModelError(SangamaError):
    """A problem with a model: its checkpoint, its spec or a runtime session."""


class CheckpointError(ModelError):
    """A checkpoint is missing, corrupt, truncated or inconsistent with its config."""


class UnsupportedModelError(ModelError):
    """An architecture, dtype or quantization type that Sangama does not run."""


class LayerRangeError(ModelError):
    """A stage's layer range lies outside the model or is empty."""


class CapacityError(ModelError):
    """A session or stage was asked to hold more than its configured capacity."""

    code = ErrorCode.CAPACITY


class SessionStateError(ModelError):
    """A step does not fit the session's state (e.g. a start position ahead of it)."""

    code = ErrorCode.BAD_POSITION


class TooManyGuessesError(ModelError):
    """A step carries more guesses than the session was opened for."""

    code = ErrorCode.TOO_MANY_GUESSES


class ChatTemplateError(ModelError):
    """A chat template failed to compile or render (its syntax, a ``raise_exception`` call, a bad message)."""


class DeviceError(ModelError):
    """A ``--device`` that is not ``cpu``, ``cuda`` or ``cuda:N``, or a CUDA device this process cannot use."""


class WireError(SangamaError):
    """A frame or message from a peer is malformed, oversized or inconsistent."""

    code = ErrorCode.BAD_FRAME


class FrameTooLargeError(WireError):
    """A frame's length prefix exceeds the maximum; raised before anything is buffered."""


class BufferBudgetError(WireError):
    """A frame being read would take more buffered bytes than the stage's input budget has left."""

    code = ErrorCode.CAPACITY


class TruncatedFrameError(WireError):
    """The byte stream ended in the middle of a frame."""


class MalformedFrameError(WireError):
    """A frame payload does not parse: bad msgpack, unknown type tag, wrong arity, trailing bytes."""


class UnsupportedVersionError(WireError):
    """A message carries a wire version this peer does not speak."""


class InvalidMessageError(WireError):
    """A message field breaks the wire rules: wrong type, out of bounds, bad dtype or shape.

    When decoding could still read a valid ``session_id`` (and ``step``) from the bad message, they are set here,
    so the receiver can fail just that session (reply with an ErrorMessage) and keep the stream.
    """

    session_id: bytes | None = None
    step: int | None = None


class NetworkError(SangamaError):
    """Identity, dialling, DHT records, relays or private-fleet membership failed."""


class RecordError(NetworkError):
    """A signed DHT record is forged, tampered, expired, malformed or in the wrong namespace."""


class ListenError(NetworkError):
    """A configured listen address cannot be used: its transport bypasses the fleet secret (QUIC, WebSocket, ...
    on a private fleet), or the host did not actually listen on it (e.g. ``/udp/5000`` names no transport)."""


class DownloadError(NetworkError):
    """A model file from the Hugging Face Hub (``hf:`` models) could not be fetched: the repo, revision or file is
    unknown or refused, the transfer failed after its retries, offline mode has no cached copy, or the bytes do not
    match the Hub's sha256 (LFS files) / git blob id (small files). The file is then removed, never used."""


class StreamClosed(NetworkError):
    """The stream ended or was reset; nothing more can be sent or received on it."""


class LaneError(NetworkError):
    """A lane could not be set up (the caller falls back to libp2p) or a lane's record failed authentication.

    ``lasting`` is False when the reason may pass soon (the link is relayed until hole punching upgrades it)."""

    def __init__(self, message: str, *, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


class RelayError(NetworkError):
    """A relay refused or failed a reservation or a circuit; ``status`` is the circuit v2 status code (0: none)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class NotARelayError(RelayError):
    """The peer does not offer the circuit relay v2 HOP protocol: it relays for nobody, and asking again won't help."""


class KeyInUse(NetworkError):
    """Another running peer holds this key file: two peers with one identity would knock each other off the swarm."""


class PeerBackedOff(NetworkError):
    """A peer that failed to answer recently is not dialled again yet (``net/backoff.py``); ``wait_s``: seconds until
    it may be. Nothing was sent: retrying before then gets the same answer."""

    def __init__(self, message: str, wait_s: float) -> None:
        super().__init__(message)
        self.wait_s = wait_s


class OutboxFull(NetworkError):
    """A stream's queue of outgoing frames reached its hard bound while its writes were stuck (the peer does not
    read)."""

    code = ErrorCode.OVERLOADED


class ChainBroken(NetworkError):
    """The chain cannot finish this trip; ``misbehaving`` are peers that answered against the protocol (excluded
    without a probe; every other peer of the chain is probed before it is excluded). ``keep``: only the first
    ``keep`` new tokens stand (a verifier found the chain wrong after them: the generation rewinds to them).
    ``ring``: what failed is the ring's hand-on (the last stage's link to the first, or a trip it handed on that
    never came round): the client goes on through itself, on a chain that may be the same, nobody blamed."""

    def __init__(self, message: str, misbehaving: frozenset[str] = frozenset(),
                 stalled: frozenset[str] = frozenset(), keep: int | None = None, ring: bool = False) -> None:
        super().__init__(message)
        self.misbehaving = misbehaving
        self.stalled = stalled  # the route of a trip that stalled past its trip clock (one of them swallowed it)
        self.keep = keep
        self.ring = ring


class RouteError(SangamaError):
    """No chain of live peers covers the requested model's layers."""


class VerifyingTripLate(RouteError):
    """A second chain did not answer a verifying trip within its deadline (the verifier gives a generation's late
    chain one more try with more time, then counts the trip as not verified)."""


class TokensRetracted(SangamaError):
    """A verifier caught the chain lying after some tokens had already been streamed: those tokens are wrong. The
    stream stops here (nothing it yielded is taken back silently); ``kept`` tokens of it stand, ``retracted`` after
    them do not. A non-streaming generation instead goes on around the liar and returns only right tokens."""

    def __init__(self, message: str, kept: int, retracted: int) -> None:
        super().__init__(message)
        self.kept, self.retracted = kept, retracted


class StageError(SangamaError):
    """A stage refused or failed a request; ``code`` says why."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


class StageRefused(StageError):
    """A stage answered a request with an ``ErrorMessage``; ``peer`` says which one."""

    def __init__(self, message: str, code: ErrorCode, peer: str) -> None:
        super().__init__(message, code)
        self.peer = peer


class NonFiniteHidden(StageRefused):
    """A stage refused the hidden states it was sent (``NON_FINITE``: they hold NaN or Inf). ``producer`` is the
    stage before it in the chain, which computed them (None if the refusing stage is the first)."""

    def __init__(self, message: str, peer: str, producer: str | None) -> None:
        super().__init__(message, ErrorCode.NON_FINITE, peer)
        self.producer = producer


class ApiError(SangamaError):
    """An HTTP API request that cannot be served: ``status`` (400, 401, 404, 429, 502, 503) and the fields of
    OpenAI's error object (``type``, ``param``, ``code``)."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code = status, type, param, code


def group_leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions inside ``group`` and its nested groups, in order (what trio's nurseries wrap errors in)."""
    out: list[BaseException] = []
    for exc in group.exceptions:
        out.extend(group_leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc])
    return out


def describe(exc: BaseException) -> str:
    """A foreign exception in one line: its type and message (``TooSlowError`` has none: the type says it), the
    leaves of an exception group joined, so a message never reads ``... failed: `` with nothing after it."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(describe(leaf) for leaf in group_leaves(exc))
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text else name


def translate(exc: BaseException, cls: type[SangamaError], what: str, *args: object) -> SangamaError:
    """The error to raise for ``exc``, caught while doing ``what``: ours unchanged, a foreign one as
    ``cls(f"{what}: {describe(exc)}", *args)`` with ``__cause__`` set (as ``raise ... from exc`` would).

    Use as ``raise translate(exc, ...)``, without ``from exc``: ``raise ours from ours`` would make an error of ours
    its own cause and drop the cause it was raised with.

    Cancellation and interpreter exits are not ours to translate: callers catch ``Exception``, never those."""
    if isinstance(exc, SangamaError):
        return exc
    out = cls(f"{what}: {describe(exc)}", *args)  # type: ignore[call-arg]
    out.__cause__ = exc
    out.__suppress_context__ = True
    return out
