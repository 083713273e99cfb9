"""What the API checks before it parses a request: where it comes from (``Host``, ``Origin``: DNS rebinding and
cross-site "simple" requests), what it is (``Content-Type: application/json``), how much of it there is (the body,
read in chunks up to a limit) and how many requests its client already runs; and whether the API's port is free.

A web page can send a "simple" cross-site POST (``text/plain``, no preflight) to a keyless API on 127.0.0.1, and
with DNS rebinding (its own name re-pointed at 127.0.0.1) read the answers too: requiring JSON forces a preflight
that the API does not grant unless ``allowed_origins`` says so, a foreign ``Origin`` is refused, and on loopback a
``Host`` other than the API's own names is refused.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ApiError, SangamaError, translate

__all__ = ["ClientSlots", "Gate", "check_content_type", "check_port", "client_key", "is_loopback", "read_body"]


def is_loopback(host: str) -> bool:
    """``host`` (a name or an address, IPv6 with or without brackets) is this machine only."""
    host = host.strip().lower().strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _hostname(netloc: str) -> str:
    """The name in a ``Host`` header: ``[::1]:8000`` -> ``::1``, ``Example.com:80`` -> ``example.com``."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:netloc.find("]")] if "]" in netloc else netloc
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


@dataclass(frozen=True)
class Gate:
    """The ``Host`` and ``Origin`` rules of an API listening on ``bound_host``; ``"*"`` in a list allows any."""

    bound_host: str
    allowed_hosts: tuple[str, ...]
    allowed_origins: tuple[str, ...]

    def check_host(self, host: str | None) -> None:
        """On loopback: the request's ``Host`` must name loopback or an allowed host (a rebound name does not);
        elsewhere only when ``allowed_hosts`` is given. No ``Host`` (HTTP/1.0) passes: browsers always send one."""
        if host is None or "*" in self.allowed_hosts:
            return
        name = _hostname(host)
        allowed = {_hostname(h) for h in self.allowed_hosts} | {_hostname(self.bound_host)}
        if is_loopback(self.bound_host):
            if is_loopback(name) or name in allowed:
                return
        elif not self.allowed_hosts or name in allowed:
            return
        raise ApiError(f"the Host {host!r} is not this API's (--allow-host NAME to accept it)", 403,
                       "invalid_request_error", code="host_not_allowed")

    def check_origin(self, origin: str | None, host: str | None) -> None:
        """A browser's ``Origin`` must be the API's own (``http://`` + the ``Host`` it called) or an allowed one."""
        if origin is None:
            return
        o = origin.strip().rstrip("/")
        if "*" in self.allowed_origins or o in {a.rstrip("/") for a in self.allowed_origins}:
            return
        scheme, sep, netloc = o.partition("://")
        if sep and scheme.lower() == "http" and host is not None and netloc.lower() == host.strip().lower():
            return
        raise ApiError(f"requests from the origin {origin!r} are not allowed (--allow-origin ORIGIN to accept it)",
                       403, "invalid_request_error", code="origin_not_allowed")


def check_content_type(value: str | None) -> None:
    """A POST body must be declared JSON (a ``text/plain`` or form body is what a cross-site page sends)."""
    if (value or "").split(";")[0].strip().lower() != "application/json":
        raise ApiError(f"the body must be sent as Content-Type: application/json, got {value or 'none'!r}", 415,
                       "invalid_request_error", code="unsupported_media_type")


def _too_large(limit: int) -> ApiError:
    return ApiError(f"the request body is over this server's limit of {limit} bytes (--max-body-bytes)", 413,
                    "invalid_request_error", code="request_too_large")


async def read_body(request: Any, limit: int) -> bytes:
    """The body of a starlette ``request``, read chunk by chunk; more than ``limit`` bytes (by its
    ``Content-Length`` or as they arrive) is a 413 and the reading stops there."""
    from starlette.requests import ClientDisconnect

    length = request.headers.get("content-length")
    if length is not None:
        if not length.strip().isdigit():
            raise ApiError(f"bad Content-Length {length!r}")
        if int(length) > limit:
            raise _too_large(limit)
    body = bytearray()
    try:
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise _too_large(limit)
    except ClientDisconnect as exc:
        raise translate(exc, ApiError, "the client left while sending its body")
    return bytes(body)


def client_key(request: Any) -> str:
    """Who a request's client is, for its share: its address (behind a proxy, every client is the proxy)."""
    return request.client.host if request.client is not None else "unknown"


class ClientSlots:
    """At most ``limit`` requests running per client (0: no limit): the API is one peer to the swarm, and the
    stages give one peer a share of their sessions, so one client must not take it all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._held: dict[str, int] = {}

    @property
    def running(self) -> int:
        """Requests holding a slot now."""
        return sum(self._held.values())

    def acquire(self, key: str) -> Callable[[], None]:
        """Take a slot for ``key`` (429 when it holds ``limit``); returns its release (a second call does nothing)."""
        held = self._held.get(key, 0)
        if self.limit and held >= self.limit:
            raise ApiError(f"{key} already runs {held} requests, this server's limit per client "
                           "(--max-requests-per-client): retry when one has ended", 429, "rate_limit_error",
                           code="too_many_requests")
        self._held[key] = held + 1
        done = False

        def release() -> None:
            nonlocal done
            if not done:
                done = True
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]

        return release


def check_port(host: str, port: int) -> None:
    """:class:`SangamaError` in one line (``port 8000 on 127.0.0.1 is in use``) when ``host:port`` cannot be
    listened on; port 0 (any free one) always can."""
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn does: TIME_WAIT is no obstacle
        try:
            sock.bind((host.strip("[]"), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise SangamaError(f"port {port} on {host} is in use") from exc
            raise translate(exc, SangamaError, f"cannot listen on port {port} of {host}")
