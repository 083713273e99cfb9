"""``open_host``: a py-libp2p host with Sangama's choices made once, composed with its DHT and services into a running
:class:`~sangama_p2p.net.node.Node`.

Choices (each with the py-libp2p 0.8.1 behaviour behind it; speeds in docs/benchmarks.md, "Network"):

* TCP + Noise + Yamux only. A default py-libp2p host also accepts plaintext and secio; we pass a Noise-only
  ``sec_opt`` and a Yamux-only ``muxer_opt``. With a fleet secret only plain TCP listen addresses are accepted
  (QUIC's own TLS bypasses the private-network layer), and every configured listen address must really be listened
  on (py-libp2p skips unknown ones silently).
* A resource manager that counts connections and streams but never refuses a peer for the memory its process uses
  (a serving peer holds gigabytes of weights by design).
* Listen and announce addresses are separate (``net/node.py`` says how a node dials).
* No auto-connector (:class:`_NoAutoConnector`): Sangama dials the peers it needs, nobody else.

This is where the network's pieces meet: the host, the node that dials with :func:`.dial.race_addrs`, the DHT
(``net/dht.py``) and bootstrap. Services passed to :func:`open_host` start after the host listens and the DHT runs,
and before bootstrap.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.keys import KeyPair
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.network.auto_connector import AutoConnector
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.rcmgr import ResourceLimits, new_resource_manager
from libp2p.rcmgr.memory_limits import MemoryConnectionLimits
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.stream_muxer.yamux.yamux import PROTOCOL_ID as YAMUX_PROTOCOL_ID
from libp2p.stream_muxer.yamux.yamux import Yamux, YamuxStream
from libp2p.utils.address_validation import expand_wildcard_address

from ..errors import ListenError, NetworkError, group_leaves
from .addrs import is_wildcard, order_addrs
from .config import HostConfig, parse_multiaddrs
from .dht import bootstrap, run_dht
from .dial import DialPolicy, race_addrs
from .fleet import psk_from_secret
from .identity import default_key_path, load_or_create_key_pair, lock_key_file
from .node import Node
from .rejoin import keep_bootstrap

__all__ = [
    "FRAME_WINDOW",
    "Service",
    "check_fleet_transports",
    "check_listening",
    "check_ports_free",
    "open_host",
    "widen_receive_window",
]

log = logging.getLogger(__name__)

Service = Callable[[Node], Awaitable[Any]]


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


class _NoAutoConnector(AutoConnector):
    """py-libp2p's auto-connector, never dialling.

    py-libp2p 0.8.1's swarm always starts an ``AutoConnector`` (``Swarm.run``), which every 30 s, and after
    disconnects, dials peerstore peers until the connection count reaches the midpoint of ``low_watermark`` and
    ``high_watermark``: with ``low_watermark=0`` and ``high_watermark=max_connections`` (512) that is 256, so it
    dialled every peer that ever connected ("initiating 253 new dials" every ~12 s under client churn; departed
    clients included, each again after at most 5 min). No watermark turns it off: the pruner closes connections down to ``low_watermark``
    once ``high_watermark`` is passed, so ``high_watermark=0`` would close every connection. Replacing the instance
    before the swarm runs is the one switch; the peers a node needs (bootstrap nodes, next stages, DHT servers for
    a lookup) are dialled by Sangama's own code when it needs them.
    """

    async def run_background_task(self, nursery: trio.Nursery) -> None:
        return None

    async def maybe_connect(self) -> None:
        return None


def _build_host(config: HostConfig, key_pair: KeyPair, dead_announced: set[str]) -> IHost:
    """``dead_announced``: announced addresses a dial-back found dead (the Node's set, filled by net/traversal.py)."""
    listen = parse_multiaddrs(config.listen_addrs, what="listen_addrs")
    announce = parse_multiaddrs(config.announce_addrs, what="announce_addrs")

    def advertise(candidates: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        alive = [a for a in announce if str(a) not in dead_announced]  # all dead: advertise as if none were set
        if alive:
            base = alive
        else:
            base = []
            for addr in candidates:
                base.extend(expand_wildcard_address(addr) if is_wildcard(addr) else [addr])
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
        low_watermark=0,  # the pruner's floor; the auto-connector is replaced (_NoAutoConnector)
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
    swarm = host.get_network()
    swarm.retry_config = RetryConfig(max_retries=0)  # Node.connect walks the addresses itself
    swarm.auto_connector = _NoAutoConnector(swarm)  # type: ignore[attr-defined]  # before host.run starts it
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
    key_path = (config.key_path or default_key_path()) if key_pair is None else None
    key_pair = key_pair or load_or_create_key_pair(config.key_path)
    if config.batch_window_updates:
        os.environ.setdefault("PY_YAMUX_RELEASE_ON_READ", "0")  # see HostConfig.batch_window_updates
    check_fleet_transports(config.listen_addrs, fleet_secret=config.fleet_secret is not None)
    check_ports_free(config.listen_addrs)  # before any host exists: py-libp2p would share the port silently
    dead_announced: set[str] = set()
    host = _build_host(config, key_pair, dead_announced)
    listen = parse_multiaddrs(config.listen_addrs, what="listen_addrs")
    key_lock = lock_key_file(key_path) if key_path is not None else None  # one running peer per key file
    try:
        async with host.run(listen), trio.open_nursery() as nursery:
            check_listening(config.listen_addrs, host.get_transport_addrs())
            policy = DialPolicy(direct_timeout_s=config.handshake_timeout + 0.5)  # _dial_direct's own error first
            node = Node(host, config, key_pair, nursery, race=partial(race_addrs, policy=policy),
                        dead_announced=dead_announced)
            await nursery.start(run_dht, node)
            for service in services:
                nursery.start_soon(service, node)
            if config.bootstrap_addrs:
                await bootstrap(node, config.bootstrap_addrs)
                nursery.start_soon(keep_bootstrap, node, config.bootstrap_addrs)  # reconnected when they drop
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
