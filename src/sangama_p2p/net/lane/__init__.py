"""Direct lanes: stage frames on a plain TCP connection, keyed through an authenticated libp2p stream.

Why: py-libp2p's Noise + Yamux spends about 0.2 ms of Python per 8 KiB frame on each side (``benchmarks/net.py``,
docs/benchmarks.md "Network": a four-hop trip of 8 KiB frames took 2.8 ms over our Noise + Yamux host, 0.31 ms over
plain trio TCP and 0.37 ms over lanes). A pipeline trip is four such hops, so for small models the transport cost
more than the compute.
A lane keeps libp2p for what it is good at (identity, discovery, NAT traversal, relays) and moves only the
long-lived stage traffic between two directly connected peers onto a TCP connection of its own.

Handshake (the upstream side, a client or the previous stage, always dials; only stage servers listen)::

    upstream                                             stage (LaneListener)
    -- /sangama/lane/3 stream (Noise, peer ids checked) -->
    <-------------- LaneOffer(port, token, key) ----------   used once, expires after ``offer_ttl`` s
    == TCP connect to <remote IP of that libp2p connection>:port ==>
    -- token + dialler nonce + record(hello) ------------->   all of it read, then checked and claimed at once
    <------------- stage nonce + record(ready) -----------   the lane now serves /sangama/stage/2 frames

The bytes and the key schedule are in :mod:`sangama_p2p.net.lane.handshake`: each connection's key is derived from
the offer's key and fresh nonces of both sides, and the offer is claimed without yielding between looking it up and
removing it, so a handshake replayed on a second connection is refused and no two lanes ever share a key.

After the handshake every write is one record ``[u32 big-endian length][AES-256-GCM ciphertext + 16-byte tag]``
with the nonce ``direction byte (0 upstream->stage, 1 back) + 3 zero bytes + u64 record counter``: records cannot be
forged, replayed, dropped or reordered without failing authentication, which closes the lane. The key derives from
one that travelled inside the Noise-encrypted stream to the authenticated peer, so the lane belongs to that peer id
(:attr:`LaneStream.muxed_conn` ``.peer_id``) exactly as the libp2p stream did, and session ownership checks work
unchanged. Relayed connections never get a lane (the address would be the relay's). Anything that fails before
``ready`` (no lane protocol, a closed port, a reset, NAT, a timeout) raises :class:`LaneError`, and the caller uses
a ``/sangama/stage/2`` stream over libp2p instead.

Handshakes are bounded before anyone has proved anything: at most ``max_handshakes`` at once and
``max_handshakes_per_source`` per source IP (a new connection over either bound cuts the oldest handshake, so idle
connections cannot hold the slots), each cut after ``handshake_timeout`` (2 s). Lanes are bounded per peer: one
that holds ``max_lanes_per_peer`` open lanes is answered ``CAPACITY`` instead of an offer (it uses libp2p streams),
so no peer can take the stage's file descriptors. With a ``budget`` (a
:class:`~sangama_p2p.wire.framing.ByteBudget` shared with the stage's other streams), a record that does not arrive
whole holds its bytes in it (and in its peer's share) as they arrive, and the lane fails when the budget cannot
cover them or the record misses its deadline.

:class:`LaneStream` has the surface :class:`~sangama_p2p.net.streams.FramedStream` reads from a py-libp2p stream
(``read``, ``write``, ``close``, ``reset``, ``muxed_conn.peer_id``), so everything above it is unchanged.
"""


from .dialer import LaneDialer, open_lane
from .handshake import HELLO, READY
from .listener import LaneListener, lanes_offered
from .records import LaneStream

__all__ = ["HELLO", "READY", "LaneDialer", "LaneListener", "LaneStream", "lanes_offered", "open_lane"]
