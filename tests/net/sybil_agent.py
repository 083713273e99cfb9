"""Run in a network namespace: many fresh keys from one address open sessions on one stage (issue 26, Sybils).

argv: STAGE_PEER_ID STAGE_MULTIADDR MODEL_ID START END KEYS SESSIONS_PER_KEY. Each key is its own libp2p host (a new
identity, the same IP address), opens one stage stream and asks for SESSIONS_PER_KEY sessions; prints one JSON line
``{"opened": n, "refused": [message, ...]}``, then holds the sessions open until stdin closes.
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import AsyncExitStack

import trio
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from multiaddr import Multiaddr

from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.messages import ErrorMessage, OpenSession, SessionOpened
from sangama_p2p.wire.protocols import STAGE_PROTOCOL


async def main() -> None:
    peer, addr, model, start, end, keys, per_key = sys.argv[1:8]
    opened, refused = 0, []
    async with AsyncExitStack() as stack:
        for k in range(int(keys)):
            cfg = HostConfig(listen_addrs=("/ip4/0.0.0.0/tcp/0",), key_path=None, handshake_timeout=10.0)
            node = await stack.enter_async_context(open_host(cfg, key_pair=generate_key_pair()))
            await node.host.connect(info_from_p2p_addr(Multiaddr(f"{addr}/p2p/{peer}")))
            fs = FramedStream(await node.host.new_stream(ID.from_base58(peer), [STAGE_PROTOCOL]))
            me = node.peer_id.to_base58()
            for _ in range(int(per_key)):
                await fs.send(OpenSession(os.urandom(16), model, int(start), int(end), None, None, me, 64, 0.0, 1.0,
                                          0, 0, False))
                reply = await fs.recv()
                if isinstance(reply, SessionOpened):
                    opened += 1
                elif isinstance(reply, ErrorMessage):
                    refused.append(reply.message)
        print(json.dumps({"opened": opened, "refused": refused}), flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)  # hold every session until the test closes stdin


if __name__ == "__main__":
    trio.run(main)
