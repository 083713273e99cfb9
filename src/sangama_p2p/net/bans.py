"""Local bans: peers this node caught serving wrong results, with the reason and an expiry. No torch, no trio.

A client that verifies trips (:mod:`sangama_p2p.client.verify`) bans a peer it proved wrong: routing leaves banned
peers out of every chain until the ban expires, and ``sangama-peer status`` shows them with the reason. Bans are
local (this node's judgement, never published: a swarm-wide ban list would be one more thing a liar could forge);
with a file they outlive the process, so the next ``generate`` and ``status`` see them.

Usage::

    bans = BanList(path=Path("~/.sangama/bans.json").expanduser())   # loads what the file holds (if any)
    bans.ban(peer_id, "answered [5] where 3 other chains answered [9] (trip 12)", model_id="org/m")   # saves
    bans.banned()                 # frozenset of peer ids banned now (expired bans are dropped)
    for b in bans.active(): print(b.peer_id, b.reason, b.until)

Times are wall-clock seconds (:func:`~sangama_p2p.clock.wall`), since bans outlive the process.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ..clock import wall
from ..errors import NetworkError, translate

__all__ = ["DEFAULT_BAN_S", "Ban", "BanList", "default_bans_path", "load_bans"]

DEFAULT_BAN_S = 24 * 3600.0
"""How long a ban lasts by default: a day (a peer that was wrong because of a bug may be fixed and restarted)."""
_MAX_BANS = 10_000  # a file holding more is not ours
_MAX_REASON = 500


def default_bans_path() -> Path:
    """``~/.sangama/bans.json``: beside the default key file."""
    return Path("~/.sangama/bans.json").expanduser()


@dataclass(frozen=True)
class Ban:
    """One banned peer: why (a plain-text reason), for which model id, from ``since`` until ``until`` (wall time).
    ``address`` (the IP the client's own link to it came from, empty when none was seen: loopback, a relay),
    ``fingerprint`` and ``layers`` (``"A:B"``): what the ban also follows - the same checkpoint's same range served
    from that address under another key is the same liar (keys are free, addresses are not)."""

    peer_id: str
    reason: str
    since: float
    until: float
    model_id: str = ""
    address: str = ""
    fingerprint: str = ""
    layers: str = ""

    def follows(self, source: tuple[str, ...], fingerprint: str, layers: str) -> bool:
        """Whether a peer seen from ``source`` (net/addrs.source_keys) serving ``layers`` of ``fingerprint`` is
        this banned one under another key."""
        return bool(self.address) and f"address {self.address}" in source and \
            (self.fingerprint, self.layers) == (fingerprint, layers)

    def __post_init__(self) -> None:
        if not self.peer_id or not isinstance(self.peer_id, str):
            raise NetworkError(f"a ban needs a peer id, got {self.peer_id!r}")
        if not isinstance(self.reason, str) or not self.reason:
            raise NetworkError("a ban needs a reason")
        if not (isinstance(self.since, (int, float)) and isinstance(self.until, (int, float))):
            raise NetworkError("a ban's times must be numbers")
        if self.until < self.since:
            raise NetworkError(f"a ban cannot end ({self.until}) before it starts ({self.since})")


class BanList:
    """The bans of one node; ``path``: a JSON file they are loaded from and saved to on every change (None: kept
    in memory only)."""

    def __init__(self, path: Path | None = None, *, clock=wall) -> None:  # noqa: ANN001
        self.path = Path(path).expanduser() if path is not None else None
        self.clock = clock
        self._bans: dict[str, Ban] = {}
        if self.path is not None and self.path.exists():
            for b in load_bans(self.path):
                self._bans[b.peer_id] = b

    def ban(self, peer_id: str, reason: str, *, duration: float = DEFAULT_BAN_S, model_id: str = "",
            address: str = "", fingerprint: str = "", layers: str = "") -> Ban:
        """Ban ``peer_id`` for ``duration`` seconds from now (a longer existing ban is kept, with the new reason);
        with ``address``, ``fingerprint`` and ``layers`` (see :class:`Ban`) the ban follows it to other keys."""
        if duration <= 0:
            raise NetworkError(f"a ban's duration must be positive, got {duration}")
        now = self.clock()
        old = self._bans.get(peer_id)
        until = max(now + duration, old.until if old is not None else now)
        b = Ban(peer_id, reason[:_MAX_REASON], now, until, model_id, address, fingerprint, layers)
        self._bans[peer_id] = b
        self._save()
        return b

    def unban(self, peer_id: str) -> bool:
        """Lift a ban; True if there was one."""
        if self._bans.pop(peer_id, None) is None:
            return False
        self._save()
        return True

    def active(self) -> list[Ban]:
        """The bans in force now, oldest first (expired ones are dropped, and the file rewritten without them)."""
        now = self.clock()
        expired = [p for p, b in self._bans.items() if b.until <= now]
        for p in expired:
            del self._bans[p]
        if expired:
            self._save()
        return sorted(self._bans.values(), key=lambda b: (b.since, b.peer_id))

    def banned(self) -> frozenset[str]:
        """The peer ids banned now."""
        return frozenset(b.peer_id for b in self.active())

    def reasons(self) -> dict[str, str]:
        """peer id -> reason, for the bans in force."""
        return {b.peer_id: b.reason for b in self.active()}

    def follow(self, peers: list[tuple[str, tuple[str, ...], str, str]]) -> dict[str, str]:
        """Of ``peers`` (peer id, source, fingerprint, layers ``"A:B"``), those a ban in force follows (see
        :class:`Ban`) besides the banned ids themselves -> why."""
        bans = [b for b in self.active() if b.address]
        out = {}
        for peer_id, source, fingerprint, layers in peers:
            for b in bans:
                if peer_id != b.peer_id and b.follows(source, fingerprint, layers):
                    out[peer_id] = (f"serves {layers} of the checkpoint banned {b.peer_id} served, from its address "
                                    f"{b.address}: {b.reason}")
                    break
        return out

    def _save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # ~/.sangama also holds the peer key
        tmp = self.path.with_name(self.path.name + f".{os.getpid()}.tmp")
        data = {"bans": [asdict(b) for b in sorted(self._bans.values(), key=lambda b: b.peer_id)]}
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, self.path)  # atomic: a reader never sees half a file


def load_bans(path: Path, *, now: float | None = None) -> list[Ban]:
    """The bans a file holds (those not expired at ``now``, when given); a typed error for a file that is not a
    ban list."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise translate(exc, NetworkError, f"cannot read the ban list {path}")
    rows = data.get("bans") if isinstance(data, dict) else None
    if not isinstance(rows, list) or len(rows) > _MAX_BANS:
        raise NetworkError(f"{path} is not a ban list (expected {{\"bans\": [...]}})")
    out = []
    for row in rows:
        if not isinstance(row, dict):
            raise NetworkError(f"{path}: a ban must be an object, got {row!r}")
        try:
            b = Ban(str(row["peer_id"]), str(row["reason"]), float(row["since"]), float(row["until"]),
                    str(row.get("model_id", "")), str(row.get("address", "")), str(row.get("fingerprint", "")),
                    str(row.get("layers", "")))
        except (KeyError, TypeError, ValueError) as exc:
            raise translate(exc, NetworkError, f"{path}: malformed ban {row!r}")
        if now is None or b.until > now:
            out.append(b)
    return out
