"""``open_host``: a py-libp2p host with Sangama's choices made once, and the ``Node`` other modules hook into.

Choices (see ``/work/shared/notes/py-libp2p-0.8.1.md`` for the measurements behind them):

* TCP + Noise + Yamux only. A default py-libp2p host also accepts plaintext and secio; we pass a Noise-only
  ``sec_opt`` and a Yamux-only ``muxer_opt``. With a fleet secret only plain TCP listen addresses are accepted
  (QUIC's own TLS bypasses the private-network layer), and every configured listen address must really be listened
  on (py-libp2p skips unknown ones silently).
* A resource manager that counts connections and streams but never refuses a peer for the memory its process uses
  (a serving peer holds gigabytes of weights by design).
* Listen and announce addresses are separate. Announced addresses are advertised first and :meth:`Node.connect`
  dials a peer's addresses itself, in the order the peer advertised them (public first), one at a time. It does not
  go through py-libp2p's dialer, which tries at most one address per transport, drops loopback addresses once it
  knows any other, loses the dialled address from the peerstore, waits a fixed 250 ms per dial, and blocks a peer
  for 60 s after a failure.

Extension points for relays and hole punching (``net/relay.py``): ``Node.nursery`` runs background tasks for the
node's lifetime, ``Node.extra_addrs`` are advertised after the direct addresses (e.g. ``/p2p-circuit`` ones),
``Node.fallback_dialers`` are tried in order by :meth:`Node.connect` when no direct address works, and
``Node.dial_failed`` callbacks hear of every peer :meth:`Node.connect` could not reach (the DHT forgets it).
Services passed to :func:`open_host` start after the host listens and the DHT runs, and before bootstrap.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost, INetConn
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from libp2p.rcmgr import ResourceLimits, new_resource_manager
from libp2p.rcmgr.memory_limits import MemoryConnectionLimits
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream
from libp2p.transport.exceptions import OpenConnectionError, SecurityUpgradeFailure
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.utils.address_validation import expand_wildcard_address

from ..errors import ListenError, NetworkError, group_leaves
from .config import HostConfig, parse_multiaddrs
from .fleet import mismatch_error, psk_from_secret
from .identity import default_key_path, load_or_create_key_pair, lock_key_file, wrong_peer_id

if TYPE_CHECKING:
    from libp2p.kad_dht.kad_dht import KadDHT

__all__ = [
    "FRAME_WINDOW",
    "Dialer",
    "check_fleet_transports",
    "check_listening",
    "Node",
    "check_ports_free",
    "is_relayed",
    "offers_protocol",
    "open_host",
    "order_addrs",
    "remote_addr",
    "widen_receive_window",
]

log = logging.getLogger(__name__)


def offers_protocol(host: Any, peer_id: Any, protocol: object) -> bool | None:
    """Whether identify lists ``protocol`` for ``peer_id``; ``None`` while nobody knows (not identified yet)."""
    try:
        protocols = host.get_peerstore().get_protocols(peer_id)
    except Exception:  # not in the peerstore (yet)
        return None
    if not protocols:
        return None
    return str(protocol) in {str(p) for p in protocols}

Dialer = Callable[["Node", ID, list[multiaddr.Multiaddr]], Awaitable[INetConn]]
Service = Callable[["Node"], Awaitable[Any]]
_ADDR_TTL = 3600  # seconds a peer's dialled addresses stay in our peerstore
# Site-local ranges: dialled after public ones. Documentation and benchmark ranges (198.18/15, 203.0.113/24, ...)
# count as public on purpose: network-namespace tests use them as "the internet".
_LOCAL_NETS = tuple(
    ipaddress.ip_network(n) for n in ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")
)


class Node:
    """A running host and what other modules need from it; built by :func:`open_host`, never directly."""

    def __init__(self, host: IHost, config: HostConfig, key_pair: KeyPair, nursery: trio.Nursery) -> None:
        self.host = host
        self.config = config
        self.key_pair = key_pair
        self.nursery = nursery
        self.dht: KadDHT | None = None
        self.extra_addrs: list[multiaddr.Multiaddr] = []
        self.dead_announced: set[str] = set()
        """Announced addresses a dial-back found nobody answering on (net/traversal.py): left out of what we advertise."""
        self.fallback_dialers: list[Dialer] = []
        self.dial_failed: list[Callable[[ID], None]] = []
        self._dialing: dict[ID, trio.Event] = {}
        self._route_library_dials()

    def _route_library_dials(self) -> None:
        """Make py-libp2p's own dials (DHT queries, identify, relays) go through :meth:`connect`.

        The swarm's ``dial_peer`` waits a fixed 250 ms per dial and mishandles announced addresses (see the module
        docstring); replacing it on this one instance gives every dial the same address order and timeouts.
        """
        swarm = self.host.get_network()

        async def dial_peer(peer_id: ID) -> list[INetConn]:
            try:
                return [await self.connect(peer_id)]
            except NetworkError as exc:
                raise SwarmException(str(exc)) from exc

        swarm.dial_peer = dial_peer  # type: ignore[method-assign]

    @property
    def peer_id(self) -> ID:
        return self.host.get_id()

    def advertised_addrs(self) -> list[multiaddr.Multiaddr]:
        """What other peers should dial: announced (public) addresses first, then relay circuit addresses, each
        ending in ``/p2p/<id>``."""
        direct = list(self.host.get_addrs())
        seen = {str(a) for a in direct}
        return direct + [a for a in self.extra_addrs if str(a) not in seen]

    def listen_addrs(self) -> list[multiaddr.Multiaddr]:
        """Where the host actually listens (real ports, no ``/p2p``)."""
        return list(self.host.get_transport_addrs())

    def connections(self, peer_id: ID) -> list[INetConn]:
        """Open connections to ``peer_id``."""
        return [c for c in self.host.get_network().get_connections(peer_id) if not c.is_closed]

    async def connect(self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr] = ()) -> INetConn:
        """A connection to ``peer_id``: an open one, else the first of ``addrs`` (then known ones) that answers.

        Addresses (the given ones, then the peerstore's) are raced happy-eyeballs style by :func:`.dial.race_addrs`:
        announced public, observed public, private, then ``/p2p-circuit`` through the fallback dialers (relays),
        each attempt bounded by its own timeout. Raises :class:`NetworkError` naming every failure.
        """
        if peer_id == self.peer_id:
            raise NetworkError("refusing to dial ourselves")
        while peer_id in self._dialing:  # one dial per peer at a time; later callers share its result
            await self._dialing[peer_id].wait()
        for conn in self.connections(peer_id):
            return conn
        self._dialing[peer_id] = trio.Event()
        try:
            return await self._connect(peer_id, addrs)
        except NetworkError:
            for callback in list(self.dial_failed):
                callback(peer_id)
            raise
        finally:
            self._dialing.pop(peer_id).set()

    async def _connect(self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr]) -> INetConn:
        from .dial import DialPolicy, race_addrs  # local: dial imports this module

        peerstore = self.host.get_peerstore()
        known = list(peerstore.addrs(peer_id)) if peer_id in peerstore.peer_ids() else []
        given = [_strip_p2p(a) for a in addrs]
        others = [_strip_p2p(a) for a in known]
        candidates = order_addrs([*given, *others])
        if candidates:
            peerstore.add_addrs(peer_id, candidates, _ADDR_TTL)
        policy = DialPolicy(direct_timeout_s=self.config.handshake_timeout + 0.5)  # _dial_direct's own error first
        return await race_addrs(self, peer_id, given, others, policy)

    async def connect_multiaddr(self, addr: str | multiaddr.Multiaddr) -> ID:
        """Connect to a ``.../p2p/<id>`` address (e.g. a bootstrap node) and return the peer id."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(str(addr)))
        except Exception as exc:
            raise NetworkError(f"bad peer address {addr!r} (it must end in /p2p/<peer id>): {exc}") from exc
        await self.connect(info.peer_id, info.addrs)
        return info.peer_id

    async def _dial_direct(self, peer_id: ID, addr: multiaddr.Multiaddr) -> INetConn:
        swarm = self.host.get_network()
        timeout = self.config.handshake_timeout
        with trio.move_on_after(timeout):
            try:
                conn = await swarm.dial_addr(addr, peer_id)
                await conn.event_started.wait()
            except Exception as exc:  # SwarmException and transport errors
                actual = wrong_peer_id(exc)
                if actual is not None:  # Noise completed and proved another identity: the address names the wrong id
                    raise NetworkError(f"{addr} answered as peer {actual}, not {peer_id}: the /p2p/<id> in the address "
                                       f"is wrong (if that node is the one meant, use /p2p/{actual})") from exc
                if _security_failed(exc):  # TCP opened, Noise negotiation read garbage: a PSK mismatch
                    have = self.config.fleet_secret is not None
                    raise mismatch_error(str(peer_id), str(addr), timeout, have_secret=have) from exc
                cause = exc.__cause__ or exc
                raise NetworkError(f"cannot connect to {peer_id} at {addr}: {cause}") from exc
            negative_cache = getattr(swarm, "_negative_peer_cache", None)
            if negative_cache is not None:
                negative_cache.evict(str(peer_id))  # a stale 60 s block must not hide a live connection
            return conn
        raise mismatch_error(str(peer_id), str(addr), timeout, have_secret=self.config.fleet_secret is not None)


FRAME_WINDOW = 16 * 1024 * 1024  # bytes a frame stream may have in flight towards us (py-libp2p's maximum)


async def widen_receive_window(stream: Any, size: int = FRAME_WINDOW) -> None:
    """Let the peer send up to ``size`` bytes on ``stream`` before it must wait for us to read.

    Yamux starts every stream with a 256 KiB window, and py-libp2p 0.8.1's writer polls every 10 ms once the window
    is used up, so a 1 MiB hidden-state frame stalls several times per send. Call this on each end of a long-lived
    frame stream right after opening or accepting it: it grants the peer the whole window at once. Streams of
    other muxers are left alone.
    """
    muxed = getattr(stream, "muxed_stream", stream)
    if not isinstance(muxed, YamuxStream):
        return
    async with muxed.window_lock:
        increment = size - muxed.recv_window
        if increment <= 0:
            return
        muxed.recv_window += increment
        muxed.target_recv_window = max(muxed.target_recv_window, size)
    await muxed.send_window_update(increment)


def _security_failed(exc: BaseException | None) -> bool:
    """True if a dial failed after its TCP connection opened, in the security upgrade (as a wrong fleet secret does).

    With different pre-shared keys the first bytes each side reads are garbage, so the failure shows up in
    several ways (a failed negotiation, an empty read, a MemoryError from a garbage length); what they share is that the TCP connect
    itself succeeded and the peer's identity was never checked.
    """
    chain = []
    while exc is not None and len(chain) < 16:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    if any(isinstance(e, OpenConnectionError) for e in chain):
        return False  # TCP never connected: unreachable, not a secret mismatch
    if any("Peer ID mismatch" in str(e) for e in chain):
        return False  # Noise completed and proved another identity
    garbage_signs = (SecurityUpgradeFailure, MultiselectClientError, ValueError, EOFError, MemoryError)
    return any(isinstance(e, garbage_signs) for e in chain)


def order_addrs(addrs: Any) -> list[multiaddr.Multiaddr]:
    """Deduplicate, keeping the given order within each class: public, then private, then loopback, then relayed.

    The order a peer advertised is kept inside each class, so its announced public addresses stay first.
    """
    seen: set[str] = set()
    unique = []
    for addr in addrs:
        if str(addr) not in seen:
            seen.add(str(addr))
            unique.append(addr)
    return sorted(unique, key=_addr_rank)  # sorted() is stable


def _addr_rank(addr: multiaddr.Multiaddr) -> int:
    if is_relayed(addr):
        return 3
    for proto in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(addr.value_for_protocol(proto))
        except Exception:
            continue
        if ip.is_loopback:
            return 2
        return 1 if ip.is_link_local or any(ip in net for net in _LOCAL_NETS if net.version == ip.version) else 0
    return 0  # dns names: assume public


def is_relayed(addr: multiaddr.Multiaddr) -> bool:
    """True for ``/p2p-circuit`` addresses (reachable only through a relay)."""
    return "/p2p-circuit" in str(addr)


def remote_addr(conn: INetConn) -> tuple[str, int] | None:
    """The (ip, port) at the far end of a connection, or None for relayed/unknown ones."""
    muxed = getattr(conn, "muxed_conn", None)
    getter = getattr(muxed, "get_remote_address", None)
    return getter() if getter is not None else None


def _strip_p2p(addr: multiaddr.Multiaddr) -> multiaddr.Multiaddr:
    addr = multiaddr.Multiaddr(str(addr))
    text = str(addr)
    if is_relayed(addr):
        return addr
    idx = text.rfind("/p2p/")
    return multiaddr.Multiaddr(text[:idx]) if idx > 0 else addr


def _build_host(config: HostConfig, key_pair: KeyPair, node_ref: list[Node]) -> IHost:
    listen = parse_multiaddrs(config.listen_addrs, what="listen_addrs")
    announce = parse_multiaddrs(config.announce_addrs, what="announce_addrs")

    def advertise(candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        dead = node_ref[0].dead_announced if node_ref else set()
        alive = [a for a in announce if str(a) not in dead]  # all announced dead: advertise as if none were set
        if alive:
            base = alive
        else:
            base = []
            for addr in candidates:
                base.extend(expand_wildcard_address(addr) if _is_wildcard(addr) else [addr])
        # extra (/p2p-circuit) addresses are NOT routed through here: py-libp2p's get_addrs cuts every address at its
        # first /p2p/ and appends our id, which would turn <relay>/p2p/R/p2p-circuit/p2p/US into <relay>/p2p/US.
        # Node.advertised_addrs appends them intact instead.
        return base if alive else order_addrs(base)

    limits = config.limits
    resource_manager = new_resource_manager(
        limits=ResourceLimits(max_connections=limits.max_connections, max_streams=limits.max_streams),
        memory_limits=MemoryConnectionLimits(max_process_memory_percent=100.0, max_system_memory_percent=100.0),
        enable_circuit_breaker=False,  # five refusals would otherwise block all connections for 60 s
        enable_graceful_degradation=False,
        enable_memory_pooling=False,
    )
    timeout = config.handshake_timeout
    connection_config = ConnectionConfig(
        max_connections=limits.max_connections,
        min_connections=0,
        low_watermark=0,  # no auto-connector churn: Sangama decides whom to dial
        high_watermark=limits.max_connections,
        max_connections_per_peer=limits.max_connections_per_peer,
        dial_timeout=timeout,
        inbound_upgrade_timeout=timeout,
        outbound_upgrade_timeout=timeout,
    )
    try:
        host = new_host(
            key_pair=key_pair,
            sec_opt={NOISE_PROTOCOL_ID: NoiseTransport(key_pair, noise_privkey=new_x25519_key_pair().private_key)},
            muxer_opt={YAMUX_PROTOCOL_ID: Yamux},
            listen_addrs=listen,
            addrs_factory=advertise,
            resource_manager=resource_manager,
            connection_config=connection_config,
            psk=psk_from_secret(config.fleet_secret) if config.fleet_secret is not None else None,
        )
    except Exception as exc:
        raise NetworkError(f"cannot create libp2p host: {exc}") from exc
    host.get_network().retry_config = RetryConfig(max_retries=0)  # Node.connect walks the addresses itself
    return host


def check_ports_free(listen_addrs: Sequence[str]) -> None:
    """Refuse a fixed TCP listen port that another socket already listens on, with a :class:`NetworkError`.

    py-libp2p 0.8.1 listens with SO_REUSEPORT (hole punching dials from the listen port), so a second node on a busy
    port starts without a word and the kernel then splits incoming connections between the two. A plain bind
    (SO_REUSEADDR only, which passes TIME_WAIT leftovers) fails on a port somebody listens on. Port 0 (any free
    port) and non-TCP addresses are not checked.
    """
    for addr in listen_addrs:
        parts = str(addr).strip("/").split("/")
        if len(parts) < 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp" or not parts[3].isdigit():
            continue
        port = int(parts[3])
        if port == 0:
            continue
        family = socket.AF_INET if parts[0] == "ip4" else socket.AF_INET6
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((parts[1], port))
            except OSError as exc:
                raise NetworkError(f"cannot listen on {addr}: {exc.strerror or exc} (another sangama-peer on this "
                                   "machine? pick another port, or tcp/0 for any free one)") from exc


def check_fleet_transports(listen_addrs: Sequence[str], *, fleet_secret: bool) -> None:
    """With a fleet secret, refuse (:class:`ListenError`) every listen address but plain TCP.

    py-libp2p 0.8.1 applies the private-network layer in the swarm's raw-connection upgrade; its QUIC transport
    secures connections with its own TLS and never passes through it, so a private fleet listening on
    ``/udp/N/quic-v1`` let in nodes without the secret (issue 15, item 3). Only ``/ip4|ip6/<ip>/tcp/<port>`` is
    known to go through the layer, so nothing else is allowed while a secret is set.
    """
    if not fleet_secret:
        return
    for addr in listen_addrs:
        parts = str(addr).strip("/").split("/")
        if len(parts) != 4 or parts[0] not in ("ip4", "ip6") or parts[2] != "tcp":
            raise ListenError(f"cannot listen on {addr} in a private fleet: only plain TCP addresses "
                              "(/ip4/<ip>/tcp/<port>, /ip6/...) go through the fleet secret's layer; QUIC, WebSocket "
                              "and others would let in peers without the secret")


def check_listening(configured: Sequence[str], actual: Sequence[multiaddr.Multiaddr]) -> None:
    """Every configured listen address has a listener (:class:`ListenError` naming those without one).

    py-libp2p 0.8.1 skips, with only a log line, an address no transport handles (``/ip4/127.0.0.1/udp/5000``):
    the node would start and be unreachable. Port 0 matches any port; everything else must match exactly.
    """
    have = [str(a).strip("/").split("/") for a in actual]

    def matches(want: list[str], got: list[str]) -> bool:
        return len(want) == len(got) and all(
            w == g or (i > 0 and want[i - 1] in ("tcp", "udp") and w == "0") for i, (w, g) in enumerate(zip(want, got)))

    missing = [str(a) for a in configured if not any(matches(str(a).strip("/").split("/"), g) for g in have)]
    if missing:
        raise ListenError(f"not listening on {', '.join(missing)}: no transport took it (listening on "
                          f"{', '.join(str(a) for a in actual) or 'nothing'}); use /ip4/<ip>/tcp/<port>")


def _is_wildcard(addr: multiaddr.Multiaddr) -> bool:
    return "/ip4/0.0.0.0/" in str(addr) or "/ip6/::/" in str(addr)


@asynccontextmanager
async def open_host(
    config: HostConfig,
    *,
    key_pair: KeyPair | None = None,
    services: Sequence[Service] = (),
) -> AsyncIterator[Node]:
    """Run a node for the duration of the ``async with`` block.

    Starts the host on ``config.listen_addrs``, the Kademlia DHT (server mode when ``config.dht_server``), the
    given ``services`` (each ``await service(node)`` runs in the node's nursery), then connects to the bootstrap
    addresses. If bootstrap addresses are configured and none answers, raises :class:`NetworkError`; so does a fixed
    TCP listen port that another socket already listens on (:func:`check_ports_free`). A listen address that is
    not plain TCP while a fleet secret is set (:func:`check_fleet_transports`), or that the host did not actually
    listen on (:func:`check_listening`), raises :class:`~sangama_p2p.errors.ListenError`.
    """
    from .dht import bootstrap, run_dht  # local: dht imports this module

    key_path = (config.key_path or default_key_path()) if key_pair is None else None
    key_pair = key_pair or load_or_create_key_pair(config.key_path)
    if config.batch_window_updates:
        os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")  # see HostConfig.batch_window_updates
    check_fleet_transports(config.listen_addrs, fleet_secret=config.fleet_secret is not None)
    check_ports_free(config.listen_addrs)  # before any host exists: py-libp2p would share the port silently
    node_ref: list[Node] = []
    host = _build_host(config, key_pair, node_ref)
    listen = parse_multiaddrs(config.listen_addrs, what="listen_addrs")
    key_lock = lock_key_file(key_path) if key_path is not None else None  # one running peer per key file
    try:
        async with host.run(listen), trio.open_nursery() as nursery:
            check_listening(config.listen_addrs, host.get_transport_addrs())
            node = Node(host, config, key_pair, nursery)
            node_ref.append(node)
            await nursery.start(run_dht, node)
            for service in services:
                nursery.start_soon(service, node)
            if config.bootstrap_addrs:
                await bootstrap(node, config.bootstrap_addrs)
            try:
                yield node
            finally:
                nursery.cancel_scope.cancel()
                await _close_connections(host)
    except BaseExceptionGroup as group:
        # trio wraps errors that cross a nursery; callers get the one error that happened, unwrapped
        leaf = _single_leaf(group)
        if leaf is None:
            raise
        raise leaf  # keeps its own __cause__ (``from None`` would erase it)
    except OSError as exc:
        raise NetworkError(f"cannot listen on {list(config.listen_addrs)}: {exc}") from exc
    finally:
        if key_lock is not None:
            key_lock.close()


async def _close_connections(host: IHost) -> None:
    """Close every connection before the host stops, so that peers see us leave.

    py-libp2p 0.8.1's ``host.run`` only cancels the swarm's tasks: the sockets of an in-process node that closes stay
    open, and its peers keep a connection that looks established and dial nothing when they next ask it something.
    """
    with trio.CancelScope(shield=True), trio.move_on_after(2.0):
        try:
            await host.get_network().close()
        except Exception as exc:  # best effort: the node is going away either way
            log.debug("closing connections: %s", exc)


def _single_leaf(group: BaseExceptionGroup) -> BaseException | None:
    """The only non-Cancelled exception inside ``group`` (nested groups included), or None if there are several."""
    leaves = [exc for exc in group_leaves(group) if not isinstance(exc, trio.Cancelled)]
    if len(leaves) != 1:
        return None
    if isinstance(leaves[0], OSError):
        return NetworkError(f"network error: {leaves[0]}")
    return leaves[0]
