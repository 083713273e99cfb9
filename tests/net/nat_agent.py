"""A Sangama node driven over stdin/stdout JSON lines, for the network-namespace tests (see ``netns.py``).

Run as ``python nat_agent.py --port P [--relay] [--key FILE] [--bootstrap ADDR] [--announce ADDR]``. It prints one
``{"event": "ready", ...}`` line once its reachability is known (and, if private, a reservation was tried), then
answers each command line ``{"id": n, "cmd": ..., ...}`` with ``{"id": n, "ok": true, ...}`` or an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from dataclasses import asdict
from typing import Any

import trio
from libp2p.abc import INetStream
from libp2p.custom_types import TProtocol
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.holepunch import LinkInfo, stream_link
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair, load_key_pair
from sangama_p2p.net.node import Node
from sangama_p2p.net.traversal import Traversal, TraversalConfig
from sangama_p2p.wire.framing import encode_frame, read_frame

ECHO = TProtocol("/sangama-test/echo/1")


async def _frame(stream: INetStream) -> bytes | None:
    async def read(n: int) -> bytes:
        try:
            return await stream.read(n)
        except StreamEOF:
            return b""

    return await read_frame(read, max_frame=1 << 20)


async def echo_handler(stream: INetStream) -> None:
    try:
        while (frame := await _frame(stream)) is not None:
            await stream.write(encode_frame(frame))
    except Exception:
        pass
    finally:
        await stream.close()


def _link(info: LinkInfo | None) -> dict[str, Any] | None:
    return None if info is None else {**asdict(info), "text": str(info)}


class Agent:
    def __init__(self, node: Node, traversal: Traversal) -> None:
        self.node = node
        self.traversal = traversal

    async def cmd_info(self) -> dict[str, Any]:
        t = self.traversal
        client = t.relay_client
        return {
            "reachability": t.reachability.value,
            "public_addrs": list(t.report.public_addrs) if t.report else [],
            "reach_errors": list(t.report.errors) if t.report else [],
            "circuit_addrs": [str(a) for a in client.circuit_addrs()] if client else [],
            "addrs": [str(a) for a in self.node.advertised_addrs()],
            "reservations": [asdict(r) for r in client.reservations] if client else [],
            "refreshes": client.refreshes if client else 0,
            "punches": t.puncher.attempts if t.puncher else 0,
        }

    async def cmd_dial_direct(self, peer_id: str, addrs: list[str], limit: float) -> dict[str, Any]:
        """One plain direct dial, no relay fallback: the test expects it to fail through a NAT."""
        start = time.monotonic()
        network = self.node.host.get_network()
        error = "timed out"
        with trio.move_on_after(limit):
            for addr in addrs:
                try:
                    await network.dial_addr(Multiaddr(addr), ID.from_base58(peer_id))
                    return {"connected": True, "elapsed": time.monotonic() - start}
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"
        return {"connected": False, "error": error, "elapsed": time.monotonic() - start}

    async def cmd_connect(self, peer_id: str, addrs: list[str]) -> dict[str, Any]:
        start = time.monotonic()
        info = await self.traversal.connect(ID.from_base58(peer_id), addrs)
        return {"link": _link(info), "elapsed": time.monotonic() - start}

    async def cmd_link(self, peer_id: str) -> dict[str, Any]:
        return {"link": _link(self.traversal.link(ID.from_base58(peer_id)))}

    async def cmd_drop(self, peer_id: str) -> dict[str, Any]:
        """Close every connection to the peer (as a NAT timeout or a network change would)."""
        conns = self.node.connections(ID.from_base58(peer_id))
        for conn in conns:
            await conn.close()
        return {"closed": len(conns)}

    async def cmd_wait_direct(self, peer_id: str, limit: float) -> dict[str, Any]:
        start = time.monotonic()
        info = await self.traversal.wait_direct(ID.from_base58(peer_id), limit)
        return {"link": _link(info), "elapsed": time.monotonic() - start}

    async def cmd_echo(self, peer_id: str, count: int, size: int) -> dict[str, Any]:
        """Send ``count`` frames of ``size`` bytes on a new stream, check every echo, report the stream's link."""
        stream = await self.node.host.new_stream(ID.from_base58(peer_id), [ECHO])
        rtts = []
        try:
            for i in range(count):
                payload = os.urandom(size)
                start = time.monotonic()
                await stream.write(encode_frame(payload))
                back = await _frame(stream)
                rtts.append(time.monotonic() - start)
                if back != payload:
                    raise RuntimeError(f"echo {i} came back different ({None if back is None else len(back)} bytes)")
            return {"link": _link(stream_link(stream)), "rtt_median": sorted(rtts)[len(rtts) // 2]}
        finally:
            await stream.close()


async def serve_commands(agent: Agent) -> None:
    stdin = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buf = b""
    while True:
        chunk = await stdin.receive_some(65536)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            request = json.loads(line)
            ident, cmd = request.pop("id"), request.pop("cmd")
            try:
                result = await getattr(agent, f"cmd_{cmd}")(**request)
                reply = {"id": ident, "ok": True, **result}
            except Exception as exc:
                reply = {"id": ident, "ok": False, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(reply), flush=True)


async def wait_for_listener(addr: str, limit: float = 30.0) -> None:
    """Wait until the bootstrap node accepts TCP: all agents start at once, and it may not listen yet."""
    ma = Multiaddr(addr)
    target = (ma.value_for_protocol("ip4"), int(ma.value_for_protocol("tcp")))
    with trio.fail_after(limit):
        while True:
            try:
                stream = await trio.open_tcp_stream(*target)
            except OSError:
                await trio.sleep(0.1)
                continue
            await stream.aclose()
            return


async def main(args: argparse.Namespace) -> None:
    for addr in args.bootstrap:
        await wait_for_listener(addr)
    config = HostConfig(
        listen_addrs=(f"/ip4/0.0.0.0/tcp/{args.port}",),
        announce_addrs=tuple(args.announce),
        bootstrap_addrs=tuple(args.bootstrap),
        relay_hop=args.relay,
        handshake_timeout=3.0,
    )
    traversal = Traversal(TraversalConfig(reachability="public" if args.relay else None))
    key_pair = load_key_pair(args.key) if args.key else generate_key_pair()
    async with open_host(config, key_pair=key_pair, services=[traversal.run]) as node:
        node.host.set_stream_handler(ECHO, echo_handler)
        with trio.fail_after(30):
            await traversal.wait_ready()
        ready = {"event": "ready", "peer_id": str(node.peer_id), "addrs": [str(a) for a in node.advertised_addrs()]}
        print(json.dumps(ready), flush=True)
        await serve_commands(Agent(node, traversal))


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--relay", action="store_true")
    parser.add_argument("--bootstrap", action="append", default=[])
    parser.add_argument("--announce", action="append", default=[])
    parser.add_argument("--key", type=Path, default=None, help="key file (lets the test know the peer id up front)")
    parsed = parser.parse_args()
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="%(relativeCreated)6d %(name)s %(levelname)s %(message)s")
    logging.getLogger("sangama_p2p").setLevel(logging.INFO)
    trio.run(main, parsed)
