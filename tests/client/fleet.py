"""An in-process pipeline fleet on loopback: a bootstrap node, stage peers holding a tiny model, client nodes.

Shared by tests/client and tests/stage (loaded by path, see ``load_fleet`` in each conftest).
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import Checkpoint, open_checkpoint
from sangama_p2p.model.spec import LayerRange
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.node import Node
from sangama_p2p.stage import StageConfig, StageServer

MODEL = "test-org/tiny-pipeline"
_KEYS = Path(tempfile.mkdtemp(prefix="sangama-pipeline-keys-"))
atexit.register(shutil.rmtree, _KEYS, ignore_errors=True)  # the run's keys and their locks leave nothing in TMPDIR


def host_config(**changes: Any) -> HostConfig:
    base: dict[str, Any] = {"listen_addrs": ("/ip4/127.0.0.1/tcp/0",), "handshake_timeout": 10.0,
                            "key_path": _KEYS / f"{uuid.uuid4().hex}.key"}
    base.update(changes)
    return HostConfig(**base)


def make_checkpoint(root: Path, *, vocab: int | None = 16, seed: int = 4) -> Path:
    """The tiny Qwen3.5-MoE model (8 layers, MTP); with ``vocab`` only its first rows, so MTP guesses often match."""
    from sangama_p2p.model.make import make_model, truncate_vocab

    src = make_model(root / "made", "qwen3_5_moe", "tiny", seed=seed)
    if vocab is None:
        return src
    return truncate_vocab(src, root / f"v{vocab}", vocab)


def local_chain(path: Path, ranges: Sequence[tuple[int, int]], *, batch_invariant: bool = False) -> LocalChain:
    return LocalChain.load(open_checkpoint(path), [LayerRange(a, b) for a, b in ranges],
                           batch_invariant=batch_invariant)


@dataclass
class Fleet:
    boot: Node
    ckpt: Checkpoint
    stages: list[tuple[Node, StageServer, trio.CancelScope]] = field(default_factory=list)
    clients: list[Node] = field(default_factory=list)
    stack: AsyncExitStack | None = None

    @property
    def boot_addr(self) -> str:
        return str(self.boot.advertised_addrs()[0])

    async def add_stage(self, start: int, end: int, *, ckpt: Checkpoint | None = None, **config: Any) -> StageServer:
        """A new peer serving ``[start, end)`` of ``ckpt`` (default: the fleet's checkpoint); cancel
        ``stages[i][2]`` to kill it (node and server). The stages measure no links unless asked
        (``measure_links_every``): on loopback in one process a ping measures the event loop's delays, which made
        routing, and the tests that expect a given chain, depend on the machine's load."""
        config.setdefault("measure_links_every", 0.0)
        ready: list[Any] = []
        done = trio.Event()

        async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                try:
                    async with open_host(host_config(bootstrap_addrs=(self.boot_addr,)),
                                         key_pair=generate_key_pair()) as node:
                        cfg = StageConfig(model_id=MODEL, start=start, end=end, **config)
                        server = await trio.to_thread.run_sync(StageServer.load, node, ckpt or self.ckpt, cfg)
                        async with server:
                            ready.append((node, server, scope))
                            task_status.started()
                            await trio.sleep_forever()
                finally:
                    done.set()

        assert self.stack is not None
        nursery = self._nursery
        await nursery.start(serve)
        self.stages.append(ready[0])
        return ready[0][1]

    async def add_client(self) -> Node:
        assert self.stack is not None
        node = await self.stack.enter_async_context(
            open_host(host_config(bootstrap_addrs=(self.boot_addr,)), key_pair=generate_key_pair()))
        self.clients.append(node)
        return node

    def kill(self, i: int) -> None:
        self.stages[i][2].cancel()

    _nursery: Any = None


@asynccontextmanager
async def fleet(ckpt_dir: Path, ranges: Sequence[tuple[int, int]] = (), clients: int = 1,
                **stage_config: Any) -> AsyncIterator[Fleet]:
    """Bootstrap node + one stage peer per range + ``clients`` client nodes, all on 127.0.0.1."""
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_host(host_config(), key_pair=generate_key_pair()))
        nursery = await stack.enter_async_context(trio.open_nursery())
        try:
            # clients live in their own stack, closed BEFORE the stages' nursery is cancelled: a cancelled scope
            # around a closing host would turn the test's own exception into a Cancelled and swallow it
            async with AsyncExitStack() as inner:
                f = Fleet(boot, open_checkpoint(ckpt_dir), stack=inner)
                f._nursery = nursery
                for a, b in ranges:
                    await f.add_stage(a, b, **stage_config)
                for _ in range(clients):
                    await f.add_client()
                yield f
        finally:
            nursery.cancel_scope.cancel()
