"""Reaching a peer: every address we know for it, from every source, raced happy-eyeballs style.

Every dial of a Sangama node ends here: ``Node.connect`` (and through it py-libp2p's own dials: DHT queries, identify,
relays) calls :func:`race`, and :func:`dial_peer` - what client-to-stage links, stage-to-next-hop links, ``status``
and discovery call - first gathers the addresses:

1. the ones the caller passes (a serving record's ``addrs``: the peer's announced addresses and its ``/p2p-circuit``
   addresses on the relays it reserved on),
2. the peerstore (what the DHT, identify and earlier records told us),
3. when none of those is a circuit address and ``model_id`` is given, the peer's serving record, fetched from the DHT
   servers that hold it (not from the peer itself: that is the dial we are trying to make) while the known addresses
   are tried,
4. the DHT's ``find_peer`` when nothing at all is known.

Order (:func:`plan`): announced public addresses, then other public ones (observed: DHT, identify), then private and
loopback ones (a peer on the same LAN), then circuit addresses. Attempt ``i`` starts ``stagger_s`` after attempt
``i - 1`` or as soon as every earlier one failed, whichever comes first; each is bounded by its own timeout
(``direct_timeout_s``, ``circuit_timeout_s``), so an address that silently drops packets (a NAT) costs a stagger step,
never the whole budget. The first connection wins and the others are cancelled.

A relayed connection is upgraded by DCUtR: the peer that *accepts* it (the one behind NAT holding the reservation)
starts the hole punch (``net/holepunch.py``); new streams then go over the punched connection.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.abc import INetConn
from libp2p.peer.id import ID

from .. import clock
from ..errors import NetworkError, PeerBackedOff
from .addrs import is_site_local
from .dht import values_from_network
from .node import Node
from .records import decode_record, record_key
from .relay import relay_of

__all__ = ["Attempt", "DialPolicy", "dial_peer", "plan", "race"]

log = logging.getLogger(__name__)

ANNOUNCED, OBSERVED, PRIVATE, CIRCUIT = "announced", "observed", "private", "circuit"
_RANK = {ANNOUNCED: 0, OBSERVED: 1, PRIVATE: 2, CIRCUIT: 3}


@dataclass(frozen=True)
class DialPolicy:
    """How long each attempt may take and how far apart attempts start (seconds)."""

    stagger_s: float = 0.25
    direct_timeout_s: float = 3.0
    circuit_timeout_s: float = 10.0
    record_timeout_s: float = 4.0
    record_after_s: float = 2.0  # the record is looked up once the known addresses failed this long (not at once:
    # on a loaded machine a dial to a live peer's known address takes over half a second)

    def __post_init__(self) -> None:
        if self.stagger_s < 0 or min(self.direct_timeout_s, self.circuit_timeout_s, self.record_timeout_s) <= 0:
            raise NetworkError("dial policy: stagger must be >= 0 and every timeout > 0")
        if self.record_after_s < 0:
            raise NetworkError("dial policy: record_after_s must be >= 0")


@dataclass(frozen=True)
class Attempt:
    """One address to try: its class (announced / observed / private / circuit) and its own time limit."""

    addr: str
    kind: str
    timeout_s: float


def _kind(addr: str, announced: bool) -> str:
    if "/p2p-circuit" in addr:
        return CIRCUIT
    parts = addr.strip("/").split("/")
    if len(parts) >= 2 and parts[0] in ("ip4", "ip6"):
        try:
            ip = ipaddress.ip_address(parts[1])
        except ValueError:
            return OBSERVED
        if ip.is_loopback or is_site_local(ip):
            return PRIVATE
    return ANNOUNCED if announced else OBSERVED


def plan(announced: Sequence[str], others: Sequence[str], peer_id: str, policy: DialPolicy = DialPolicy()
         ) -> list[Attempt]:
    """The attempts for ``peer_id`` in dial order (pure): ``announced`` are the peer's own (record) addresses.

    Duplicates are dropped (``/p2p/<peer_id>`` suffixes ignored), as are circuit addresses that name another
    destination; within a class the given order is kept, announced before others.
    """
    seen: set[str] = set()
    out: list[Attempt] = []
    for addrs, own in ((announced, True), (others, False)):
        for raw in addrs:
            text = str(raw).rstrip("/")
            kind = _kind(text, own)
            if kind == CIRCUIT:
                if not text.endswith(f"/p2p/{peer_id}"):
                    continue
            elif text.endswith(f"/p2p/{peer_id}"):
                text = text[: -len(f"/p2p/{peer_id}")]
            if text in seen or not text:
                continue
            seen.add(text)
            out.append(Attempt(text, kind, policy.circuit_timeout_s if kind == CIRCUIT else policy.direct_timeout_s))
    return sorted(out, key=lambda a: _RANK[a.kind])  # stable


DialOne = Callable[[Attempt], Awaitable[INetConn]]


async def race(attempts: Sequence[Attempt], dial_one: DialOne, *, stagger_s: float, peer: str = "") -> INetConn:
    """Happy eyeballs over ``attempts``: start them ``stagger_s`` apart (the next one at once when all running ones
    failed), each bounded by its own timeout; the first connection wins. :class:`NetworkError` naming every failure."""
    if not attempts:
        raise NetworkError(f"no address known for peer {peer}")
    winner: list[INetConn] = []
    failures: list[NetworkError] = []
    failed = trio.Event()
    running = 0

    async def one(attempt: Attempt) -> None:
        nonlocal running, failed
        t0 = clock.now()
        try:
            with trio.move_on_after(attempt.timeout_s) as scope:
                conn = await dial_one(attempt)
            if scope.cancelled_caught:
                failures.append(NetworkError(f"{attempt.addr}: no answer in {attempt.timeout_s:g} s"))
            elif not winner:
                winner.append(conn)
                log.info("reached %s at %s (%s) in %.2f s", peer, attempt.addr, attempt.kind, clock.now() - t0)
                nursery.cancel_scope.cancel()
                return
        except NetworkError as exc:
            failures.append(exc)
        except Exception as exc:  # every transport and relay error counts as one failed address
            failures.append(NetworkError(f"{attempt.addr}: {exc}"))
        running -= 1
        if running == 0:
            failed.set()

    async with trio.open_nursery() as nursery:
        for attempt in attempts:
            running += 1
            nursery.start_soon(one, attempt)
            with trio.move_on_after(stagger_s):
                await failed.wait()
            failed = trio.Event()
    if winner:
        return winner[0]
    if len(failures) == 1:
        raise failures[0]  # keeps its type (a RelayError with the relay's status, a fleet-secret mismatch)
    raise NetworkError(f"cannot reach {peer}: " + "; ".join(str(f) for f in failures)) from failures[0]


def _dialer(node: Node, peer_id: ID) -> DialOne:
    async def dial_one(attempt: Attempt) -> INetConn:
        addr = multiaddr.Multiaddr(attempt.addr)
        if attempt.kind != CIRCUIT:
            return await node._dial_direct(peer_id, addr)
        errors: list[NetworkError] = []
        for dialer in list(node.fallback_dialers):  # the relay client (net/traversal.py)
            try:
                return await dialer(node, peer_id, [addr])
            except NetworkError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        raise NetworkError("; ".join(str(e) for e in errors) or f"{attempt.addr}: no relay client running")

    return dial_one


async def race_addrs(node: Node, peer_id: ID, announced: Sequence[Any], others: Sequence[Any],
                     policy: DialPolicy = DialPolicy()) -> INetConn:
    """:func:`plan` then :func:`race` with the node's direct dialler and relay client (``Node.connect`` calls this)."""
    attempts = plan([str(a) for a in announced], [str(a) for a in others], str(peer_id), policy)
    return await race(attempts, _dialer(node, peer_id), stagger_s=policy.stagger_s, peer=str(peer_id))


def known_addrs(node: Node, peer_id: ID) -> list[str]:
    """What the peerstore holds for ``peer_id`` (DHT answers, identify, earlier records), circuit addresses too."""
    peerstore = node.host.get_peerstore()
    if peer_id not in peerstore.peer_ids():
        return []
    return [str(a) for a in peerstore.addrs(peer_id)]


async def record_addrs(node: Node, peer_id: ID, model_id: str) -> list[str]:
    """The addresses in ``peer_id``'s newest serving record for ``model_id``, from the DHT servers holding it."""
    if node.dht is None:
        return []
    key = record_key(model_id, peer_id)
    best = None
    near = node.dht.routing_table.find_local_closest_peers(key.encode(), 20)  # the DHT servers we know (bootstrap)
    for value in await values_from_network(node, key, ask_first=[p for p in near if p != peer_id]):
        try:
            rec = decode_record(key, value)
        except Exception:  # stale or foreign: skip it
            continue
        if best is None or rec.seq > best.seq:
            best = rec
    return list(best.addrs) if best is not None else []


async def dial_peer(node: Node, peer_id: ID | str, *, addrs: Sequence[Any] = (), record: Any = None,
                    model_id: str | None = None, timeout: float = 15.0, explicit: bool = False,
                    policy: DialPolicy = DialPolicy()) -> INetConn:
    """A connection to ``peer_id`` from every address known for it (see the module docstring), within ``timeout``.

    ``record``: the peer's :class:`~.records.ServingRecord` (its ``addrs`` come first; signed after the peer's last
    failed dial, it ends the peer's backoff); ``model_id``: look the record up in the DHT when no circuit address is
    known. A peer in its backoff (``Node.backoff``) raises :class:`~sangama_p2p.errors.PeerBackedOff` unless
    ``explicit`` (a dial the user drives: see ``Node.connect``). :class:`NetworkError` if every address failed.
    """
    pid = peer_id if isinstance(peer_id, ID) else ID.from_base58(str(peer_id))
    given = [str(a) for a in addrs] + ([str(a) for a in record.addrs] if record is not None else [])
    if record is not None:
        # a record carries its expiry, not its signing time: expiry - our record_ttl (the fleet's; a record signed
        # with a longer TTL reads as signed later than it was, and may end a backoff early once)
        node.backoff.fresh_record(pid, record.expires_at - node.config.record_ttl)
    try:
        with trio.fail_after(timeout):
            return await _dial_peer(node, pid, given, model_id, policy, explicit)
    except trio.TooSlowError as exc:
        raise NetworkError(f"peer {pid} not reached in {timeout:g} s") from exc


async def _dial_peer(node: Node, pid: ID, given: list[str], model_id: str | None, policy: DialPolicy,
                     explicit: bool) -> INetConn:
    for conn in sorted(node.connections(pid), key=lambda c: _relayed(c)):  # an open link, direct first
        return conn
    remember(node, pid, given)
    if pid in getattr(node, "_dialing", {}) and any("/p2p-circuit" in a for a in given):
        # another dial to this peer is in flight (a DHT query to a NATed author trying its dead direct addresses
        # for seconds, holding Node.connect's one-dial-per-peer lock): race the addresses we were given ourselves
        return await race_addrs(node, pid, given, [], policy)
    if any("/p2p-circuit" in a for a in given + known_addrs(node, pid)) or model_id is None:
        try:
            return await node.connect(pid, [multiaddr.Multiaddr(a) for a in given], explicit=explicit)
        except PeerBackedOff:
            raise
        except NetworkError:
            if model_id is None:
                return await _via_find_peer(node, pid, explicit)
            raise
    wait = 0.0 if explicit else node.backoff.wait_s(pid)
    if wait > 0:  # the record's addresses below are raced outside Node.connect: check its backoff here
        raise PeerBackedOff(f"{pid} failed to answer recently: not dialled again for {wait:.0f} s", wait)
    # no circuit address known: fetch the record while the known addresses are tried, and race its addresses as
    # soon as it arrives (outside Node.connect's one-dial-per-peer lock, which a hanging address may hold)
    won: list[INetConn] = []
    errors: list[NetworkError] = []

    async def known(nursery: trio.Nursery) -> None:
        try:
            won.append(await node.connect(pid, [multiaddr.Multiaddr(a) for a in given], explicit=explicit))
            nursery.cancel_scope.cancel()
        except NetworkError as exc:
            errors.append(exc)

    async def from_record(nursery: trio.Nursery) -> None:
        fetched: list[str] = []
        if given or known_addrs(node, pid):
            # a peer whose known addresses answer (every public one) costs no lookup: issue 25 measured every new
            # link of a 60-peer swarm costing a record lookup of ~40 KAD streams, run to its end in the background
            await trio.sleep(policy.record_after_s)
        with trio.move_on_after(policy.record_timeout_s):
            fetched.extend(await record_addrs(node, pid, model_id))
        new = [a for a in fetched if a not in given]
        if not new:
            errors.append(NetworkError(f"no serving record of {pid} for {model_id!r} with new addresses"))
            return
        log.info("dialling %s at the addresses of its serving record: %s", pid, new)
        remember(node, pid, new)
        try:
            won.append(await race_addrs(node, pid, new, [], policy))
            nursery.cancel_scope.cancel()
        except NetworkError as exc:
            errors.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(known, nursery)
        nursery.start_soon(from_record, nursery)
    if won:
        return won[0]
    raise NetworkError(f"cannot reach {pid}: " + "; ".join(str(e) for e in errors)) from (errors or [None])[0]


async def _via_find_peer(node: Node, pid: ID, explicit: bool) -> INetConn:
    if node.dht is None:
        raise NetworkError(f"no address known for peer {pid}")
    try:
        info = await node.dht.find_peer(pid)
    except Exception as exc:  # py-libp2p's lookups raise several unrelated types
        raise NetworkError(f"cannot find {pid}: {exc}") from exc
    if info is None:
        raise NetworkError(f"no address known for peer {pid}")
    return await node.connect(pid, list(info.addrs), explicit=explicit)


def remember(node: Node, peer_id: ID, addrs: Sequence[str]) -> None:
    """Keep ``addrs`` (circuit addresses included) in the peerstore, so later dials of any kind know them."""
    maddrs = []
    for a in addrs:
        try:
            maddrs.append(multiaddr.Multiaddr(str(a)))
        except Exception:  # a malformed address from a record is simply not remembered
            continue
    if maddrs:
        node.host.get_peerstore().add_addrs(peer_id, maddrs, 3600)


def _relayed(conn: Any) -> bool:
    return relay_of(conn) is not None
