"""Publishing what a peer serves, and finding every live peer that serves a model.

A serving peer ``provide``s the model's provider key (so others can enumerate it) and ``put``s its signed
:class:`~.records.ServingRecord` under its own record key; :class:`Announcer` re-signs (``seq + 1``) and
re-publishes well before ``expires_at``. :func:`find_serving_peers` asks the network (never only the local store)
for providers, fetches each provider's record (from the provider itself first: it holds the newest one), keeps the
newest valid record per peer and drops expired ones, so a dead peer disappears once its record's TTL runs out.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from .. import clock
from ..errors import NetworkError, RecordError, translate
from .dht import LookupFacts, providers_from_network, values_from_network
from .dial import dial_peer, remember
from .directory import PER_RANGE, Closest, directory_key, encode_directory, put_directory
from .node import Node
from .records import DEFAULT_TTL, ServingRecord, SignedRecord, decode_record, provider_key, record_key, sign_record
from .walk import find_starting_at, walk_directories

__all__ = ["RECORDS_PROTOCOL", "Announcer", "ServingOffer", "SurveyFacts", "fetch_records", "find_serving_peers",
           "find_starting_at", "publish"]

RECORDS_PROTOCOL = "/sangama/records/1"  # request: nothing; response: msgpack list of signed record values
AUTHOR_TIMEOUT_S = 5.0  # how long a survey asks a provider itself for its record, once no DHT server had it
TOP_UP_DELAY_S = 0.5  # after a DHT server joins close to a directory key of ours, before it gets our entry
PROVIDE_EVERY_S = 600.0  # how often a serving peer sends its provider entry (the directory entry: every re-publish)
NO_ANSWER_RETRY_S = (0.5, 2.0)  # pauses before a provider lookup that no DHT server answered is made again
MAX_RESPONSE = 1 << 20  # bytes a peer may answer a records (or links) request with

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServingOffer:
    """What a serving peer announces for one model (the record fields it controls).

    ``fingerprint``, ``num_layers`` and ``layer_hashes`` are its checkpoint's identity
    (:class:`sangama_p2p.model.fingerprint.ModelIdentity`): clients chain only peers of one fingerprint and take the
    model's depth from ``num_layers``. ``links``: (peer id, round trip in s) measured to the stages that can follow
    this one (:mod:`sangama_p2p.stage.neighbours`); clients plan with them instead of estimating.
    """

    model_id: str
    start: int
    end: int
    throughput: float = 0.0
    free_sessions: int = 0
    ttl: float = DEFAULT_TTL
    fingerprint: str = ""
    num_layers: int = 0
    layer_hashes: tuple[tuple[str, str], ...] = ()
    links: tuple[tuple[str, float], ...] = ()


def _reachability(node: Node) -> str:
    """The relay's peer id when the node advertises a ``/p2p-circuit`` address, else ``direct``.

    Traversal advertises circuit addresses only for a node that found itself not publicly reachable, so a node
    behind a NAT is reported as relayed even though its (unreachable) direct addresses are listed too.
    """
    for addr in (str(a) for a in node.advertised_addrs()):
        if "/p2p-circuit" in addr:
            return addr.split("/p2p-circuit")[0].rsplit("/p2p/", 1)[-1]
    return "direct"


async def publish(node: Node, offer: ServingOffer, *, seq: int,
                  on_signed: Callable[[SignedRecord], None] | None = None, provide: bool = True,
                  closest: Closest | None = None) -> SignedRecord:
    """Sign ``offer`` with the node's key and store it in its range's directory in the DHT (and our own copy under
    its record key, which a survey that enumerates providers asks the author for); ``provide``: provide the model's
    key too (providers are kept for hours: :class:`Announcer` sends it once per :data:`PROVIDE_EVERY_S`).

    ``on_signed`` hears of the record before it travels (storing it on peers behind NATs can take seconds)."""
    if node.dht is None:
        raise NetworkError("publishing needs a DHT")
    signed = sign_record(
        node.key_pair,
        model_id=offer.model_id,
        start=offer.start,
        end=offer.end,
        throughput=offer.throughput,
        free_sessions=offer.free_sessions,
        addrs=[str(a) for a in node.advertised_addrs()],
        reachability=_reachability(node),
        ttl=offer.ttl,
        seq=seq,
        fingerprint=offer.fingerprint,
        num_layers=offer.num_layers,
        layer_hashes=offer.layer_hashes,
        links=offer.links,
    )
    if on_signed is not None:
        on_signed(signed)
    try:
        # the range's directory (what clients walk); the provider entry stays for the surveys that enumerate every
        # peer (`status`, placement at join, a client's retry, and a DHT of go-libp2p servers, which keep no
        # /sangama/ values): they ask each provider for its record, stored under its record key (dials look circuit
        # addresses up there too: net/dial.py record_addrs)
        await put_directory(node, directory_key(offer.model_id, offer.start), encode_directory([signed.value]),
                            closest)
        # the record under its own key too, on the servers: the enumerating surveys (a client's retry, the
        # verifier's second chain) missed live peers on a loaded machine when only authors held their
        # records, and a liar went unbanned for want of referees (tests/client/test_liars.py, 2 runs of 3)
        await node.dht.put_value(record_key(offer.model_id, node.peer_id), signed.value)
        if provide:
            await node.dht.provide(provider_key(offer.model_id))
    except Exception as exc:  # py-libp2p raises ValueError and others on refusal; ours (RecordError) pass through
        raise translate(exc, NetworkError, f"cannot publish record for {offer.model_id!r}")
    return signed


class Announcer:
    """Keeps a peer's offers published: re-signs and re-publishes each one after a third of its TTL.

    ``update`` replaces an offer (e.g. new throughput or free sessions) and publishes it at once. Sequence numbers start
    at the current time in milliseconds, so a restarted peer's records still win over its old ones.
    """

    def __init__(self, node: Node) -> None:
        self.node = node
        self._offers: dict[str, ServingOffer] = {}
        self._seq = int(clock.wall() * 1000)
        self._wake = trio.Event()
        self._all_due = False  # a bootstrap node came back: re-publish every offer at once
        self._provided: dict[str, float] = {}  # model -> when its provider entry was last sent (trio clock)
        self._closest = Closest()  # the servers each directory entry goes to
        self._locks: dict[str, trio.Lock] = {}  # per model: its publications one at a time
        self._top_up = trio.Event()  # a DHT server joined close to one of our directory keys
        self.published: dict[str, SignedRecord] = {}
        self.signed: dict[str, SignedRecord] = {}
        """The newest record signed per model, set as its publication starts (``published``: once it finished)."""
        node.host.set_stream_handler(RECORDS_PROTOCOL, self._serve_records)

    async def _serve_records(self, stream: INetStream) -> None:
        """``/sangama/records/1``: answer with our current signed records (``sangama-peer status`` asks)."""
        try:
            values = [s.value for s in self.published.values() if s.record.expires_at > clock.wall()]
            await stream.write(msgpack.packb(values, use_bin_type=True))
        except Exception as exc:  # the asker went away; nothing to clean up beyond the stream
            log.debug("records request failed: %s", exc)
        finally:
            await stream.close()

    async def update(self, offer: ServingOffer) -> SignedRecord:
        self._offers[offer.model_id] = offer
        signed = await self._publish(offer)
        self._wake.set()
        return signed

    def withdraw(self, model_id: str) -> None:
        """Stop re-publishing ``model_id`` (the record then expires after its TTL)."""
        self._offers.pop(model_id, None)
        self.published.pop(model_id, None)

    async def _publish(self, offer: ServingOffer, *, provide: bool = False) -> SignedRecord:
        # one publication of a model at a time, its seq taken inside: an update racing the loop's re-publication
        # stored the newer record locally first, and the older one's store was refused ("Refusing to replace newer
        # value with the older one": the whole suite, once)
        async with self._locks.setdefault(offer.model_id, trio.Lock()):
            self._seq += 1
            now = trio.current_time()
            provide = provide or now - self._provided.get(offer.model_id, -math.inf) >= PROVIDE_EVERY_S
            signed = await publish(self.node, offer, seq=self._seq, provide=provide, closest=self._closest,
                                   on_signed=lambda r: self.signed.__setitem__(offer.model_id, r))
            self.published[offer.model_id] = signed
            if provide:
                self._provided[offer.model_id] = now
            return signed

    def republish_now(self, *_: object) -> None:
        """Re-publish every offer at once (``Node.bootstrap_back`` calls it: a restarted bootstrap node holds
        nothing)."""
        self._all_due = True
        self._closest = Closest()  # the servers it knew may not include the one that came back
        self._wake.set()

    async def run(self) -> None:
        """Re-publish forever (run it in the node's nursery), and at once when a bootstrap node comes back; hand
        the directory entries on to DHT servers that join close to their keys (:meth:`Closest.top_up`)."""
        self.node.bootstrap_back.append(self.republish_now)
        joined = getattr(self.node.dht.routing_table, "on_added", None)  # (a ServerTable: ours)
        if joined is not None:
            joined.append(self._server_joined)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._top_ups)
                await self._run()
        finally:
            self.node.bootstrap_back.remove(self.republish_now)
            if joined is not None:
                joined.remove(self._server_joined)

    def _server_joined(self, peer: ID) -> None:
        if self._closest.wants(peer):
            self._top_up.set()

    async def _top_ups(self) -> None:
        while True:
            await self._top_up.wait()
            await trio.sleep(TOP_UP_DELAY_S)  # the servers that join together, in one round
            self._top_up = trio.Event()
            try:
                await self._closest.top_up(self.node)
            except Exception as exc:  # a DHT that fails now is tried at the next join or re-publication
                log.info("handing directory entries on to new DHT servers failed: %s", exc)

    async def _run(self) -> None:
        while True:
            now = clock.wall()
            all_due, self._all_due = self._all_due, False
            due = [
                offer
                for model, offer in self._offers.items()
                if all_due or model not in self.published
                or self.published[model].record.expires_at - now <= offer.ttl * 2 / 3
            ]
            retry = 0.05
            failed = False
            for offer in due:
                try:
                    await self._publish(offer, provide=all_due)  # a restarted bootstrap holds no provider either
                except NetworkError as exc:
                    log.warning("re-publishing %s failed: %s", offer.model_id, exc)
                    failed = True
                    retry = 1.0  # the DHT is unreachable for now: retry each second, not in a tight loop
            waits = [
                self.published[m].record.expires_at - offer.ttl * 2 / 3 - clock.wall()
                for m, offer in self._offers.items()
                if m in self.published
            ]
            if self._all_due and not failed:  # asked again while publishing
                continue
            self._wake = trio.Event()
            self._all_due = self._all_due or (failed and all_due)  # after the pause
            with trio.move_on_after(max(retry, min(waits, default=60.0))):
                await self._wake.wait()


@dataclass
class SurveyFacts:
    """What a survey found on its way (``find_serving_peers`` fills it): the DHT servers asked for providers and those
    that answered, the providers, and the records found (``from_authors``: asked of the peers themselves)."""

    asked: int = 0
    answered: int = 0
    providers: int = 0
    records: int = 0
    from_authors: bool = False
    directories: int = 0  # directory lookups of the walk (0: the walk found nothing, providers were enumerated)
    candidates: int = 0  # records the walk kept to be probed (``records``: all it found of the checkpoint)
    replied: int = 0  # DHT servers that replied to the walk's lookups
    contacted: set[str] = field(default_factory=set)  # peers the survey asked (DHT servers; a client adds probes)

    def explain(self, model_id: str) -> str:
        """Why a survey found nobody, in words that name the cause."""
        if self.providers == 0:
            if self.answered == 0:
                return (f"no DHT server answered the lookup for {model_id!r} (asked {self.asked}): the bootstrap "
                        "nodes are unreachable or down")
            return (f"no peer provides {model_id!r}: none of the {self.answered} DHT server(s) that answered knows "
                    "one (nobody serves it, or its peers have not published yet)")
        if self.records == 0:
            return (f"{self.providers} peer(s) provide {model_id!r} but no record of theirs was found: no DHT server "
                    "holds one and the peers themselves did not answer")
        return ""


async def find_serving_peers(node: Node, model_id: str, *, include_self: bool = True,
                             fingerprint: str | None = None, facts: SurveyFacts | None = None,
                             ask_authors: Callable[[str], bool] | None = None, walk: bool = True,
                             usable: Callable[[ServingRecord], bool] | None = None, per_range: int = PER_RANGE,
                             num_layers: int = 0) -> list[ServingRecord]:
    """The live peers serving ``model_id`` with their newest valid records, sorted by layer range then peer id;
    ``fingerprint``: only the peers of that checkpoint (the only ones a stage of it is ever chained with);
    ``facts``: filled with what the survey found on its way.

    ``walk``: walk the range directories from layer 0 (:mod:`.directory`: one lookup per boundary, and one per
    layer past a layer nobody serves, whatever the swarm's size), keeping ``per_range`` records per range of those
    ``usable`` says may be chosen; ``num_layers``: the model's depth where the caller knows it (else each record's).
    Every peer is enumerated instead (the provider key, then each provider's record) with ``walk=False``, or when
    no directory was found (a DHT of go-libp2p servers keeps none). ``ask_authors``: which providers whose record no
    DHT server gave to ask for it themselves (default: every one; a caller that knows which ones left says)."""
    facts = facts if facts is not None else SurveyFacts()
    if walk:
        for pause in (*NO_ANSWER_RETRY_S, None):
            walked = await walk_directories(node, model_id, fingerprint=fingerprint, facts=facts, usable=usable,
                                 per_range=per_range, num_layers=num_layers)
            if facts.providers:
                # the directories are there (records found, maybe none usable now, maybe a layer nobody serves: the
                # walk looked past it): enumerating every peer would find no more than a dial to each costs
                ours = [r for r in walked if include_self or r.peer_id != node.peer_id.to_base58()]
                return sorted(ours, key=lambda r: (r.start, r.end, r.peer_id))
            if facts.replied or not facts.asked:  # servers replied and hold no directory (go-libp2p's): enumerate
                break
            if pause is None:  # nobody replied (a busy swarm): enumerating every peer would only add to it
                return []
            log.info("no DHT server answered the directory lookup for %r (asked %d): again in %g s", model_id,
                     facts.asked, pause)
            await trio.sleep(pause)
    return await _enumerate(node, model_id, include_self=include_self, fingerprint=fingerprint, facts=facts,
                            ask_authors=ask_authors)


async def _enumerate(node: Node, model_id: str, *, include_self: bool, fingerprint: str | None, facts: SurveyFacts,
                     ask_authors: Callable[[str], bool] | None) -> list[ServingRecord]:
    """Every provider of ``model_id`` and its record (the survey before directories; O(swarm) lookups)."""
    key, lookup = bytes.fromhex(provider_key(model_id)), LookupFacts()
    providers = await providers_from_network(node, key, facts=lookup)
    for pause in NO_ANSWER_RETRY_S:  # nobody answered (a busy bootstrap, a failed negotiation): not the swarm's answer
        if lookup.answered or not lookup.asked:
            break
        log.info("no DHT server answered the lookup for %r (asked %d): again in %g s", model_id, len(lookup.asked),
                 pause)
        await trio.sleep(pause)
        lookup = LookupFacts()
        providers = await providers_from_network(node, key, facts=lookup)
    if not include_self:
        providers.discard(node.peer_id)
    facts.asked, facts.answered, facts.providers = len(lookup.asked), len(lookup.answered), len(providers)
    facts.contacted.update(p.to_base58() for p in lookup.asked | set(providers))
    found: dict[str, ServingRecord] = {}

    async def fetch(peer: ID) -> None:
        key = record_key(model_id, peer)
        values = await values_from_network(node, key, ask_first=[peer])
        best: ServingRecord | None = None
        for value in values:
            try:
                record = decode_record(key, value)
            except RecordError:
                continue  # expired since it was fetched, or otherwise stale
            if best is None or (record.seq, record.expires_at) > (best.seq, best.expires_at):
                best = record
        keep(peer, best)

    def keep(peer: ID, best: ServingRecord | None) -> None:
        if best is not None:
            found[best.peer_id] = best
            remember(node, peer, best.addrs)  # circuit addresses too: later dials of any kind know them

    async def from_author(peer: ID) -> None:
        keep(peer, await _from_author(node, peer, model_id))

    async with trio.open_nursery() as nursery:
        for peer in providers:
            nursery.start_soon(fetch, peer)
    missing = [p for p in providers if p.to_base58() not in found]
    if missing and ask_authors is not None:
        missing = [p for p in missing if ask_authors(p.to_base58())]
    if missing:
        # no DHT server gave these records: a public peer keeps its own (issue 25), go-libp2p servers keep no
        # /sangama/ values, NATed authors are DHT clients that answer no GET_VALUE, or the lookups timed out on a
        # busy swarm, so ask each provider for its own signed record (``ask_authors`` says which: a departed
        # provider costs a dial timeout, and node.backoff spaces its dials out).
        log.info("no DHT server gave the record of %d of the %d provider(s) of %r: asking them directly",
                 len(missing), len(providers), model_id)
        facts.from_authors = True
        async with trio.open_nursery() as nursery:
            for peer in missing:
                nursery.start_soon(from_author, peer)
    facts.records = len(found)
    ours = [r for r in found.values() if fingerprint is None or r.fingerprint == fingerprint]
    return sorted(ours, key=lambda r: (r.start, r.end, r.peer_id))


async def _from_author(node: Node, peer: ID, model_id: str) -> ServingRecord | None:
    """``peer``'s own record for ``model_id`` over ``/sangama/records/1`` (a DHT client answers no GET_VALUE)."""
    try:
        records, _ = await fetch_records(node, peer, timeout=AUTHOR_TIMEOUT_S)
    except NetworkError as exc:
        log.debug("no record of %s from %s itself: %s", model_id, peer, exc)
        return None
    mine = [r for r in records if r.model_id == model_id]
    if mine:
        log.debug("record of %s for %s fetched from its author (no DHT server held it)", peer, model_id)
    return max(mine, key=lambda r: (r.seq, r.expires_at), default=None)


async def fetch_records(
    node: Node, peer_id: ID, *, timeout: float = 5.0
) -> tuple[list[ServingRecord], float | None]:
    """Ask ``peer_id`` for its signed records: the valid ones and the request's round trip in ms (None: serves none)."""
    with trio.move_on_after(timeout):
        await dial_peer(node, peer_id, timeout=timeout)  # record addresses found by discovery are in the peerstore
        start = clock.now()
        try:
            stream = await node.host.new_stream(peer_id, [RECORDS_PROTOCOL])
        except Exception as exc:  # no handler: the peer serves nothing (a bootstrap node, a client)
            log.debug("%s does not answer %s: %s", peer_id, RECORDS_PROTOCOL, exc)
            return [], None
        chunks: list[bytes] = []
        size = 0
        try:
            while chunk := await stream.read(65536):
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_RESPONSE:
                    raise NetworkError(f"{peer_id} sent more than {MAX_RESPONSE} bytes of records")
        except NetworkError:
            raise
        except Exception as exc:  # stream reset/EOF errors differ between muxers
            if not chunks:
                raise translate(exc, NetworkError, f"reading records from {peer_id} failed")
        finally:
            await stream.close()
        rtt_ms = (clock.now() - start) * 1000
        try:
            values = msgpack.unpackb(b"".join(chunks), raw=False)
        except Exception as exc:  # untrusted bytes: msgpack raises several types
            raise translate(exc, NetworkError, f"{peer_id} sent undecodable records")
        if not isinstance(values, list):
            raise NetworkError(f"{peer_id} sent records that are not a list")
        records = []
        for value in values:
            if not isinstance(value, bytes):
                continue
            try:
                model = msgpack.unpackb(msgpack.unpackb(value)[0], raw=False)["model"]
                records.append(decode_record(record_key(model, peer_id), value))
            except Exception as exc:  # a bad record from a peer is skipped, never trusted
                log.debug("skipping record from %s: %s", peer_id, exc)
        return records, rtt_ms
    raise NetworkError(f"{peer_id} did not answer within {timeout:g} s")
