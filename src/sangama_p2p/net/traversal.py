"""NAT traversal for a node: learn reachability, hold relay reservations when private, connect, hole punch.

:class:`Traversal` plugs into ``open_host`` as a service and uses the hooks ``Node`` offers::

    traversal = Traversal(TraversalConfig())
    async with open_host(config, services=[traversal.run]) as node:
        await traversal.wait_ready()
        link = await traversal.connect(peer_id, addrs)      # LinkInfo: "direct" or "relayed via <relay id>"

What ``run`` does, in order:

1. starts the circuit-relay client (STOP: accept relayed connections), the HOP side too on relay nodes
   (``HostConfig.relay_hop``), the dial-back server on relay nodes, and the DCUtR hole puncher;
2. registers a fallback dialer on the node, so ``Node.connect`` tries a peer's ``/p2p-circuit`` addresses after its
   direct ones;
3. asks the relays (by default the bootstrap nodes) to dial it back; if nobody could, it keeps reservations on at least
   ``max_reservations`` relays (the next relay of the list stands in for one that fails) and advertises the resulting
   ``/p2p-circuit`` addresses (``Node.extra_addrs``); a reservation whose relay connection closes is re-made at once,
   and listeners hear of every change of those addresses (a stage re-publishes its record);
4. re-checks reachability every ``recheck_s`` seconds; when nobody answered (servers that speak neither our dial-back
   nor AutoNAT, or refuse to dial private addresses) it acts as a private node - the safe choice - says so, and asks
   again after ``UNDECIDED_RECHECK_S``, doubling up to ``recheck_s``;
5. offers circuit addresses through its relays for peers of whom none is known (``Node.circuit_guesses``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import msgpack
import trio
from libp2p.abc import INetConn, INetStream
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo, info_from_p2p_addr
from multiaddr import Multiaddr

from ..errors import NetworkError, RelayError
from .addrs import is_relayed
from .holepunch import HolePuncher, LinkInfo, link_info, run_hole_puncher, wait_direct
from .movable import LINKS_PROTOCOL, links_report
from .node import Node
from .reach import Reachability, ReachabilityReport, check_reachability, serve_dialback
from .relay import RelayClient, RelayServiceConfig, circuit_addr, offers_hop, open_relay_client

__all__ = ["Traversal", "TraversalConfig"]

logger = logging.getLogger(__name__)

UNDECIDED_RECHECK_S = 60.0  # first re-check after nobody answered; doubles up to TraversalConfig.recheck_s


@dataclass(frozen=True)
class TraversalConfig:
    """How a node finds out whether it is reachable and what it does about it.

    ``relays`` are ``.../p2p/<id>`` multiaddrs; empty means "the bootstrap nodes". ``serve_relay`` ``None`` follows
    ``HostConfig.relay_hop``. ``reachability`` forces a verdict (``"public"``/``"private"``) instead of asking.
    """

    relays: tuple[str, ...] = ()
    serve_relay: bool | None = None
    hole_punch: bool = True
    max_reservations: int = 2
    recheck_s: float = 600.0
    reachability: str | None = None
    relay_limits: RelayServiceConfig = RelayServiceConfig()

    def __post_init__(self) -> None:
        for addr in self.relays:
            _peer_info(addr)
        if self.reachability not in (None, "public", "private"):
            raise NetworkError(f"reachability must be 'public', 'private' or unset, not {self.reachability!r}")
        if self.max_reservations < 1 or self.recheck_s <= 0:
            raise NetworkError("max_reservations must be >= 1 and recheck_s > 0")


def _peer_info(addr: str) -> PeerInfo:
    try:
        return info_from_p2p_addr(Multiaddr(addr))
    except Exception as exc:
        raise NetworkError(f"relay address {addr!r} must be a multiaddr ending in /p2p/<peer id>: {exc}") from exc


def _set_dht_client(node: Node, client: bool) -> bool:
    """Put the node's DHT in client (or server) mode; True if that changed it. Unlike py-libp2p's ``switch_mode``
    this keeps the routing table (which it empties on the way to client mode, bootstrap nodes included)."""
    from libp2p.kad_dht.common import PROTOCOL_ID
    from libp2p.kad_dht.kad_dht import DHTMode

    dht = node.dht
    want = DHTMode.CLIENT if client else DHTMode.SERVER
    if dht is None or dht.mode == want:
        return False
    dht.mode = want
    if client:
        node.host.remove_stream_handler(PROTOCOL_ID)
    else:
        node.host.set_stream_handler(PROTOCOL_ID, dht.handle_stream)
    return True


class Traversal:
    """The NAT-traversal side of one node; ``run`` is its lifetime (pass it to ``open_host(services=...)``)."""

    def __init__(self, config: TraversalConfig | None = None) -> None:
        self.config = config or TraversalConfig()
        self.report: ReachabilityReport | None = None
        self.relay_client: RelayClient | None = None
        self.puncher: HolePuncher | None = None
        self._node: Node | None = None
        self._ready = trio.Event()
        self._warned = False
        self._serving = False
        self._asked = False  # the last check asked dial-back servers (it was not forced, nor without servers)
        self.listeners: list[Callable[[], None]] = []
        """Called when reachability or our circuit addresses changed (a stage re-publishes its record at once)."""
        self.report_extra: Callable[[], dict[str, Any]] | None = None
        """More for ``/sangama/links/1`` answers (the peer adds its stage's moves under ``rebalance``)."""

    @property
    def reachability(self) -> Reachability:
        return self.report.status if self.report is not None else Reachability.UNKNOWN

    @property
    def undecided(self) -> bool:
        """Servers were asked and none answered (e.g. go-libp2p nodes that refuse to dial private addresses): the
        node then acts as a private one, the safe choice, and keeps asking."""
        return self.reachability is Reachability.UNKNOWN and self._asked

    async def wait_ready(self) -> None:
        """Wait until reachability is known and, for a private node, a first reservation was tried."""
        await self._ready.wait()

    # -- lifetime --------------------------------------------------------------------------------------------------
    async def run(self, node: Node) -> None:
        """Run until the node closes (``open_host`` cancels its services)."""
        self._node = node
        serve = node.config.relay_hop if self.config.serve_relay is None else self.config.serve_relay
        self._serving = bool(serve)
        if node.dht is not None and node.config.dht_server and not serve and self._relays(node) and (
                self.config.reachability != "public"):
            _set_dht_client(node, True)  # until a dial-back shows we are reachable (before identify tells anyone)
        async with AsyncExitStack() as stack:
            relay_client = await stack.enter_async_context(
                open_relay_client(
                    node.host, relay_config=self.config.relay_limits if serve else None, connect=self._connect_to
                )
            )
            self.relay_client = relay_client
            relay_client.on_change = self._advertise
            if serve:
                await stack.enter_async_context(serve_dialback(node.host))
            if self.config.hole_punch:
                self.puncher = await stack.enter_async_context(run_hole_puncher(node.host, relay_client))
            node.host.set_stream_handler(LINKS_PROTOCOL, self._serve_links)
            stack.callback(node.host.remove_stream_handler, LINKS_PROTOCOL)
            node.fallback_dialers.append(self._dial_via_relay)
            stack.callback(node.fallback_dialers.remove, self._dial_via_relay)
            relays = self._relays(node)
            node.circuit_guesses.append(self._guess_circuits)
            stack.callback(node.circuit_guesses.remove, self._guess_circuits)
            undecided_wait = UNDECIDED_RECHECK_S
            while True:
                await self._check(node, relays, serve)
                self._ready.set()
                if self.undecided:  # nobody answered: ask again soon, then less often (never silently for good)
                    say = logger.warning if undecided_wait == UNDECIDED_RECHECK_S else logger.info  # once loud
                    say("reachability undecided: no relay or bootstrap node answered a dial-back or AutoNAT request "
                        "(%s); acting as not publicly reachable (DHT client, relay reservations) and asking again in "
                        "%.0f s", "; ".join(self.report.errors) if self.report else "",
                        min(undecided_wait, self.config.recheck_s))
                    await trio.sleep(min(undecided_wait, self.config.recheck_s))
                    undecided_wait *= 2
                else:
                    undecided_wait = UNDECIDED_RECHECK_S
                    await trio.sleep(self.config.recheck_s)

    async def _serve_links(self, stream: INetStream) -> None:
        """``/sangama/links/1``: our stage streams, how each runs now, and the stage traffic by kind of link."""
        try:
            client = self.relay_client
            circuit = getattr(getattr(client, "_protocol", None), "relayed_bytes", None) if self._serving else None
            report = links_report(circuit)
            if self.report_extra is not None:
                report.update(self.report_extra())
            await stream.write(msgpack.packb(report, use_bin_type=True))
        except Exception as exc:  # the asker went away
            logger.debug("links request failed: %s", exc)
        finally:
            await stream.close()

    async def _connect_to(self, info: PeerInfo) -> None:
        """Reach relays and dial-back servers through ``Node.connect`` (announced addresses first, no 60 s block)."""
        assert self._node is not None
        await self._node.connect(info.peer_id, list(info.addrs))

    def _relays(self, node: Node) -> list[PeerInfo]:
        infos = [_peer_info(addr) for addr in self.config.relays or node.config.bootstrap_addrs]
        return [r for r in infos if r.peer_id != node.peer_id]

    async def _check(self, node: Node, relays: list[PeerInfo], serving: bool) -> None:
        before = self.reachability
        forced = self.config.reachability
        was_private = self._acts_private()
        if forced is not None or serving or not relays:
            status = Reachability(forced) if forced else (Reachability.PUBLIC if serving else Reachability.UNKNOWN)
            self.report = ReachabilityReport(status, (), ())
            self._asked = False
        else:
            self.report = await check_reachability(node.host, relays, connect=self._connect_to)
            self._asked = True
        logger.info("reachability: %s %s", self.report.status.value, list(self.report.public_addrs))
        self._drop_dead_announced(node)
        if self.report.status is not before or self._acts_private() is not was_private:
            await self._dht_mode(node)
            self._changed()
        if self.report.status is not Reachability.PUBLIC and self.relay_client is not None:
            await self._reserve(relays)

    def _drop_dead_announced(self, node: Node) -> None:
        """An announced address that the dial-back servers tried (our observed IP at its port) and nobody answered
        on is left out of our records, with a warning naming it; one that answers again is put back."""
        report = self.report
        if report is None or not report.answered_by or not node.config.announce_addrs:
            return
        tried = set(report.tried)
        reached = set(report.public_addrs)
        changed = False
        for raw in node.config.announce_addrs:
            addr = str(Multiaddr(raw))  # as the host compares it
            text = addr.split("/p2p/")[0].rstrip("/")
            if text in reached and addr in node.dead_announced:
                node.dead_announced.discard(addr)
                logger.info("announced address %s answers again: advertising it", text)
                changed = True
            elif text in tried and text not in reached and addr not in node.dead_announced:
                node.dead_announced.add(addr)
                logger.warning("announced address %s: nobody answers there (dial-back by %s failed; a port forward "
                               "missing?) - left out of our records; reachable through relays instead", text,
                               ", ".join(report.answered_by))
                changed = True
        if changed:
            self._changed()

    async def _dht_mode(self, node: Node) -> None:
        """A peer nobody can dial is a DHT client (go-libp2p's auto mode): as a server it would sit in routing tables
        where every lookup and every record store spends a dial timeout on it (measured in namespaces: a NATed
        stage's first record took 16-34 s to store, so ``ready`` came that late). Server again once reachable."""
        if node.dht is None or not node.config.dht_server:
            return
        if _set_dht_client(node, self._acts_private()):
            logger.info("DHT %s mode (reachability %s)", node.dht.mode.value, self.reachability.value)
            if not self._acts_private():  # tell peers we serve the DHT after all
                push = getattr(node.host, "_push_identify_to_all_peers", None)
                if push is not None:
                    try:
                        await push()
                    except Exception as exc:  # best effort: peers learn it at their next identify
                        logger.debug("identify push failed: %s", exc)

    def _acts_private(self) -> bool:
        """Private, or undecided after asking: nobody is known to be able to dial us."""
        return self.reachability is Reachability.PRIVATE or self.undecided

    async def _reserve(self, relays: list[PeerInfo]) -> None:
        assert self.relay_client is not None
        client = self.relay_client
        client.keep_reservations(relays, self.config.max_reservations)  # each kept relay is watched (relay.py)
        with trio.move_on_after(10.0):  # first grant, so that wait_ready means "advertising a circuit"
            while not client.reservations and any(str(r.peer_id) not in client.not_relays for r in relays):
                await trio.sleep(0.05)  # ... unless every relay turned out to be no relay at all

    def _advertise(self) -> None:
        """Advertise our circuit addresses through ``Node.extra_addrs``, but only if they come out intact.

        py-libp2p 0.8.1's ``BasicHost.get_addrs`` strips everything from the *first* ``/p2p/`` of each address and
        appends ours, turning ``<relay>/p2p/R/p2p-circuit/p2p/US`` into ``<relay>/p2p/US``: a wrong address for us that
        makes other peers dial the relay as if it were us. When the host routes ``extra_addrs`` through
        ``get_addrs`` we therefore advertise nothing and log why (``circuit_addrs`` still lists them).
        """
        node, client = self._node, self.relay_client
        if node is None or client is None:
            return
        circuits = client.circuit_addrs()
        changed = [str(a) for a in node.extra_addrs] != [str(a) for a in circuits]
        node.extra_addrs[:] = circuits
        advertised = {str(a) for a in node.advertised_addrs()}
        if not {str(c) for c in circuits} <= advertised:
            node.extra_addrs.clear()
            if not self._warned:
                self._warned = True
                logger.warning("host mangles /p2p-circuit addresses; not advertising them (see traversal.py)")
        if changed:
            logger.info("advertising %d circuit address(es): %s", len(node.extra_addrs),
                        [str(a) for a in node.extra_addrs])
            self._changed()

    def _changed(self) -> None:
        for listener in list(self.listeners):
            listener()

    def reachable(self) -> bool:
        """Whether others can reach us now: reachability is known and public, or we advertise a circuit address."""
        return self._ready.is_set() and (self.reachability is Reachability.PUBLIC or bool(self._node and
                                                                                         self._node.extra_addrs))

    def circuit_addrs(self) -> list[Multiaddr]:
        """Our ``/p2p-circuit`` addresses (empty when public or before a reservation)."""
        return self.relay_client.circuit_addrs() if self.relay_client is not None else []

    def _guess_circuits(self, peer_id: ID) -> list[Multiaddr]:
        """Circuit addresses of ``peer_id`` through the relays we know (``relays``, else the bootstrap nodes), for a
        peer of whom no circuit address is known: a NATed peer found as a provider through a go-libp2p DHT comes with
        its private addresses only, and it most likely holds a reservation on the relays we were given too. A peer
        that is no relay (identify says so, or it refused a reservation) is left out; at most ``max_reservations``."""
        node = self._node
        if node is None:
            return []
        refused = self.relay_client.not_relays if self.relay_client is not None else set()
        out: list[Multiaddr] = []
        for relay in self._relays(node):
            if relay.peer_id == peer_id or str(relay.peer_id) in refused:
                continue
            if offers_hop(node.host, relay.peer_id) is False:
                continue
            out.extend(circuit_addr(a, relay.peer_id, peer_id) for a in relay.addrs[:1])
            if len(out) >= self.config.max_reservations:
                break
        return out

    async def _dial_via_relay(self, node: Node, peer_id: ID, addrs: list[Multiaddr]) -> INetConn:
        if self.relay_client is None:
            raise NetworkError("relay client not running")
        circuits = [a for a in addrs if is_relayed(a) and str(a).rstrip("/").endswith(f"/p2p/{peer_id}")]
        if not circuits:
            raise NetworkError(f"no relay address known for {peer_id}")
        errors: list[str] = []
        for addr in circuits:
            try:
                return await self.relay_client.dial(addr)
            except RelayError as exc:
                errors.append(str(exc))
        raise RelayError(f"no relay reached {peer_id}: " + "; ".join(errors))

    # -- links -----------------------------------------------------------------------------------------------------
    async def connect(self, peer_id: ID, addrs: Sequence[Multiaddr | str] = ()) -> LinkInfo:
        """Reach ``peer_id``: an open link, else its direct addresses, else through a relay. Reports the link."""
        if self._node is None:
            raise NetworkError("traversal is not running")
        await self._node.connect(peer_id, [Multiaddr(str(a)) for a in addrs])
        info = link_info(self._node.host, peer_id)
        if info is None:
            raise NetworkError(f"connection to {peer_id} closed right after it opened")
        return info

    def link(self, peer_id: ID) -> LinkInfo | None:
        """The current link to ``peer_id`` (direct preferred), or ``None``."""
        return link_info(self._node.host, peer_id) if self._node is not None else None

    async def wait_direct(self, peer_id: ID, timeout_s: float) -> LinkInfo | None:
        """Wait for a hole punch to give a direct link to ``peer_id``; ``None`` if it did not within ``timeout_s``."""
        if self._node is None:
            raise NetworkError("traversal is not running")
        return await wait_direct(self._node.host, peer_id, timeout_s)
