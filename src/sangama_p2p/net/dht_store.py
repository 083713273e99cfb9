"""The value store of a node's DHT: capped per author and in total, swept by the records' own expiry, and merging
range directories (:mod:`.directory`) with at most :data:`DIRECTORY_PER_NETWORK` entries from one network."""

from __future__ import annotations

import logging
from contextvars import ContextVar
from typing import Any

import trio
from libp2p.kad_dht.common import DEFAULT_TTL as VALUE_TTL
from libp2p.kad_dht.pb.kademlia_pb2 import Record
from libp2p.kad_dht.value_store import ValueStore
from libp2p.peer.id import ID

from .. import clock
from ..errors import RecordError
from .directory import RecordsAndDirectories, encode_directory, is_directory, merge_entries
from .records import RecordLedger

__all__ = ["DIRECTORY_PER_NETWORK", "PUT_SOURCE", "CappedValueStore"]

log = logging.getLogger(__name__)

PUT_SOURCE: ContextVar[tuple[str, ...]] = ContextVar("PUT_SOURCE", default=())
""":func:`~.addrs.stream_source` of the peer whose KAD request is being handled (empty: ours, or a loopback one)."""
DIRECTORY_PER_NETWORK = 8  # entries of one directory a server takes from senders of one /24 (IPv4) or /64 (IPv6)

_PK_PREFIX = b"/pk/"


class CappedValueStore(ValueStore):
    """py-libp2p's value store with a :class:`RecordLedger` beside it: capped per author and in total, and swept by
    expiry time alone.

    Why: py-libp2p stores every valid value (up to 50,000), for its own hard-coded 24 h. The audit stored 5
    identities x 2,000 signed records on a bootstrap node, and the old sweep re-validated all 10k (signatures
    included) in one go on the event loop: 5-10 s stalls, new joins failing their handshake. A record is now checked
    once, when stored (its author and signed expiry come from the validator's check of the same bytes); ``/pk``
    values have no author and count as one (``/pk``), so a flood of them gives way first, and live py-libp2p's 24 h.
    A refused record raises :class:`RecordError`: the PUT_VALUE handler resets the sender's stream.
    """

    def __init__(self, host: Any, local_peer_id: ID, ledger: RecordLedger, records: RecordsAndDirectories) -> None:
        super().__init__(host, local_peer_id)
        self.ledger = ledger
        self._records = records
        self._dirs: dict[bytes, dict[str, tuple[Any, bytes]]] = {}  # directory key -> its entries, decoded
        self._sources: dict[bytes, dict[str, str]] = {}  # directory key -> peer -> the network that sent its entry

    def _admit(self, key: bytes, value: bytes, *, own: bool = False) -> None:
        if key.startswith(_PK_PREFIX):
            author, expires_at = "/pk", clock.wall() + VALUE_TTL
        elif is_directory(value):  # one "author" per directory: its entries' own authors are checked, one each
            author = "/dir/" + key.hex()
            expires_at = max(record.expires_at for record, _ in self._dirs[key].values())
        else:  # strict validation stores nothing but our namespace and /pk
            record = self._records.checked(key.decode(), value)
            author, expires_at = record.peer_id, record.expires_at
        for old in self.ledger.admit(key, author, expires_at, own=own):
            super().remove(old)

    def put(self, key: bytes, value: bytes, validity: float = 0.0, *, own: bool = True) -> None:
        """The node's own ``put_value``: never refused (a Sybil flood must not stop a peer publishing its record).
        A directory entry is merged into the stored directory (:mod:`.directory`), which py-libp2p never
        re-publishes on its own (the announcer re-publishes each peer's entry)."""
        directory = is_directory(value)
        if directory:
            value = self._merged(key, value)
        self._admit(key, value, own=own)
        super().put(key, value, validity)
        if directory:
            self.local_keys.discard(key)

    def put_record(self, key: bytes, record: Record) -> None:
        if is_directory(record.value):  # merged, so signed again by us (every entry keeps its author's signature)
            self.put(key, record.value, own=False)
            return
        self._admit(key, record.value)
        super().put_record(key, record)

    def _merged(self, key: bytes, value: bytes) -> bytes:
        """Directory entries merged into the directory stored under ``key`` (:mod:`.directory`), kept decoded in
        ``_dirs`` so that only the new entries are checked; other values as they are. Raises
        :class:`RecordError` when the new entries do not decode."""
        if not is_directory(value):
            return value
        new = self._records.checked_directory(key.decode(), value)
        held = self._dirs.get(key, {}) if key in self.store else {}
        network = [k for k in PUT_SOURCE.get() if k.startswith("network ")]
        if network:  # keys are free, addresses are not: one network holds at most a few entries of a directory
            sources = self._sources.setdefault(key, {})
            mine = {peer for peer in held if sources.get(peer) == network[0]}
            fresh = [(r, e) for r, e in new if r.peer_id in mine or len(mine) < DIRECTORY_PER_NETWORK]
            if len(fresh) < len(new):
                log.info("directory entries from %s past its %d refused", network[0], DIRECTORY_PER_NETWORK)
            for record, _ in fresh:
                sources[record.peer_id] = network[0]
            new = fresh[:DIRECTORY_PER_NETWORK]  # (one store may carry many entries)
        entries = merge_entries(held, new)
        if not entries:
            raise RecordError("directory holds no valid record")
        self._dirs[key] = entries
        if key in self._sources:
            self._sources[key] = {p: n for p, n in self._sources[key].items() if p in entries}
        return encode_directory(entry for _, entry in entries.values())

    def remove(self, key: bytes) -> bool:
        self.ledger.discard(key)
        self._dirs.pop(key, None)
        self._sources.pop(key, None)
        return super().remove(key)

    def cleanup_expired(self) -> int:
        """py-libp2p's own clean-up (past its 24 h), keeping the ledger in step."""
        now = clock.wall()
        gone = [key for key, (_, validity) in self.store.items() if now > validity]
        for key in gone:
            self.remove(key)
        return len(gone)

    async def sweep_expired(self, batch: int) -> int:
        """Drop records past their own signed expiry, ``batch`` at a time with a checkpoint between; the count."""
        total = 0
        while True:
            keys = self.ledger.expired(clock.wall(), batch)
            for key in keys:
                self._dirs.pop(key, None)
                self._sources.pop(key, None)
                super().remove(key)
            total += len(keys)
            if len(keys) < batch:
                return total
            await trio.sleep(0)
