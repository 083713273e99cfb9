"""Network benchmark: tensor frames through our libp2p host, over direct lanes and over plain trio TCP, a 4-hop
chain, and discovery time.

    python benchmarks/net.py [--quick] [--baseline] [--profile]

Every remote end runs in its own process (as peers do), on loopback. Frames are wire frames (``encode_frame`` +
``FrameReader``: 4-byte length prefix, 256 KiB reads) carrying a raw bf16-sized payload. Measured:

* RTT: one frame out, the same frame echoed back, median over many trips; throughput: frames streamed one way
  while the echo drains them (payload MB/s);
* chain: client -> B -> C -> D -> client, each hop a long-lived stream carrying all frames (8 KiB), per trip;
* discovery: a DHT-client node joins a 20-peer swarm (10 serving a model) and calls ``find_serving_peers``.

Prints a table and writes ``benchmarks/results/net.json``. ``--baseline`` runs with py-libp2p's Yamux defaults
(a window update after every read, 256 KiB windows) and writes ``results/net_baseline.json``, to show what
``HostConfig.batch_window_updates`` and ``widen_receive_window`` win. ``--profile`` writes a cProfile of one
forwarding peer to ``benchmarks/results/net_forwarder.prof``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import trio

from sangama_p2p.wire.framing import FrameReader, encode_frame

PROTO = "/sangama/bench/1"
SIZES = (8 * 1024, 64 * 1024, 1024 * 1024)
RESULTS = Path(__file__).resolve().parent / "results"


# ----------------------------------------------------------------------------- child processes
def _net_reader(stream):
    from libp2p.stream_muxer.exceptions import MuxedStreamEOF

    async def read(n: int) -> bytes:
        try:
            return await stream.read(n)
        except MuxedStreamEOF:
            return b""

    return FrameReader(read)


async def _widen(stream) -> None:
    """Grant the peer a 16 MiB window (skipped in the --baseline run)."""
    if not os.environ.get("SANGAMA_BENCH_BASELINE"):
        from sangama_p2p.net.host import widen_receive_window

        await widen_receive_window(stream)


def _tcp_reader(stream: trio.SocketStream) -> FrameReader:
    return FrameReader(stream.receive_some)


async def _pump(reader: FrameReader, write) -> None:
    """Forward frames from ``reader`` to ``write`` until end of stream (echo or next hop)."""
    while (frame := await reader.next_frame()) is not None:
        await write(encode_frame(frame))


async def _child_libp2p(next_addr: str | None) -> None:
    """Echo (no next) or forward (to ``next_addr``) every frame of every inbound stream."""
    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair
    from libp2p.peer.peerinfo import info_from_p2p_addr
    import multiaddr

    async with open_host(HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",)), key_pair=generate_key_pair()) as node:
        async def handler(stream) -> None:
            await _widen(stream)
            if next_addr is None:
                await _pump(_net_reader(stream), stream.write)
            else:
                info = info_from_p2p_addr(multiaddr.Multiaddr(next_addr))
                await node.connect(info.peer_id, info.addrs)
                out = await node.host.new_stream(info.peer_id, [PROTO])
                await _pump(_net_reader(stream), out.write)

        node.host.set_stream_handler(PROTO, handler)
        print(node.advertised_addrs()[0], flush=True)
        await trio.sleep_forever()


async def _child_lane(next_addr: str | None) -> None:
    """As _child_libp2p, over direct lanes (``sangama_p2p.net.lane``): libp2p only keys them."""
    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair
    from sangama_p2p.net.lane import LaneListener

    async with open_host(HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",)), key_pair=generate_key_pair()) as node:
        async with trio.open_nursery() as nursery:
            async def on_lane(lane) -> None:
                async def serve() -> None:
                    if next_addr is None:
                        await _pump(FrameReader(lane.read), lane.write)
                    else:
                        out = await _Client.lane(node, next_addr)
                        await _pump(FrameReader(lane.read), out.send)

                nursery.start_soon(serve)

            await nursery.start(LaneListener(node, on_lane).run)
            print(node.advertised_addrs()[0], flush=True)
            await trio.sleep_forever()


async def _child_tcp(next_port: int | None) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        if next_port is None:
            await _pump(_tcp_reader(stream), stream.send_all)
        else:
            out = await trio.open_tcp_stream("127.0.0.1", next_port)
            await _pump(_tcp_reader(stream), out.send_all)

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    print(listeners[0].socket.getsockname()[1], flush=True)
    await trio.serve_listeners(handler, listeners)


def _spawn(kind: str, next_hop: str | None, profile: str | None = None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, __file__, "--child", kind] + (["--next", next_hop] if next_hop else [])
    if profile:
        args = [sys.executable, "-m", "cProfile", "-o", profile, __file__, "--child", kind] + (
            ["--next", next_hop] if next_hop else []
        )
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) used so far by this process and the given children: a cost that, unlike wall
    time, barely moves when other work shares the machine."""
    total = time.process_time()
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


# ----------------------------------------------------------------------------- client side
class _Client:
    """One end of a benchmark link: ``send(frame)`` and ``reader`` over libp2p or TCP."""

    @classmethod
    async def libp2p(cls, node, addr: str):
        from libp2p.peer.peerinfo import info_from_p2p_addr
        import multiaddr

        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        await node.connect(info.peer_id, info.addrs)
        stream = await node.host.new_stream(info.peer_id, [PROTO])
        await _widen(stream)
        self = cls()
        self.send, self.reader, self.close = stream.write, _net_reader(stream), stream.close
        return self

    @classmethod
    async def lane(cls, node, addr: str):
        from libp2p.peer.peerinfo import info_from_p2p_addr
        import multiaddr

        from sangama_p2p.net.lane import open_lane

        info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        await node.connect(info.peer_id, info.addrs)
        lane = await open_lane(node, info.peer_id)
        self = cls()
        self.send, self.reader, self.close = lane.write, FrameReader(lane.read), lane.close
        return self

    @classmethod
    async def tcp(cls, port: int):
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        self = cls()
        self.send, self.reader, self.close = stream.send_all, _tcp_reader(stream), stream.aclose
        return self


async def _rtt_and_throughput(send, reader, size: int, trips: int, pids: list[int]) -> tuple[float, float, float]:
    frame = encode_frame(os.urandom(size))
    for _ in range(5):  # warm-up
        await send(frame)
        await reader.next_frame()
    times = []
    cpu0 = _cpu_s(pids)
    for _ in range(trips):
        t0 = time.perf_counter()
        await send(frame)
        await reader.next_frame()
        times.append(time.perf_counter() - t0)
    cpu_us = (_cpu_s(pids) - cpu0) / trips * 1e6
    count = max(8, min(2000, (64 << 20) // size))
    t0 = time.perf_counter()
    async with trio.open_nursery() as nursery:
        async def sender() -> None:
            for _ in range(count):
                await send(frame)

        nursery.start_soon(sender)
        for _ in range(count):
            await reader.next_frame()
    elapsed = time.perf_counter() - t0
    return statistics.median(times) * 1000, count * size / elapsed / 1e6, cpu_us


async def _bench_links(quick: bool) -> dict[str, dict[str, float]]:
    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair

    out: dict[str, dict[str, float]] = {}
    tcp_proc, port = _spawn("tcp", None)
    p2p_proc, addr = _spawn("libp2p", None)
    lane_proc, lane_addr = _spawn("lane", None)
    try:
        cfg = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
        async with open_host(cfg, key_pair=generate_key_pair()) as node:
            clients = {
                "plain trio TCP": (await _Client.tcp(int(port)), tcp_proc.pid),
                "sangama host (Noise+Yamux)": (await _Client.libp2p(node, addr), p2p_proc.pid),
                "sangama lane (TCP+AES-GCM)": (await _Client.lane(node, lane_addr), lane_proc.pid),
            }
            for name, (client, pid) in clients.items():
                for size in SIZES:
                    trips = (50 if quick else 300) if size < (1 << 20) else (10 if quick else 40)
                    rtt, mbs, cpu_us = await _rtt_and_throughput(client.send, client.reader, size, trips, [pid])
                    out.setdefault(name, {})[f"rtt_ms_{size // 1024}k"] = round(rtt, 3)
                    out[name][f"mb_s_{size // 1024}k"] = round(mbs, 1)
                    out[name][f"cpu_us_per_trip_{size // 1024}k"] = round(cpu_us)
                await client.close()
    finally:
        for proc in (tcp_proc, p2p_proc, lane_proc):
            proc.kill()
            proc.wait()
    return out


async def _bench_chain(quick: bool, profile: bool) -> dict[str, float]:
    """Client A -> B -> C -> D -> A; returns per-trip median ms for plain TCP and for our host."""
    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair

    trips = 100 if quick else 500
    frame = encode_frame(os.urandom(8 * 1024))
    result: dict[str, float] = {}

    async def run_trips(name: str, send, inbound: trio.MemoryReceiveChannel) -> None:
        reader = await inbound.receive()
        times = []
        pids = [p.pid for p in procs[-3:]]
        for i in range(trips + 10):
            if i == 10:
                cpu0 = _cpu_s(pids)
            t0 = time.perf_counter()
            await send(frame)
            await reader.next_frame()
            if i >= 10:
                times.append(time.perf_counter() - t0)
        result[name] = round(statistics.median(times) * 1000, 3)
        result[f"{name} cpu_us_per_trip"] = round((_cpu_s(pids) - cpu0) / trips * 1e6)

    # plain TCP: A listens for D's stream
    send_ch, recv_ch = trio.open_memory_channel(1)
    async def tcp_inbound(stream):
        await send_ch.send(_tcp_reader(stream))
        await trio.sleep_forever()

    procs = []
    try:
        async with trio.open_nursery() as nursery:
            listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
            nursery.start_soon(trio.serve_listeners, tcp_inbound, listeners)
            hop = str(listeners[0].socket.getsockname()[1])
            for _ in range(3):
                proc, hop = _spawn("tcp", hop)
                procs.append(proc)
            client = await _Client.tcp(int(hop))
            await run_trips("plain trio TCP", client.send, recv_ch)
            nursery.cancel_scope.cancel()

        send_ch, recv_ch = trio.open_memory_channel(1)
        cfg = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
        async with open_host(cfg, key_pair=generate_key_pair()) as node:
            async def p2p_inbound(stream):
                await _widen(stream)
                await send_ch.send(_net_reader(stream))
                await trio.sleep_forever()

            node.host.set_stream_handler(PROTO, p2p_inbound)
            hop = str(node.advertised_addrs()[0])
            for i in range(3):
                prof = str(RESULTS / "net_forwarder.prof") if profile and i == 1 else None
                proc, hop = _spawn("libp2p", hop, prof)
                procs.append(proc)
            client = await _Client.libp2p(node, hop)
            await run_trips("sangama host (Noise+Yamux)", client.send, recv_ch)

        send_ch, recv_ch = trio.open_memory_channel(1)
        async with open_host(cfg, key_pair=generate_key_pair()) as node, trio.open_nursery() as nursery:
            from sangama_p2p.net.lane import LaneListener

            async def lane_inbound(lane) -> None:
                await send_ch.send(FrameReader(lane.read))

            await nursery.start(LaneListener(node, lane_inbound).run)
            hop = str(node.advertised_addrs()[0])
            for _ in range(3):
                proc, hop = _spawn("lane", hop)
                procs.append(proc)
            client = await _Client.lane(node, hop)
            await run_trips("sangama lane (TCP+AES-GCM)", client.send, recv_ch)
            nursery.cancel_scope.cancel()
    finally:
        for proc in procs:
            if profile:
                proc.send_signal(2)
            else:
                proc.kill()
            proc.wait()
    return result


async def _bench_discovery(quick: bool) -> dict[str, float]:
    import logging
    from contextlib import AsyncExitStack

    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.discovery import Announcer, ServingOffer, find_serving_peers
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)
    logging.getLogger().setLevel(logging.CRITICAL)
    n_peers, n_serving = 20, 10
    cfg = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",))
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_host(cfg, key_pair=generate_key_pair()))
        boot_addr = str(boot.advertised_addrs()[0])
        nodes = [boot]
        for _ in range(n_peers - 1):
            nodes.append(await stack.enter_async_context(
                open_host(cfg.replace(bootstrap_addrs=(boot_addr,)), key_pair=generate_key_pair())))
        for i, node in enumerate(nodes[1 : n_serving + 1]):
            await Announcer(node).update(ServingOffer("bench/model", i * 4, i * 4 + 4, throughput=10.0, ttl=600,
                                                 fingerprint="5a" * 16, num_layers=4 * n_serving))
        times, found = [], 0
        for _ in range(2 if quick else 5):
            async with open_host(cfg.replace(bootstrap_addrs=(boot_addr,), dht_server=False),
                                 key_pair=generate_key_pair()) as client:
                t0 = time.perf_counter()
                found = len(await find_serving_peers(client, "bench/model"))
                times.append(time.perf_counter() - t0)
    return {"peers": n_peers, "serving": n_serving, "found": found, "median_s": round(statistics.median(times), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer trips (a smoke run)")
    parser.add_argument("--profile", action="store_true", help="cProfile the middle forwarder of the chain")
    parser.add_argument("--baseline", action="store_true",
                        help="py-libp2p's Yamux defaults: a window update after every read, 256 KiB windows "
                        "(writes results/net_baseline.json)")
    parser.add_argument("--child", choices=["tcp", "libp2p", "lane"], help=argparse.SUPPRESS)
    parser.add_argument("--next", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.baseline:
        os.environ["PY_YAMUX_RELEASE_ON_READ"] = "1"  # children inherit both; HostConfig's default then yields
        os.environ["SANGAMA_BENCH_BASELINE"] = "1"
    if args.child == "tcp":
        trio.run(_child_tcp, int(args.next) if args.next else None)
        return
    if args.child in ("libp2p", "lane"):
        import logging

        logging.disable(logging.CRITICAL)
        try:
            trio.run(_child_libp2p if args.child == "libp2p" else _child_lane, args.next)
        except KeyboardInterrupt:
            pass
        return
    import logging

    logging.disable(logging.CRITICAL)
    links = trio.run(_bench_links, args.quick)
    chain = trio.run(_bench_chain, args.quick, args.profile)
    discovery = trio.run(_bench_discovery, args.quick)

    from rich.console import Console
    from rich.table import Table

    load = os.getloadavg()[0]
    table = Table(title=f"Frames on loopback, separate processes (1-min load {load:.1f} on {os.cpu_count()} CPUs)")
    table.add_column("transport")
    for size in SIZES:
        table.add_column(f"RTT {size // 1024}K ms", justify="right")
    for size in SIZES:
        table.add_column(f"MB/s {size // 1024}K", justify="right")
    table.add_column("CPU us/trip 8K", justify="right")
    table.add_column("4-hop trip ms", justify="right")
    table.add_column("4-hop CPU us/trip", justify="right")
    for name, row in links.items():
        table.add_row(name, *[f"{row[f'rtt_ms_{s // 1024}k']:.3f}" for s in SIZES],
                      *[f"{row[f'mb_s_{s // 1024}k']:.0f}" for s in SIZES], str(row["cpu_us_per_trip_8k"]),
                      f"{chain[name]:.3f}", str(chain[f"{name} cpu_us_per_trip"]))
    console = Console(width=160)
    console.print(table)
    console.print(f"discovery: {discovery['found']}/{discovery['serving']} serving peers found in a "
                  f"{discovery['peers']}-peer swarm in {discovery['median_s']:.3f} s (median)")
    console.print("CPU us/trip: CPU time of every process on the path (both ends, all forwarders) per trip; "
                  "it shows our cost even when other work makes wall times noisy.")
    RESULTS.mkdir(exist_ok=True)
    data = {"links": links, "chain_4hop_8k": chain, "discovery": discovery, "quick": args.quick,
            "baseline": args.baseline, "cpus": os.cpu_count(),
            "load_avg_1m": round(os.getloadavg()[0], 2), "measured_at": time.time()}
    name = "net_baseline.json" if args.baseline else "net.json"
    (RESULTS / name).write_text(json.dumps(data, indent=2) + "\n")


if __name__ == "__main__":
    main()
