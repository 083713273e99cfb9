"""``StageConfig``: what a stage serves and how much it may take on, in one frozen dataclass."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import StageError
from ..wire.framing import DEFAULT_MAX_FRAME
from ..wire.limits import MAX_GUESSES

__all__ = ["StageConfig"]


@dataclass(frozen=True)
class StageConfig:
    """A stage's settings.

    ``model_id`` is the swarm-wide name of the model (what clients search the DHT for); ``start``/``end`` the layer
    range ``[start, end)``. ``memory_budget`` bounds the bytes of every session's caches together: an
    ``OpenSession`` that would exceed it (or ``max_sessions``) is refused with ``ErrorCode.CAPACITY`` while running
    sessions continue (None: :func:`default_memory_budget` - on a GPU 90% of what its memory has free once the
    weights are loaded, on the CPU 1 GiB). ``max_batch_sessions``/``max_batch_tokens`` bound one batched compute step.
    ``wire_dtype`` is the dtype of hidden states sent to the next stage (fp32 keeps tokens identical to the local
    chain; bf16 halves the bytes). ``announce`` publishes a DHT record (layer range, measured throughput, free
    sessions) and refreshes it every ``announce_every`` seconds while the load changes.
    ``lanes``: accept direct lanes (``/sangama/lane/3``: stage frames on a TCP connection of their own, keyed
    through libp2p, see :mod:`sangama_p2p.net.lane`) on ``lane_port`` (0: any free port; set one to open it in a
    firewall) and use them towards the next stage (set up within ``lane_timeout`` seconds, else libp2p streams).
    ``fused``: repack quantized GGUF weights once at load for fused kernels (False: dequantize them on every use).
    ``inline_step_s``: decode-like steps run on the event loop's thread instead of the compute thread while they
    take at most this long (smoothed), which saves two thread hand-offs a step (0: always the compute thread;
    CPU stages only: a CUDA step ends waiting for the device, which would block the stage's streams).
    Bounds against one peer taking the stage: ``max_sessions_per_peer`` sessions open per peer id (0: a quarter of
    ``max_sessions``, at least 1), ``max_sessions_per_address`` per client IP address whatever its peer ids (0: the
    per-peer quota) and ``max_sessions_per_network`` per /24 (IPv4) or /64 (IPv6) (0: twice that; neither counts
    loopback or relayed clients, whose address the stage does not see); a session with no step for ``session_idle_s`` seconds is freed (its owner's next
    frame for it is answered ``EXPIRED``); ``max_lanes_per_peer`` open lanes per peer; ``input_budget`` bytes held
    for partial frames of every stream and lane together, counted as they arrive (a chunk over what is left closes
    its stream), ``input_per_peer`` of them by one peer's streams and lanes (0: a quarter of ``input_budget``, at
    least one largest frame); a partial frame of ``n`` bytes must complete within ``partial_frame_s + n /
    partial_frame_rate`` seconds of its first byte, else its stream is closed (``CAPACITY``);
    ``outbox_bytes`` bytes queued to send per stream (over it, the stream the replies answer is not read until
    they drain; at twice it the stream is closed), ``outbox_budget`` bytes queued on all of the stage's streams
    together (a frame over it first fails the queues holding the most, whose readers are not reading; at least
    ``max_frame``, so that a lone frame always fits).
    ``measure_links_every``: how often (seconds, +-20 % jitter; 0: never) the stage measures the round trip to up to
    ``max_measured_links`` stages that can follow it (same checkpoint, range starting where this one ends) over
    the link its frames would take, and publishes them in its record (:mod:`sangama_p2p.stage.neighbours`).
    """

    model_id: str
    start: int
    end: int
    dtype: str = "float32"
    device: str = "cpu"  # cpu, cuda or cuda:N (model/device.py checks it at load)
    batch_invariant: bool = False
    fused: bool = True
    max_sessions: int = 64
    memory_budget: int | None = None
    max_session_length: int = 8192
    typical_session_length: int = 1024  # sizes the "free sessions" figure announced to clients
    max_guesses: int = 8
    max_batch_sessions: int = 32
    max_batch_tokens: int = 8192
    wire_dtype: str = "fp32"
    max_frame: int = DEFAULT_MAX_FRAME
    announce: bool = True
    announce_every: float = 10.0
    record_ttl: float = 180.0
    measure_on_start: bool = True
    next_hop_timeout: float = 10.0  # dialling the next stage
    lanes: bool = True
    lane_port: int = 0
    lane_timeout: float = 2.0
    inline_step_s: float = 0.01
    max_sessions_per_peer: int = 0  # 0: max(1, max_sessions // 4)
    max_sessions_per_address: int = 0  # 0: as max_sessions_per_peer (any peer ids from one IP address together)
    max_sessions_per_network: int = 0  # 0: 2 x the per-address quota (one /24 of IPv4, one /64 of IPv6)
    session_idle_s: float = 300.0
    max_lanes_per_peer: int = 8
    input_budget: int = 256 << 20
    input_per_peer: int = 0  # 0: max(input_budget // 4, max_frame + 64)
    partial_frame_s: float = 30.0
    partial_frame_rate: int = 256 << 10  # bytes/s: a 64 MiB frame gets 30 + 256 s
    outbox_bytes: int = 64 << 20
    outbox_budget: int = 256 << 20  # four largest frames
    measure_links_every: float = 30.0
    max_measured_links: int = 8

    def __post_init__(self) -> None:
        if not self.model_id:
            raise StageError("model_id must not be empty")
        if not 0 <= self.start < self.end:
            raise StageError(f"bad layer range [{self.start}, {self.end})")
        for name in ("max_sessions", "memory_budget", "max_session_length", "typical_session_length",
                     "max_batch_sessions", "max_batch_tokens"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise StageError(f"{name} must be positive")
        if not 0 <= self.max_guesses <= MAX_GUESSES:
            raise StageError(f"max_guesses must be in 0..{MAX_GUESSES}")
        if self.wire_dtype not in ("bf16", "fp16", "fp32"):
            raise StageError(f"wire_dtype must be bf16, fp16 or fp32, got {self.wire_dtype!r}")
        if self.announce_every <= 0 or self.record_ttl <= 0 or self.next_hop_timeout <= 0 or self.lane_timeout <= 0:
            raise StageError("announce_every, record_ttl, next_hop_timeout and lane_timeout must be positive")
        if not 0 <= self.inline_step_s <= 1.0:
            raise StageError(f"inline_step_s must be in 0..1 s, got {self.inline_step_s}")
        if self.measure_links_every < 0 or not 0 <= self.max_measured_links <= 16:
            raise StageError("measure_links_every must be >= 0 and max_measured_links in 0..16 (a record carries "
                             "at most 16 links)")
        if self.input_per_peer < 0:
            raise StageError(f"input_per_peer must be >= 0, got {self.input_per_peer}")
        for name in ("max_sessions_per_peer", "max_sessions_per_address", "max_sessions_per_network"):
            if getattr(self, name) < 0:
                raise StageError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("session_idle_s", "max_lanes_per_peer", "input_budget", "partial_frame_s",
                     "partial_frame_rate", "outbox_bytes", "outbox_budget"):
            if not getattr(self, name) > 0:
                raise StageError(f"{name} must be positive, got {getattr(self, name)}")
        if self.outbox_budget < self.max_frame:
            raise StageError(f"outbox_budget ({self.outbox_budget}) must be at least max_frame ({self.max_frame})")
        if not 0 <= self.lane_port <= 65535:
            raise StageError(f"lane_port must be in 0..65535, got {self.lane_port}")

    @property
    def sessions_per_peer(self) -> int:
        """The per-peer session quota in effect."""
        return self.max_sessions_per_peer or max(1, self.max_sessions // 4)

    @property
    def sessions_per_address(self) -> int:
        """The per-address session quota in effect (loopback and relayed clients are counted by peer id only)."""
        return self.max_sessions_per_address or self.sessions_per_peer

    @property
    def sessions_per_network(self) -> int:
        return self.max_sessions_per_network or 2 * self.sessions_per_address

    @property
    def input_share(self) -> int:
        """The per-peer share of the input budget in effect (bytes of partial frames one peer may hold)."""
        return self.input_per_peer or max(self.input_budget // 4, self.max_frame + 64)

    def replace(self, **changes: object) -> StageConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


CPU_MEMORY_BUDGET = 1 << 30
"""The sessions' cache budget of a CPU stage when none is configured (RAM is shared with everything else)."""

GPU_BUDGET_SHARE = 0.9
"""The share of a GPU's free memory (after the weights) a stage gives its sessions' caches when no budget is
configured; the rest stays for activations of a batched step."""


def default_memory_budget(device: Any) -> int:
    """The sessions' cache budget for a stage whose weights are loaded on ``device``: on CUDA
    :data:`GPU_BUDGET_SHARE` of the device's free memory (an 82 GB stage on a 96 GB card has ~14 GB for caches, not
    the fixed 1 GiB it once had), else :data:`CPU_MEMORY_BUDGET`."""
    import torch

    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        free, _total = torch.cuda.mem_get_info(dev)
        return max(1, int(GPU_BUDGET_SHARE * free))
    return CPU_MEMORY_BUDGET
