"""Run inside a network namespace whose firewall drops SYNs to the lane port (see test_lane_firewall.py).

A bootstrap node, one stage peer serving a whole tiny model with ``lane_port=PORT`` and a client, all on 127.0.0.1 in
this process. Prints one JSON line: the tokens over the network and those of the same model run locally, which links
the stage saw, and what the client's lane dialer remembered.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import trio

from sangama_p2p.client import ChainClient, ClientConfig
from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.model.spec import LayerRange
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.stage import StageConfig, StageServer

PROMPT = [1, 5, 9, 2]


def host(**changes: object) -> HostConfig:
    return HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), handshake_timeout=3.0, **changes)  # type: ignore[arg-type]


async def main(port: int, lane_timeout: float) -> dict:
    ckpt = open_checkpoint(make_model(Path(tempfile.mkdtemp()) / "m", "qwen3_5_moe", "tiny"))
    want = LocalChain.load(ckpt, [LayerRange(0, ckpt.spec.num_layers)]).generate(PROMPT, 6, stop_at_eos=False).tokens
    async with open_host(host(), key_pair=generate_key_pair()) as boot:
        boot_addr = str(boot.advertised_addrs()[0])
        async with open_host(host(bootstrap_addrs=(boot_addr,)), key_pair=generate_key_pair()) as node:
            config = StageConfig(model_id="m", start=0, end=ckpt.spec.num_layers, lane_port=port)
            server = StageServer.load(node, ckpt, config)
            async with server:
                async with open_host(host(bootstrap_addrs=(boot_addr,), dht_server=False),
                                     key_pair=generate_key_pair()) as cnode:
                    async with ChainClient(cnode, ClientConfig("m", lane_timeout=lane_timeout)) as client:
                        t0 = time.monotonic()
                        first = await client.generate(PROMPT, 6)
                        first_s = time.monotonic() - t0
                        t0 = time.monotonic()
                        second = await client.generate(PROMPT, 6)
                        second_s = time.monotonic() - t0
                        return {"want": want, "first": first.tokens, "second": second.tokens,
                                "first_s": first_s, "second_s": second_s,
                                "bound_port": server.lane_listener.bound_port if server.lane_listener else 0,
                                "links": server.link_kinds(),
                                "failed": {p: why for p, (_, why) in client.pool.lanes.failed.items()}}


if __name__ == "__main__":
    print(json.dumps(trio.run(main, int(sys.argv[1]), float(sys.argv[2]))), flush=True)
