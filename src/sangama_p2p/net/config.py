"""``HostConfig``: everything a node needs to join the network, in one frozen dataclass.

Grouped configuration instead of a long keyword list: the CLI, TOML files (``bootstrap/bootstrap.toml``) and tests
all build the same object. Listen and announce addresses are separate on purpose: a peer behind a port forward or in a
container listens on ``0.0.0.0`` but must advertise (and be dialled on) its public address, which nobody has observed
yet.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import multiaddr

from ..errors import NetworkError, SangamaError, translate

__all__ = ["DEFAULT_LISTEN", "HostConfig", "Limits", "check_toml_types", "parse_multiaddrs"]

DEFAULT_LISTEN = ("/ip4/0.0.0.0/tcp/0",)


@dataclass(frozen=True)
class Limits:
    """Resource limits handed to py-libp2p's resource manager.

    py-libp2p's defaults refuse connections once the process uses 80 % of RAM or the system 90 %, which a peer that
    holds a model's weights in memory reaches by design; these limits count connections and streams only.
    """

    max_connections: int = 512
    max_streams: int = 8192
    max_connections_per_peer: int = 4


@dataclass(frozen=True)
class HostConfig:
    """How a node identifies itself, where it listens, what it advertises and whom it meets first.

    ``fleet_secret`` (raw bytes, e.g. read from a file) turns the node into a member of a private fleet: every
    connection is encrypted with a key derived from it, and peers without it cannot connect.

    ``batch_window_updates`` makes Yamux acknowledge received bytes in batches (half a window, as go-yamux does)
    instead of after every read: py-libp2p 0.8.1 otherwise sends one extra encrypted WINDOW_UPDATE frame per read.
    Measured with ``benchmarks/net.py``: about a quarter less CPU per 8 KiB round trip. py-libp2p reads this knob
    from the environment (``PY_YAMUX_RELEASE_ON_READ``), so it applies to the whole process; an explicit value in
    the environment wins.

    ``dht_max_records`` and ``dht_records_per_peer`` bound what this node stores as a DHT server: records in all
    (each at most 8 KiB, so 32 MiB at the default) and records of one author (a peer publishes one per model it
    serves). An author over its cap loses its own soonest-expiring record; in a full store the author holding the
    most records makes room; a newcomer is refused only when every author holds a single record.
    """

    key_path: Path | None = None
    listen_addrs: tuple[str, ...] = DEFAULT_LISTEN
    announce_addrs: tuple[str, ...] = ()
    bootstrap_addrs: tuple[str, ...] = ()
    fleet_secret: bytes | None = field(default=None, repr=False)
    dht_server: bool = True
    relay_hop: bool = False
    handshake_timeout: float = 5.0
    record_ttl: float = 180.0
    dht_max_records: int = 4096
    dht_records_per_peer: int = 16
    limits: Limits = Limits()
    batch_window_updates: bool = True

    def __post_init__(self) -> None:
        for name in ("listen_addrs", "announce_addrs", "bootstrap_addrs"):
            value = tuple(getattr(self, name))
            parse_multiaddrs(value, what=name)
            object.__setattr__(self, name, value)
        if not self.listen_addrs:
            raise NetworkError("listen_addrs is empty: a node must listen somewhere")
        if self.handshake_timeout <= 0 or self.record_ttl <= 0:
            raise NetworkError("handshake_timeout and record_ttl must be positive")
        if self.dht_max_records < 1 or self.dht_records_per_peer < 1:
            raise NetworkError("dht_max_records and dht_records_per_peer must be at least 1")
        if self.fleet_secret is not None and len(self.fleet_secret) < 16:
            raise NetworkError("fleet secret is too short: use at least 16 bytes (e.g. `openssl rand -hex 32`)")
        if self.key_path is not None:
            object.__setattr__(self, "key_path", Path(self.key_path).expanduser())

    def replace(self, **changes: Any) -> HostConfig:
        """A copy with ``changes`` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_toml(cls, path: Path, **overrides: Any) -> HostConfig:
        """Read a ``[host]`` table (keys named like the fields; ``fleet_secret_file`` instead of the secret itself)."""
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise translate(exc, NetworkError, f"cannot read host config {path}")
        table = dict(data.get("host", {}))
        secret_file = table.pop("fleet_secret_file", None)
        if secret_file:
            from .fleet import read_fleet_secret

            table["fleet_secret"] = read_fleet_secret(Path(path).parent / Path(secret_file).expanduser())
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(table) - known
        if unknown:
            raise NetworkError(f"unknown keys in [host] of {path}: {sorted(unknown)}")
        for name in ("listen_addrs", "announce_addrs", "bootstrap_addrs"):
            if name in table:
                value = table[name]
                if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                    raise NetworkError(f"bad [host] table in {path}: {name} must be a list of multiaddr strings "
                                       f"(e.g. [\"/ip4/0.0.0.0/tcp/4001\"]), got {value!r}")
                table[name] = tuple(value)
        check_toml_types(table, cls, f"[host] table in {path}", paths=("key_path",),
                         skip=("listen_addrs", "announce_addrs", "bootstrap_addrs", "fleet_secret", "limits"))
        if "limits" in table:
            limits = table["limits"]
            if not isinstance(limits, dict):
                raise NetworkError(f"bad [host] table in {path}: limits must be a table ([host.limits]), "
                                   f"got {limits!r}")
            unknown = set(limits) - {f.name for f in dataclasses.fields(Limits)}
            if unknown:
                raise NetworkError(f"unknown keys in [host.limits] of {path}: {sorted(unknown)}")
            check_toml_types(limits, Limits, f"[host.limits] table in {path}")
            table["limits"] = Limits(**limits)
        table.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**table)
        except TypeError as exc:
            raise translate(exc, NetworkError, f"bad [host] table in {path}")


_TOML_KINDS = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def check_toml_types(table: dict[str, Any], cls: type, where: str, error: type[SangamaError] = NetworkError, *,
                     skip: tuple[str, ...] = (), paths: tuple[str, ...] = ()) -> None:
    """Raise ``error`` for a TOML value of the wrong type for a field of dataclass ``cls`` (judged by the field's
    default: bool, int, float or str; ``paths`` name fields that take a path string), named in TOML's terms rather
    than as whatever trips on it later. Fields with other defaults, and those in ``skip``, are not checked."""
    for f in dataclasses.fields(cls):
        if f.name not in table or f.name in skip:
            continue
        value, kind = table[f.name], type(f.default)
        if f.name in paths:
            ok, want = isinstance(value, str), "a path string"
        elif kind in _TOML_KINDS:
            want = _TOML_KINDS[kind]
            if kind is bool or isinstance(value, bool):
                ok = isinstance(value, bool) and kind is bool
            elif kind is float:
                ok = isinstance(value, (int, float))
            else:
                ok = isinstance(value, kind)
        else:
            continue
        if not ok:
            raise error(f"bad {where}: {f.name} must be {want}, got {value!r}")


def parse_multiaddrs(addrs: tuple[str, ...] | list[str], *, what: str = "address") -> list[multiaddr.Multiaddr]:
    """Parse multiaddr strings, raising :class:`NetworkError` that names the bad one."""
    out = []
    for text in addrs:
        try:
            out.append(multiaddr.Multiaddr(str(text)))
        except Exception as exc:  # multiaddr raises several unrelated types
            raise translate(exc, NetworkError, f"bad multiaddr in {what}: {text!r}")
    return out
