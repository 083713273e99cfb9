"""``ClientConfig``: how a client finds, measures and drives chains of stages."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from ..errors import RouteError
from ..wire.framing import DEFAULT_MAX_FRAME
from ..wire.limits import MAX_WINDOWS

__all__ = ["ClientConfig"]


@dataclass(frozen=True)
class ClientConfig:
    """A client's settings.

    ``model_id``: the swarm-wide model name to search the DHT for. ``num_layers``: the model's layer count (None =
    the depth in the chosen peers' records, from their checkpoint's config; never the largest announced ``end``).
    ``fingerprint``: the model fingerprint of the client's own copy of the checkpoint
    (:func:`sangama_p2p.model.fingerprint.checkpoint_identity`); only peers of that fingerprint are chained (None:
    the fingerprint group chosen by :func:`sangama_p2p.net.lineup.choose_lineup`). ``step_timeout``: a trip that
    takes longer counts as a failed stage (the client probes the chain, re-routes and replays). ``max_failovers``: re-routes per generation before
    giving up with :class:`~sangama_p2p.errors.RouteError`; ``max_verify_reroutes``: those the verifier asks for
    (a lie caught, a trip no other chain confirmed), counted apart. ``probe_timeout``: an ``/sangama/info/2`` round trip
    (RTT measurement, liveness probe; a new link that tries a lane first has ``lane_timeout`` more). ``rediscover``: ask the DHT again on every re-route (False: re-use the last
    survey minus the failed peers, which is faster and enough when spares were already announced).
    ``survey_max_age``: a new generation re-uses a survey younger than this (concurrent requests share one;
    one that yields no route is taken again at once). ``walk``: survey by walking the range directories (one DHT
    lookup per range boundary, at most 6 peers probed per range: issue 25); off (``[client] walk = false``): every
    provider is enumerated and probed.
    ``max_step_tokens``: a longer prefill or replay is sent in chunks of this many tokens (each trip's hidden
    states must fit the peers' frame limit: 64 MiB holds 4096 fp32 rows of 4096). Prompts up to this length give
    exactly the local chain's tokens; chunked prefills may differ in the last bits, as any other split of the work.
    ``stall_factor``/``stall_floor_s``: a decode trip that has not answered within ``stall_factor`` x the route's
    smoothed decode trip time (at least ``stall_floor_s``) counts as a stalled chain: the client re-routes around
    its peers where spares exist and replays (0: only ``step_timeout``).
    ``lanes``: talk to stages that offer it over a direct lane (``/sangama/lane/3``, see
    :mod:`sangama_p2p.net.lane`), set up within ``lane_timeout`` seconds, else over libp2p streams.
    ``verify``: the fraction of trips re-run through a second chain of other peers for the same ranges and compared
    (:mod:`sangama_p2p.client.verify`; None: 0.05 in a public swarm, 0 in a private fleet, i.e. with a fleet
    secret). ``verify_strict``: a trip drawn for verification that no second chain confirmed (none could be
    opened, it failed, or the judging found nobody to tell the answers apart) is not kept - the generation goes back
    to its last verified token and continues on a chain around the one that gave it, and fails with
    :class:`~sangama_p2p.errors.RouteError` after ``max_verify_reroutes`` such re-routes - instead of being kept and
    counted unverified (None: strict at ``verify`` 1, where every token returned is then confirmed by two chains of
    distinct peers). A peer found lying is banned for ``ban_s`` seconds; ``bans_file``: where bans are kept between runs
    (``status`` shows them; None: in memory only). ``recover_s``: after a failover finds no chain (the only peer of a
    range left), how long the generation waits for one, surveying again every ``recover_every_s`` seconds (peers
    that joined with ``--layers auto`` move to cover a range nobody serves, within about 25 s); a generation's
    first route never waits (0: give up at once).
    ``ring``: the ring closes at the first stage - the last stage hands each next trip on to the first stage itself
    (and a copy of its answer to the client), so a decode trip crosses the stages only, not the client; the client
    stays the owner (it checks every answer and the first stage's echo of every trip handed on, fails over, verifies,
    and closes the session to stop). On by default. When the hand-on fails - the last stage's link to the first
    (which the client cannot probe: one more link for NATed stages to punch, relayed until it is punched) fails or
    swallows a trip - the request goes on through the client, nobody blamed, on the same chain or (after a trip that
    never came round) another where one exists (one re-open and replay, counted in ``failovers`` but not against
    ``max_failovers``). False: every trip goes through the client.
    ``windows``: with the ring, how many guess windows may be in flight at once: after a trip whose guesses were all
    kept, the last stage drafts a window past the next trip - its first token the guess of that trip's new token -
    and hands it on before the next trip is checked; a window that does not stand is dropped and every stage rolls
    back past it (each keeps rollback snapshots for ``windows`` windows). Greedy requests with a fixed number of
    guesses only (sampled and ``auto`` requests keep one window); 1: one window; more than 1 turns the ring on.
    """

    model_id: str
    num_layers: int | None = None
    fingerprint: str | None = None
    step_timeout: float = 60.0
    open_timeout: float = 20.0
    probe_timeout: float = 3.0
    max_failovers: int = 4
    max_verify_reroutes: int = 16
    rediscover: bool = True
    survey_max_age: float = 10.0
    walk: bool = True  # survey by the range directories (issue 25); off: every provider is enumerated
    max_step_tokens: int = 1024
    max_frame: int = DEFAULT_MAX_FRAME
    lanes: bool = True
    lane_timeout: float = 2.0
    stall_factor: float = 10.0
    stall_floor_s: float = 1.0
    verify: float | None = None
    verify_strict: bool | None = None
    bans_file: Path | None = None
    ban_s: float = 24 * 3600.0
    recover_s: float = 60.0
    recover_every_s: float = 2.0
    ring: bool = True
    windows: int = 1

    @property
    def rings(self) -> bool:
        """Whether trips go round the ring: asked for, or implied by windows in flight (which go round it)."""
        return self.ring or self.windows > 1

    def __post_init__(self) -> None:
        if not self.model_id:
            raise RouteError("model_id must not be empty")
        if self.num_layers is not None and self.num_layers <= 0:
            raise RouteError("num_layers must be positive")
        if not 1 <= self.windows <= MAX_WINDOWS:
            raise RouteError(f"windows must be 1 to {MAX_WINDOWS}, got {self.windows}")
        if min(self.step_timeout, self.open_timeout, self.probe_timeout, self.lane_timeout) <= 0 or self.survey_max_age < 0:
            raise RouteError("timeouts must be positive")
        if self.fingerprint is not None and (len(self.fingerprint) != 32
                                             or any(c not in "0123456789abcdef" for c in self.fingerprint)):
            raise RouteError(f"fingerprint must be 32 lowercase hex digits, got {self.fingerprint!r}")
        if self.stall_factor < 0 or self.stall_floor_s <= 0:
            raise RouteError("stall_factor must be >= 0 and stall_floor_s positive")
        if self.recover_s < 0 or self.recover_every_s <= 0:
            raise RouteError("recover_s must be >= 0 and recover_every_s positive")
        if self.max_failovers < 0 or self.max_verify_reroutes < 0:
            raise RouteError("max_failovers and max_verify_reroutes must be >= 0")
        if self.max_step_tokens <= 0:
            raise RouteError("max_step_tokens must be positive")
        if self.verify is not None and (isinstance(self.verify, bool) or not isinstance(self.verify, (int, float))
                                        or not 0.0 <= self.verify <= 1.0):
            raise RouteError(f"verify must be a fraction of trips in [0, 1], got {self.verify}")
        if self.ban_s <= 0:
            raise RouteError("ban_s must be positive")
        if self.bans_file is not None:
            object.__setattr__(self, "bans_file", Path(self.bans_file).expanduser())

    def replace(self, **changes: object) -> ClientConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]
