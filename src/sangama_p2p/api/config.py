"""How the HTTP API listens and what it allows: :class:`ApiConfig` (``sangama-peer api``'s flags, a peer config's
``[api]`` table)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import SangamaError, translate

__all__ = ["ApiConfig"]


@dataclass(frozen=True)
class ApiConfig:
    """``host``/``port`` to listen on (port 0: any free one); ``api_key_file``: a file holding the one key clients
    must send as ``Authorization: Bearer KEY`` (None: no key); ``max_tokens``: when a request gives none;
    ``guesses``: MTP guesses per trip unless a request's ``guesses`` field says otherwise.

    Limits: ``max_body_bytes`` per request body; ``max_prompt_chars`` of prompt text, checked before tokenizing
    (0: 16 per position of the model's context, or 262,144); ``max_tokens_cap``, the most a request may ask for;
    ``max_requests_per_client`` running at once per client address (0: no limit). ``allowed_hosts``: ``Host``
    names accepted besides loopback's (on loopback; elsewhere, when given, the only ones); ``allowed_origins``:
    browser origins besides the API's own (and answered CORS preflights); ``"*"`` in either: any. ``dashboard``:
    the swarm's live page at ``/dashboard/`` (a survey of the swarm every 5 s while the server runs)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key_file: Path | None = None
    max_tokens: int = 256
    guesses: int | str = "auto"
    max_body_bytes: int = 4 << 20
    max_prompt_chars: int = 0
    max_tokens_cap: int = 4096
    max_requests_per_client: int = 4
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    dashboard: bool = False

    def __post_init__(self) -> None:
        for name, lo in (("max_body_bytes", 1), ("max_prompt_chars", 0), ("max_tokens_cap", 1),
                         ("max_requests_per_client", 0), ("max_tokens", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < lo:
                raise SangamaError(f"ApiConfig.{name} must be an integer >= {lo}, got {value!r}")
        if self.max_tokens > self.max_tokens_cap:
            raise SangamaError(f"ApiConfig.max_tokens ({self.max_tokens}) is over max_tokens_cap "
                               f"({self.max_tokens_cap})")
        for name in ("allowed_hosts", "allowed_origins"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise SangamaError(f"ApiConfig.{name} must be a list of strings, got {value!r}")
            object.__setattr__(self, name, tuple(v.strip().rstrip("/") for v in value))

    def replace(self, **changes: Any) -> ApiConfig:
        return dataclasses.replace(self, **changes)

    def api_key(self) -> str | None:
        if self.api_key_file is None:
            return None
        try:
            key = Path(self.api_key_file).expanduser().read_text().strip()
        except OSError as exc:
            raise translate(exc, SangamaError, f"cannot read the API key file {self.api_key_file}")
        if not key:
            raise SangamaError(f"the API key file {self.api_key_file} is empty")
        return key
