"""``PeerConfig``: everything a peer needs, grouped (how to join, what to serve, how to generate, the HTTP API), and
its TOML file (``[host]``, ``[stage]``, ``[client]``, ``[api]`` tables).
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .api.server import ApiConfig
from .client.config import ClientConfig
from .errors import ModelError, SangamaError, translate
from .guesses import parse_guesses
from .model.spec import parse_layer_range
from .net.config import HostConfig, check_toml_types
from .stage.config import StageConfig

__all__ = ["PeerConfig", "default_model_id"]


def default_model_id(model_path: str | Path) -> str:
    """The swarm-wide name of a checkpoint when none is given: its directory (or file stem) name."""
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else p.resolve().name


@dataclass(frozen=True)
class PeerConfig:
    """Everything a peer needs, grouped: how to join (``host``), what to serve (``stage``), how to generate.

    ``model_path`` and ``layers`` (``"A:B"`` or ``"auto"``/``"auto:N"``) say what to serve when the peer starts
    (``None``: serve nothing until :meth:`Peer.serve`). ``stage`` holds the stage settings, a template: each
    ``serve`` call sets ``start`` and ``end`` (and ``model_id`` when it passes one). ``client`` holds those of
    generation (its ``model_id`` is the default model that ``generate`` asks for). ``tokenizer_path`` (a checkpoint
    directory or a ``.gguf`` file) lets a client-only peer take text prompts and stop at the model's
    end-of-sequence tokens.

    A peer that serves ``layers = "auto"`` re-checks the swarm every ``rebalance_every`` seconds (times a random
    0.75..1.25; 0: never) and moves its stage to a range nobody serves when its own stays served without it
    (:mod:`sangama_p2p.stage.rebalance`); the old stage's open sessions get ``rebalance_drain_s`` seconds to finish
    before it closes. A fixed range never moves. In TOML both are ``[stage]`` keys, beside ``layers``.
    """

    host: HostConfig = HostConfig(listen_addrs=("/ip4/0.0.0.0/tcp/0",))
    stage: StageConfig | None = None
    client: ClientConfig | None = None
    model_path: Path | None = None
    layers: str = "auto"
    tokenizer_path: Path | None = None
    api: ApiConfig | None = None  # from an [api] table: ``sangama-peer api`` listens with it
    rebalance_every: float = 20.0
    rebalance_drain_s: float = 30.0

    def __post_init__(self) -> None:
        if self.rebalance_every < 0 or self.rebalance_drain_s < 0:
            raise SangamaError(f"rebalance_every and rebalance_drain_s must be >= 0, got {self.rebalance_every}, "
                               f"{self.rebalance_drain_s}")

    def replace(self, **changes: Any) -> PeerConfig:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_toml(cls, path: str | Path) -> PeerConfig:
        """Read ``[host]`` (as :meth:`HostConfig.from_toml`), ``[stage]``, ``[client]`` and ``[api]`` tables.

        ``[stage]``: ``model`` (checkpoint path, relative to the file), ``layers`` (``"0:20"`` or ``"auto"``),
        optional ``model_id`` (default: the checkpoint's directory name) and any :class:`StageConfig` field.
        ``[client]``: any :class:`ClientConfig` field, plus ``tokenizer`` (a checkpoint directory).
        ``[api]``: any :class:`~sangama_p2p.api.ApiConfig` field (``host``, ``port``, ``api_key_file`` relative to
        the file, ``max_tokens``, ``guesses``), for ``sangama-peer api``.
        """
        path = Path(path)
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise translate(exc, SangamaError, f"cannot read peer config {path}")
        unknown = set(data) - {"host", "stage", "client", "api"}
        if unknown:
            raise SangamaError(f"unknown tables in {path}: {sorted(unknown)} (expected host, stage, client, api)")
        host = HostConfig.from_toml(path) if "host" in data else cls.host
        stage, model_path, layers, moves = None, None, "auto", {}
        if "stage" in data:
            table = dict(data["stage"])
            model = table.pop("model", None)
            if model is None:
                raise SangamaError(f"[stage] of {path} needs `model` (a checkpoint path)")
            model_path = (path.parent / Path(model).expanduser()).resolve()
            layers = str(table.pop("layers", "auto"))
            moves = {k: table.pop(k) for k in ("rebalance_every", "rebalance_drain_s") if k in table}
            if any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in moves.values()):
                raise SangamaError(f"[stage] of {path}: rebalance_every and rebalance_drain_s are seconds (numbers)")
            table.setdefault("model_id", default_model_id(model_path))
            start, end = _template_range(layers)
            stage = _build(StageConfig, {"start": start, "end": end, **table}, f"[stage] of {path}")
        client, tokenizer = None, None
        if "client" in data:
            table = dict(data["client"])
            tok = table.pop("tokenizer", None)
            if tok is not None:
                tokenizer = (path.parent / Path(tok).expanduser()).resolve()
            if "model_id" not in table and stage is not None:
                table["model_id"] = stage.model_id
            client = _build(ClientConfig, table, f"[client] of {path}")
        api = None
        if "api" in data:
            table = dict(data["api"])
            if "api_key_file" in table:
                if not isinstance(table["api_key_file"], str):
                    raise SangamaError(f"[api] of {path}: api_key_file must be a path string")
                table["api_key_file"] = (path.parent / Path(table["api_key_file"]).expanduser()).resolve()
            guesses = table.pop("guesses", "auto")
            try:
                parse_guesses(guesses)
            except ModelError as exc:
                raise SangamaError(f"[api] of {path}: {exc}") from exc
            api = _build(ApiConfig, table, f"[api] of {path}").replace(guesses=guesses)
        return cls(host, stage, client, model_path, layers, tokenizer, api,
                   **{k: float(v) for k, v in moves.items()})


def _template_range(layers: str) -> tuple[int, int]:
    if layers.startswith("auto"):
        return 0, 1  # replaced when the peer has seen the swarm
    r = parse_layer_range(layers)
    return r.start, r.end


def _build(cls: Any, table: dict[str, Any], where: str) -> Any:
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(table) - known
    if unknown:
        raise SangamaError(f"unknown keys in {where}: {sorted(unknown)}")
    check_toml_types(table, cls, where, SangamaError)
    try:
        return cls(**table)
    except TypeError as exc:
        raise translate(exc, SangamaError, f"bad {where}")
