"""Run in a network namespace: a stage that computes and then answers a constant token (issue 26: a ban that follows
a liar's address). tests/client/liars.py's ``lie_constant`` on a real ``Peer`` stage, listening on the given port.

argv: MODEL_DIR BOOTSTRAP KEY_FILE PORT TOKEN. Prints ``ready <peer id>`` once it serves, then serves until killed.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import trio

from sangama_p2p.net.config import HostConfig
from sangama_p2p.peer import Peer, PeerConfig


def _liars():
    path = Path(__file__).resolve().parents[1] / "client" / "liars.py"
    spec = importlib.util.spec_from_file_location("sangama_liars", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


async def main() -> None:
    model, boot, key, port, token = sys.argv[1:6]
    host = HostConfig(listen_addrs=(f"/ip4/0.0.0.0/tcp/{port}",), bootstrap_addrs=(boot,), key_path=Path(key))
    async with Peer(PeerConfig(host=host)) as peer:
        await peer.serve(model, "0:8", tokenizer=False, lanes=False)
        _liars().lie_constant(peer.servers[0], int(token))
        print("ready", peer.peer_id, flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main)
