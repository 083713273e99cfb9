"""An in-process swarm on loopback: N nodes in one trio nursery, the first a bootstrap node."""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.node import Node

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


_KEYS = Path(tempfile.mkdtemp(prefix="sangama-test-keys-"))
atexit.register(shutil.rmtree, _KEYS, ignore_errors=True)  # the run's keys and their locks leave nothing in TMPDIR


def config(**changes: object) -> HostConfig:
    """A loopback config with its own fresh key file (never the user's ``~/.sangama`` key)."""
    base = {"listen_addrs": LOOPBACK, "handshake_timeout": 10.0, "key_path": _KEYS / f"{uuid.uuid4().hex}.key"}
    base.update(changes)
    return HostConfig(**base)  # type: ignore[arg-type]


def first_addr(node: Node) -> str:
    return str(node.advertised_addrs()[0])


@asynccontextmanager
async def swarm(n: int, **changes: object) -> AsyncIterator[list[Node]]:
    """``n`` nodes (DHT servers): node 0 is the bootstrap node, the others bootstrap from it."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_host(config(**changes), key_pair=generate_key_pair()))
        nodes = [boot]
        for _ in range(n - 1):
            cfg = config(bootstrap_addrs=(first_addr(boot),), **changes)
            nodes.append(await stack.enter_async_context(open_host(cfg, key_pair=generate_key_pair())))
        yield nodes
