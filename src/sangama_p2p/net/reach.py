"""Reachability: is this peer publicly dialable? Ask a bootstrap/relay peer to dial us back (``/sangama/dialback/1``).

Why our own dial-back instead of py-libp2p 0.8.1's AutoNAT v1: its server answers with ``host.connect``, which returns
the connection the asking peer already holds to it, so every peer that can reach a server is told it is reachable -
exactly the peers behind NAT that must learn they are not. Our server dials a *fresh* TCP connection to the asking
peer's observed IP at each port it listens on, completes a Noise handshake to check that the peer id answers there
(a port forwarded to someone else does not count), and closes it again without touching the swarm or peerstore. It
dials only the observed IP of the requester, so nobody can point it at a third party, and it refuses requests that
arrive over relayed connections (the observed address there is the relay's).

A server that does not speak it (a go-libp2p bootstrap) but offers the standard AutoNAT v1 is asked that instead
(net/autonat.py). The request and response are one msgpack frame each (length-prefixed with ``wire.framing``), small and bounded.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgpack
import trio
from libp2p.abc import IHost, INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.pnet.protector import new_protected_conn
from multiaddr import Multiaddr

from ..errors import NetworkError, WireError
from ..wire.framing import encode_frame, read_frame
from .autonat import AUTONAT_PROTOCOL, ask_autonat
from .node import offers_protocol
from .relay import ConnectFn, relay_of

__all__ = [
    "DIALBACK_PROTOCOL",
    "DialBackReply",
    "DialBackRequest",
    "Reachability",
    "ReachabilityReport",
    "check_reachability",
    "dialback_targets",
    "serve_dialback",
]

logger = logging.getLogger(__name__)

DIALBACK_PROTOCOL = TProtocol("/sangama/dialback/1")
MAX_MESSAGE = 4096
MAX_ADDRS = 8
_VERSION = 1


class Reachability(enum.Enum):
    """What dial-back servers found: ``public`` (someone dialled us), ``private`` (nobody could), ``unknown``."""

    PUBLIC = "public"
    PRIVATE = "private"
    UNKNOWN = "unknown"


@dataclass(frozen=True)
class DialBackRequest:
    """Please dial me back at these addresses (only their ports matter: the server substitutes my observed IP)."""

    addrs: tuple[str, ...]

    def encode(self) -> bytes:
        return msgpack.packb({"v": _VERSION, "addrs": list(self.addrs)})

    @classmethod
    def decode(cls, data: bytes) -> DialBackRequest:
        body = _unpack(data)
        addrs = body.get("addrs")
        if not isinstance(addrs, list) or len(addrs) > MAX_ADDRS or not all(isinstance(a, str) for a in addrs):
            raise WireError(f"dial-back request needs at most {MAX_ADDRS} string addresses")
        return cls(tuple(addrs))


@dataclass(frozen=True)
class DialBackReply:
    """Which addresses the server reached (``reached``), all it tried, and an error if it refused the request."""

    reached: tuple[str, ...]
    tried: tuple[str, ...]
    error: str = ""

    def encode(self) -> bytes:
        body = {"v": _VERSION, "reached": list(self.reached), "tried": list(self.tried), "error": self.error}
        return msgpack.packb(body)

    @classmethod
    def decode(cls, data: bytes) -> DialBackReply:
        body = _unpack(data)
        reached, tried, error = body.get("reached"), body.get("tried"), body.get("error", "")
        for name, value in (("reached", reached), ("tried", tried)):
            if not isinstance(value, list) or len(value) > MAX_ADDRS or not all(isinstance(a, str) for a in value):
                raise WireError(f"dial-back reply field {name!r} must list at most {MAX_ADDRS} strings")
        if not isinstance(error, str):
            raise WireError("dial-back reply field 'error' must be a string")
        return cls(tuple(reached), tuple(tried), error)  # type: ignore[arg-type]


def _unpack(data: bytes) -> dict[str, object]:
    try:
        body = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise WireError(f"dial-back message is not msgpack: {exc}") from exc
    if not isinstance(body, dict) or body.get("v") != _VERSION:
        raise WireError(f"dial-back message must be a map with v={_VERSION}")
    return body


@dataclass(frozen=True)
class ReachabilityReport:
    """The verdict, the public addresses that servers reached, and which servers answered."""

    status: Reachability
    public_addrs: tuple[str, ...]
    answered_by: tuple[str, ...]
    errors: tuple[str, ...] = ()
    tried: tuple[str, ...] = ()
    """Every address the servers dialled (our observed IP at each port we asked for)."""

    @property
    def public(self) -> bool:
        return self.status is Reachability.PUBLIC


def dialback_targets(addrs: Sequence[str], observed_ip: str) -> list[str]:
    """The addresses a server dials for a request: the observed IP at each requested TCP port (pure, bounded)."""
    try:
        ip = ipaddress.ip_address(observed_ip)
    except ValueError as exc:
        raise NetworkError(f"observed address {observed_ip!r} is not an IP address") from exc
    family = "ip6" if ip.version == 6 else "ip4"
    ports: list[int] = []
    for addr in addrs[:MAX_ADDRS]:
        if "/p2p-circuit" in addr:
            continue
        try:
            port = int(Multiaddr(addr).value_for_protocol("tcp"))
        except Exception:  # not TCP or not a multiaddr: nothing to dial
            continue
        if 0 < port < 65536 and port not in ports:
            ports.append(port)
    return [f"/{family}/{ip}/tcp/{port}" for port in ports]


async def _read_message(stream: INetStream) -> bytes:
    async def read(n: int) -> bytes:
        try:
            return await stream.read(n)
        except StreamEOF:
            return b""

    data = await read_frame(read, max_frame=MAX_MESSAGE)
    if data is None:
        raise WireError("dial-back stream ended before a message")
    return data


async def _probe(host: IHost, peer_id: ID, addr: str, timeout_s: float) -> bool:
    """Fresh TCP + Noise handshake to ``peer_id`` at ``addr``, then close: can the world reach it there?"""
    network = host.get_network()
    maddr = Multiaddr(addr)
    transport = network.transport_manager.transport_for_dialing(maddr)  # type: ignore[attr-defined]
    if transport is None:
        return False
    raw = None
    try:
        with trio.move_on_after(timeout_s):
            raw = await transport.dial(maddr)
            psk = getattr(network, "psk", None)
            if psk:
                raw = new_protected_conn(raw, psk)
            await network.upgrader.upgrade_security(raw, True, peer_id)  # type: ignore[attr-defined]
            return True
    except Exception as exc:
        logger.debug("dial-back to %s at %s failed: %s", peer_id, addr, exc)
    finally:
        if raw is not None:  # success, failure or timeout: this connection only answered a question
            with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                try:
                    await raw.close()
                except Exception:
                    pass
    return False


@asynccontextmanager
async def serve_dialback(host: IHost, *, timeout_s: float = 3.0, concurrency: int = 8) -> AsyncIterator[None]:
    """Answer dial-back requests while the context is open (bootstrap and relay nodes run this)."""
    limiter = trio.Semaphore(concurrency)

    async def handle(stream: INetStream) -> None:
        peer_id = stream.muxed_conn.peer_id
        try:
            with trio.fail_after(timeout_s + 5.0):
                request = DialBackRequest.decode(await _read_message(stream))
                remote = stream.get_remote_address()
                if relay_of(stream.muxed_conn) is not None or not remote:  # type: ignore[arg-type]
                    reply = DialBackReply((), (), "refused: request came over a relayed connection")
                else:
                    targets = dialback_targets(request.addrs, remote[0])
                    results: dict[str, bool] = {}
                    async with limiter, trio.open_nursery() as nursery:
                        for target in targets:

                            async def run(t: str = target) -> None:
                                results[t] = await _probe(host, peer_id, t, timeout_s)

                            nursery.start_soon(run)
                    reply = DialBackReply(tuple(t for t in targets if results.get(t)), tuple(targets))
                await stream.write(encode_frame(reply.encode(), max_frame=MAX_MESSAGE))
        except (WireError, NetworkError, trio.TooSlowError) as exc:
            logger.debug("dial-back request from %s dropped: %s", peer_id, exc)
        except Exception as exc:  # a broken stream from one peer must not reach the host's handler machinery
            logger.debug("dial-back stream from %s failed: %s", peer_id, exc)
        finally:
            await stream.close()

    host.set_stream_handler(DIALBACK_PROTOCOL, handle)
    try:
        yield
    finally:
        host.remove_stream_handler(DIALBACK_PROTOCOL)


def _own_addrs(host: IHost) -> list[str]:
    out: list[str] = []
    for addr in host.get_addrs():
        text = str(addr)
        if "/p2p-circuit" in text:
            continue
        out.append(text.split("/p2p/")[0])
    return list(dict.fromkeys(out))[:MAX_ADDRS]


async def _ask(
    host: IHost, server: PeerInfo, addrs: list[str], timeout_s: float, connect: ConnectFn
) -> DialBackReply:
    try:
        with trio.fail_after(timeout_s):
            await connect(server)
            stream = await host.new_stream(server.peer_id, [DIALBACK_PROTOCOL])
            try:
                await stream.write(encode_frame(DialBackRequest(tuple(addrs)).encode(), max_frame=MAX_MESSAGE))
                return DialBackReply.decode(await _read_message(stream))
            finally:
                await stream.close()
    except trio.TooSlowError as exc:
        raise NetworkError(f"dial-back server {server.peer_id} did not answer within {timeout_s} s") from exc
    except (NetworkError, WireError):
        raise
    except Exception as exc:
        raise NetworkError(f"dial-back via {server.peer_id} failed: {exc}") from exc


async def check_reachability(
    host: IHost,
    servers: Sequence[PeerInfo],
    *,
    addrs: Sequence[str] | None = None,
    timeout_s: float = 10.0,
    connect: ConnectFn | None = None,
) -> ReachabilityReport:
    """Ask every server in parallel to dial us back (our dial-back, else AutoNAT v1); public if any reached us, private
    if all that answered said no, unknown if none answered.

    ``addrs`` defaults to our own non-relay addresses; ``connect`` reaches a server (default ``host.connect``).
    """
    wanted = list(addrs) if addrs is not None else _own_addrs(host)
    replies: dict[str, DialBackReply] = {}
    errors: list[str] = []

    async def ask(server: PeerInfo) -> None:
        try:
            reply = await _ask(host, server, wanted, timeout_s, connect or host.connect)
        except (NetworkError, WireError) as exc:
            if offers_protocol(host, server.peer_id, AUTONAT_PROTOCOL) is not False:  # maybe a standard AutoNAT server
                await ask_standard(server, str(exc))
            else:
                errors.append(str(exc))
            return
        if reply.error:
            errors.append(f"{server.peer_id}: {reply.error}")
        else:
            replies[str(server.peer_id)] = reply

    async def ask_standard(server: PeerInfo, ours_failed: str) -> None:
        try:
            answer = await ask_autonat(host, server.peer_id, wanted, timeout_s)
        except NetworkError as exc:
            errors.append(f"{ours_failed}; {exc}")
            return
        if answer.reached:
            replies[str(server.peer_id)] = DialBackReply((answer.addr or wanted[0],) if wanted else (), tuple(wanted))
        elif answer.unreachable:
            replies[str(server.peer_id)] = DialBackReply((), tuple(wanted))
        else:
            errors.append(f"{server.peer_id}: AutoNAT gave no verdict (status {answer.status}: {answer.text})")

    async with trio.open_nursery() as nursery:
        for server in servers:
            nursery.start_soon(ask, server)
    reached = tuple(dict.fromkeys(a for r in replies.values() for a in r.reached))
    if reached:
        status = Reachability.PUBLIC
    elif replies:
        status = Reachability.PRIVATE
    else:
        status = Reachability.UNKNOWN
    tried = tuple(dict.fromkeys(a for r in replies.values() for a in r.tried))
    return ReachabilityReport(status, reached, tuple(replies), tuple(errors), tried)
