"""A stage peer as its own OS process, for the multi-process test: prints ``READY <peer id>`` once serving.

Usage: ``python stage_peer.py CKPT START END BOOTSTRAP_ADDR MODEL_ID KEY_PATH``
"""

from __future__ import annotations

import sys

import torch
import trio

from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.stage import StageConfig, StageServer


async def main(ckpt: str, start: int, end: int, boot: str, model_id: str, key_path: str) -> None:
    config = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(boot,), key_path=key_path,
                        handshake_timeout=3.0)
    async with open_host(config) as node:
        cfg = StageConfig(model_id=model_id, start=start, end=end, batch_invariant=True)
        server = await trio.to_thread.run_sync(StageServer.load, node, open_checkpoint(ckpt), cfg)
        async with server:
            print("READY", node.peer_id.to_base58(), flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    torch.set_num_threads(1)
    a = sys.argv[1:]
    trio.run(main, a[0], int(a[1]), int(a[2]), a[3], a[4], a[5])
