"""``Node``: a running py-libp2p host and what the rest of ``net/`` hooks into; :func:`sangama_p2p.net.host.open_host`
builds it.

Listen and announce addresses are separate. Announced addresses are advertised first and :meth:`Node.connect`
dials a peer's addresses itself, in the order the peer advertised them (public first), raced by the dialler
``open_host`` gives it (:func:`sangama_p2p.net.dial.race_addrs`). It does not go through py-libp2p's dialer, which
tries at most one address per transport, drops loopback addresses once it knows any other, loses the dialled
address from the peerstore, waits a fixed 250 ms per dial, and blocks a peer for 60 s after a failure.

Extension points for relays and hole punching (``net/relay.py``, ``net/traversal.py``): ``Node.nursery`` runs
background tasks for the node's lifetime, ``Node.extra_addrs`` are advertised after the direct addresses (e.g.
``/p2p-circuit`` ones), ``Node.fallback_dialers`` are tried in order by :meth:`Node.connect` when no direct address
works, ``Node.dial_failed`` callbacks hear of every peer :meth:`Node.connect` could not reach (the DHT forgets
it), and ``Node.bootstrap_back`` callbacks of every bootstrap node reconnected after it was lost (``net/rejoin.py``).

A peer that failed to answer is not dialled again for a while (``Node.backoff``, :mod:`.backoff`: 5 s doubling to
10 min, and a budget of retries a minute shared by all such peers), whoever asks - py-libp2p's lookups or our own
callers. Only ``explicit`` dials skip the check (see :meth:`Node.connect`).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import multiaddr
import trio
from libp2p.abc import IHost, INetConn, INetStream, INetwork, INotifee
from libp2p.crypto.keys import KeyPair
from libp2p.network.exceptions import SwarmException
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.protocol_muxer.exceptions import MultiselectClientError
from libp2p.transport.exceptions import OpenConnectionError, SecurityUpgradeFailure

from .. import clock
from ..errors import NetworkError, PeerBackedOff, SangamaError, describe, translate
from .addrs import is_relayed, order_addrs, strip_p2p
from .backoff import DialBackoff
from .config import HostConfig
from .fleet import mismatch_error
from .identity import wrong_peer_id

if TYPE_CHECKING:
    from libp2p.kad_dht.kad_dht import KadDHT

__all__ = ["Dialer", "Node", "Race", "offers_protocol"]


def offers_protocol(host: Any, peer_id: Any, protocol: object) -> bool | None:
    """Whether identify lists ``protocol`` for ``peer_id``; ``None`` while nobody knows (not identified yet)."""
    try:
        protocols = host.get_peerstore().get_protocols(peer_id)
    except KeyError:  # PeerStoreError: not in the peerstore (yet)
        return None
    if not protocols:
        return None
    return str(protocol) in {str(p) for p in protocols}


Dialer = Callable[["Node", ID, list[multiaddr.Multiaddr]], Awaitable[INetConn]]
Race = Callable[["Node", ID, Sequence[multiaddr.Multiaddr], Sequence[multiaddr.Multiaddr]], Awaitable[INetConn]]
"""How :meth:`Node.connect` races a peer's addresses: ``race(node, peer_id, given, known)``."""
_ADDR_TTL = 3600  # seconds a peer's dialled addresses stay in our peerstore
CANCELLED_IS_FAILURE_S = 1.0  # a dial its caller gave up on after this long, with no connection, counts as failed
log = logging.getLogger(__name__)


class Node:
    """A running host and what other modules need from it; built by :func:`~sangama_p2p.net.host.open_host`, never
    directly."""

    def __init__(self, host: IHost, config: HostConfig, key_pair: KeyPair, nursery: trio.Nursery, race: Race,
                 dead_announced: set[str] | None = None, backoff: DialBackoff | None = None) -> None:
        self.host = host
        self.config = config
        self.key_pair = key_pair
        self.nursery = nursery
        self._race = race
        self.dht: KadDHT | None = None
        self.extra_addrs: list[multiaddr.Multiaddr] = []
        self.dead_announced: set[str] = set() if dead_announced is None else dead_announced
        """Announced addresses a dial-back found nobody answering on (net/traversal.py): left out of what we
        advertise (the host's address function reads this same set)."""
        self.fallback_dialers: list[Dialer] = []
        self.dial_failed: list[Callable[[ID], None]] = []
        self.circuit_guesses: list[Callable[[ID], list[multiaddr.Multiaddr]]] = []
        """Circuit addresses to try for a peer of whom no ``/p2p-circuit`` address is known (net/traversal.py: through
        the relays we know). A NATed peer found as a DHT provider comes with its private addresses only - go-libp2p
        nodes store and return no circuit address - so without a guess nobody could reach it."""
        self.bootstrap_back: list[Callable[[ID], None]] = []
        """Called with a bootstrap node's id when it is connected again after it was lost (``net/rejoin.py``): the
        announcer re-publishes its records to it at once."""
        self._dialing: dict[ID, trio.Event] = {}
        self.backoff = DialBackoff() if backoff is None else backoff
        """Peers that failed to answer, and when they may be dialled again (:mod:`.backoff`)."""
        self._configured = _peer_ids(config.bootstrap_addrs)
        """Configured bootstrap nodes: the user named them, so every dial of one counts as explicit."""
        self._route_library_dials()
        host.get_network().register_notifee(_ClearOnConnect(self))

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

    def serve(self, protocol: str, handler: Callable[[INetStream], Awaitable[None]]) -> None:
        """Answer every stream of ``protocol`` a peer opens with ``handler(stream)``."""
        self.host.set_stream_handler(protocol, handler)  # type: ignore[arg-type]

    def stop_serving(self, protocol: str) -> None:
        """Stop answering ``protocol``; never raises."""
        self.host.remove_stream_handler(protocol)  # type: ignore[arg-type]  # a dict pop: cannot fail

    def connections(self, peer_id: ID) -> list[INetConn]:
        """Open connections to ``peer_id``."""
        return [c for c in self.host.get_network().get_connections(peer_id) if not c.is_closed]

    async def connect(self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr] = (), *,
                      explicit: bool = False) -> INetConn:
        """A connection to ``peer_id``: an open one, else the first of ``addrs`` (then known ones) that answers.

        Addresses (the given ones, then the peerstore's) are raced happy-eyeballs style (:func:`.dial.race_addrs`):
        announced public, observed public, private, then ``/p2p-circuit`` through the fallback dialers (relays),
        each attempt bounded by its own timeout. Raises :class:`NetworkError` naming every failure.

        A peer in its backoff (it failed to answer recently, :attr:`backoff`) is not dialled: :class:`PeerBackedOff`
        at once. ``explicit``: a dial the user drives (a client chaining a stage from a live serving record) skips
        that check, as every dial of a configured bootstrap node does (a bounded set the user named, which
        reconnecting callers pace themselves); its outcome still counts. A dial that its caller cancels after
        ``CANCELLED_IS_FAILURE_S`` without a connection counts as failed (py-libp2p's DHT queries give up after 5 s,
        before the dial's own timeout).
        """
        if peer_id == self.peer_id:
            raise NetworkError("refusing to dial ourselves")
        while peer_id in self._dialing:  # one dial per peer at a time; later callers share its result
            await self._dialing[peer_id].wait()
        for conn in self.connections(peer_id):
            return conn
        if not explicit and peer_id not in self._configured:
            wait = self.backoff.admit(peer_id)
            if wait > 0:
                raise PeerBackedOff(f"{peer_id} failed to answer {self.backoff.failures(peer_id)} time(s): not dialled "
                                    f"again for {wait:.0f} s", wait)
        self._dialing[peer_id] = trio.Event()
        started = clock.now()
        outcome = "cancelled"  # or an error that is not ours: either way the caller stopped waiting
        try:
            conn = await self._connect(peer_id, addrs)
            outcome = "ok"
        except NetworkError:
            outcome = "failed"
            raise
        finally:
            self._dialing.pop(peer_id).set()
            if outcome == "ok" or self.connections(peer_id):
                self.backoff.succeeded(peer_id)
            elif outcome == "failed" or clock.now() - started >= CANCELLED_IS_FAILURE_S:
                self._dial_failed(peer_id)
        return conn

    def _dial_failed(self, peer_id: ID) -> None:
        wait = self.backoff.failed(peer_id)
        log.debug("%s did not answer: not dialled again for %.0f s", peer_id, wait)
        for callback in list(self.dial_failed):
            callback(peer_id)

    async def _connect(self, peer_id: ID, addrs: Sequence[multiaddr.Multiaddr]) -> INetConn:
        peerstore = self.host.get_peerstore()
        known = list(peerstore.addrs(peer_id)) if peer_id in peerstore.peer_ids() else []
        given = [strip_p2p(a) for a in addrs]
        others = [strip_p2p(a) for a in known]
        candidates = order_addrs([*given, *others])
        if candidates:
            peerstore.add_addrs(peer_id, candidates, _ADDR_TTL)
        if not any(is_relayed(a) for a in candidates):  # guesses are tried last (dial.plan's order), never stored
            for guess in self.circuit_guesses:
                others.extend(guess(peer_id))
        return await self._race(self, peer_id, given, others)

    async def connect_multiaddr(self, addr: str | multiaddr.Multiaddr, *, explicit: bool = True) -> ID:
        """Connect to a ``.../p2p/<id>`` address (e.g. a bootstrap node) and return the peer id.

        ``explicit`` (default): a configured address, dialled even while the peer is in its backoff."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(str(addr)))
        except Exception as exc:  # multiaddr's parse errors, and libp2p's for a missing or bad /p2p/ part
            raise translate(exc, NetworkError, f"bad peer address {addr!r} (it must end in /p2p/<peer id>)")
        await self.connect(info.peer_id, info.addrs, explicit=explicit)
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
                if isinstance(exc, SangamaError):
                    raise
                raise NetworkError(f"cannot connect to {peer_id} at {addr}: {describe(exc.__cause__ or exc)}") from exc
            negative_cache = getattr(swarm, "_negative_peer_cache", None)
            if negative_cache is not None:
                negative_cache.evict(str(peer_id))  # a stale 60 s block must not hide a live connection
            return conn
        raise mismatch_error(str(peer_id), str(addr), timeout, have_secret=self.config.fleet_secret is not None)


def _peer_ids(addrs: Sequence[str]) -> frozenset[ID]:
    ids = set()
    for addr in addrs:
        try:
            ids.add(info_from_p2p_addr(multiaddr.Multiaddr(str(addr))).peer_id)
        except Exception:  # HostConfig checked them; one without /p2p/ names no peer to exempt
            continue
    return frozenset(ids)


class _ClearOnConnect(INotifee):
    """Clears a peer's backoff whenever a connection to it opens, ours or its own (a departed peer that is back)."""

    def __init__(self, node: Node) -> None:
        self._node = node

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        peer = getattr(getattr(conn, "muxed_conn", None), "peer_id", None)
        if peer is not None:
            self._node.backoff.succeeded(peer)

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        return None

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        return None

    async def listen(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None

    async def listen_close(self, network: INetwork, multiaddr: multiaddr.Multiaddr) -> None:
        return None


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
