"""Networking: trio + py-libp2p (identity, host, signed records, DHT discovery, private fleets). No torch.

Public surface::

    async with open_host(HostConfig(...)) as node:      # a running libp2p host + DHT
        await node.connect(peer_id, addrs)              # announced public addresses first, then relays
        announcer = Announcer(node); await announcer.update(ServingOffer(model_id, start, end, ...))
        node.nursery.start_soon(announcer.run)          # re-publishes before expiry
        peers = await find_serving_peers(node, model_id)
"""

from .config import HostConfig, Limits
from .discovery import Announcer, ServingOffer, find_serving_peers
from .host import open_host
from .identity import default_key_path, load_or_create_key_pair, peer_id_of
from .node import Node
from .records import ServingRecord, decode_record, record_key, sign_record

__all__ = [
    "Announcer",
    "HostConfig",
    "Limits",
    "Node",
    "ServingOffer",
    "ServingRecord",
    "decode_record",
    "default_key_path",
    "find_serving_peers",
    "load_or_create_key_pair",
    "open_host",
    "peer_id_of",
    "record_key",
    "sign_record",
]
