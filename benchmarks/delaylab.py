"""The delay lab (``tests/net/delaylab.py``): configured against measured round trips, the router's cost per packet,
and TCP throughput under a rate limit.

    sudo python benchmarks/delaylab.py [--pings 100] [--quick]

Round trips: UDP pings of 64 B (``lab_probe.py``, one at a time, 10 ms apart) from one host to hosts at 0, 2, 10, 40,
80 and 160 ms, against two namespaces joined by a plain veth pair (no router: the floor). The router's counters over
the same pings: its busy time per packet (all of it outside ``epoll_wait``, including ``write(2)`` to the TUN, in which
the kernel delivers the packet to the receiving socket), of which in ``write(2)``, and how late it wrote a delayed
packet after its due time (p50 / p99 / max). Throughput: one TCP transfer over the veth pair, through the router
unlimited at 0 ms, and with the sender limited to 10 and 50 Mbit/s at 20 ms (queue 256 KiB).
Prints a table and writes benchmarks/results/delaylab.json. ``--quick``: 20 pings, smaller transfers.

``--fleet``: a Sangama fleet through the CLI (``qwen3_5_moe/tiny``: a bootstrap, stages 0:4 and 4:8 with ``--no-lanes
--threads 1``, a client), stage 4:8 at 2, 40 and 80 ms from the others (2 ms among them); for each distance the
greedy tokens of one 32-token ``generate`` and its decode time per token against the configured trip (client ->
stage 0 -> stage 1 -> client, one way each). Writes benchmarks/results/delaylab_fleet.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "net"))

from delaylab import PROBE_SCRIPT, DelayLab, delaylab_unavailable_reason  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "delaylab.json"
RTTS = (0, 2, 10, 40, 80, 160)


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


def _summary(rtts: list[float | None]) -> dict[str, float]:
    got = [x for x in rtts if x is not None]
    return {"min": min(got), "median": statistics.median(got), "p90": _pct(got, 0.9), "max": max(got),
            "lost": len(rtts) - len(got)}


def veth_baseline(pings: int, nbytes: int) -> dict[str, object]:
    """Two namespaces and a veth pair: the round trip and throughput with no router in the way."""
    tag = f"sg{os.getpid()}x{uuid.uuid4().hex[:3]}"
    names = [f"{tag}-va", f"{tag}-vb"]
    run = lambda *a: subprocess.run(a, check=True, capture_output=True, timeout=30)  # noqa: E731
    procs: list[subprocess.Popen] = []
    try:
        for n in names:
            run("ip", "netns", "add", n)
            run("ip", "-n", n, "link", "set", "lo", "up")
        run("ip", "-n", names[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", names[1])
        for i, n in enumerate(names):
            run("ip", "-n", n, "addr", "add", f"198.18.101.{i + 1}/24", "dev", "eth0")
            run("ip", "-n", n, "link", "set", "eth0", "up")

        def probe(ns: str, *args: str) -> subprocess.Popen:
            proc = subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, str(PROBE_SCRIPT), *args],
                                    stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            return proc

        for server in (probe(names[1], "udp-echo", "7"), probe(names[1], "tcp-sink", "9")):
            assert server.stdout is not None and server.stdout.readline().startswith('{"event": "ready"')
        out = probe(names[0], "udp-ping", "198.18.101.2", "7", str(pings), "10").communicate(timeout=120)[0]
        rtts = json.loads(out.strip().splitlines()[-1])["rtt_ms"]
        out = probe(names[0], "tcp-send", "198.18.101.2", "9", str(nbytes)).communicate(timeout=120)[0]
        return {"rtt_ms": _summary(rtts), "tcp": json.loads(out.strip().splitlines()[-1])}
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True, timeout=30)


def round_trips(pings: int) -> tuple[list[dict[str, object]], dict[str, object]]:
    hosts = {"src": "src", **{f"h{r}": f"h{r}" for r in RTTS}}
    rtt = {(a, b): 0.0 for a in hosts for b in hosts if a < b and a != "src" and b != "src"}
    rtt.update({("src", f"h{r}"): float(r) for r in RTTS})
    rows = []
    with DelayLab(hosts, rtt_ms=rtt) as lab:
        for r in RTTS:
            before = lab.stats()
            measured = _summary(lab.ping("src", f"h{r}", pings, 10.0))
            after = lab.stats()
            packets = after["packets"] - before["packets"]
            rows.append({"configured_ms": r, "measured_ms": measured,
                         "excess_median_ms": measured["median"] - r, "packets": packets})
        stats = lab.stats()
    return rows, stats


def routing_cost(n: int = 200_000) -> dict[str, float]:
    """The router's own Python work per packet, warm and in process: ``route`` (parse, look up, schedule) and the heap
    pop at delivery, without the system calls (two TUNs of its own, never up)."""
    import heapq

    from delay_router import Router

    router = Router({"tuns": [f"sgt{uuid.uuid4().hex[:6]}{i}" for i in range(2)],
                     "ips": ["198.18.100.1", "198.18.100.2"], "delay_us": [[0, 20000], [20000, 0]],
                     "rate_bps": [0, 0], "queue_bytes": [1 << 18] * 2})
    packet = bytes([0x45]) + bytes(15) + bytes([198, 18, 100, 2]) + bytes(1380)
    t0 = time.perf_counter_ns()
    for _ in range(n):
        router.route(0, packet, time.monotonic_ns())
    t1 = time.perf_counter_ns()
    while router.heap:
        heapq.heappop(router.heap)
    t2 = time.perf_counter_ns()
    for fd in (*router.fds, router.timer.fd):
        os.close(fd)
    return {"route_us": (t1 - t0) / n / 1000, "pop_us": (t2 - t1) / n / 1000}


def throughput(nbytes: int) -> list[dict[str, object]]:
    out = []
    for rate, rtt in ((0, 0), (10, 20), (50, 20)):
        size = nbytes if rate == 0 else int(rate * 1e6 / 8 * 2)  # about 2 s at the limit
        with DelayLab({"a": "x", "b": "x"}, rtt_ms={("x", "x"): rtt}, rate_mbit={"a": rate} if rate else None) as lab:
            got = lab.send("a", "b", size)
            stats = lab.stats()
        out.append({"rate_mbit": rate or None, "rtt_ms": rtt, "bytes": size, "measured_mbit_s": got["mbit_s"],
                    "router_busy_us_per_packet": stats["busy_us_per_packet"],
                    "dropped_queue": stats.get("dropped_queue", 0)})
    return out


class _Lines:
    """A process's stdout lines, read by a thread (``wait`` for one starting with a prefix)."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self._q: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc,), daemon=True).start()

    def _pump(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait(self, prefix: str, timeout: float) -> str:
        end = time.monotonic() + timeout
        while (line := self._q.get(timeout=max(0.01, end - time.monotonic()))) is not None:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"the process ended before a {prefix!r} line")


def fleet(tokens: int) -> int:
    cli = [sys.executable, "-c", "from sangama_p2p.cli.main import entry; entry()"]
    prompt = "5,17,300,42,7"
    tmp = Path(tempfile.mkdtemp(prefix="sangama-delaylab-"))
    tiny = tmp / "tiny"
    subprocess.run([*cli, "make-model", "--arch", "qwen3_5_moe", "--preset", "tiny", str(tiny)], check=True,
                   capture_output=True, timeout=300)
    local = subprocess.run([*cli, "generate", "--local", str(tiny), "--prompt-ids", prompt, "--max-new-tokens",
                            str(tokens), "--ignore-eos", "--json", "--threads", "1"], check=True, capture_output=True,
                           text=True, timeout=300)
    expected = json.loads(local.stdout.strip().splitlines()[-1])["tokens"]
    rows = []
    for far in (2, 40, 80):
        hosts = {"boot": "eu", "s0": "eu", "client": "eu", "s1": "us"}
        with DelayLab(hosts, rtt_ms={("eu", "eu"): 2, ("eu", "us"): far}) as lab:
            def start(host: str, *args: str) -> _Lines:
                return _Lines(lab.popen(host, *cli, *args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                        text=True))

            t0 = time.monotonic()
            boot_p = start("boot", "bootstrap", "--listen", "/ip4/0.0.0.0/tcp/4001", "--key", str(tmp / "b.key"))
            boot = ""
            while lab.ip["boot"] not in boot:
                boot = boot_p.wait("  --bootstrap ", 60).split()[1]
            stages = [start(h, "join", "--model", str(tiny), "--layers", layers, "--bootstrap", boot, "--listen",
                            "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp / f"{h}.key"), "--no-lanes", "--threads", "1")
                      for h, layers in (("s0", "0:4"), ("s1", "4:8"))]
            for stage in stages:
                stage.wait("ready ", 120)
            t_ready = time.monotonic() - t0
            t1 = time.monotonic()
            gen = lab.sh("client", *cli, "generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap",
                         boot, "--prompt-ids", prompt, "--max-new-tokens", str(tokens), "--ignore-eos", "--guesses",
                         "0", "--json", check=False)
            took = time.monotonic() - t1
            if gen.returncode != 0:
                print(gen.stderr[-3000:], file=sys.stderr)
                return 1
            result = json.loads(gen.stdout.strip().splitlines()[-1])
            trip = (lab.rtt_ms("client", "s0") + lab.rtt_ms("s0", "s1") + lab.rtt_ms("s1", "client")) / 2
        rows.append({"stage1_rtt_ms": far, "configured_trip_ms": trip, "start_to_ready_s": t_ready,
                     "generate_s": took, "decode_ms_per_token": result["decode_ms"] / max(1, result["steps"]),
                     "tokens_equal_local": result["tokens"] == expected})
    print(f"fleet across the delay lab: {tokens} greedy tokens, --guesses 0, load {os.getloadavg()[0]:.2f}")
    print("| stage 1 RTT ms | configured trip ms | decode ms/token | minus trip | generate s (process incl.) "
          "| start -> ready s | tokens = local |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['stage1_rtt_ms']} | {r['configured_trip_ms']:.0f} | {r['decode_ms_per_token']:.1f} | "
              f"{r['decode_ms_per_token'] - r['configured_trip_ms']:+.1f} | {r['generate_s']:.2f} | "
              f"{r['start_to_ready_s']:.1f} | {r['tokens_equal_local']} |")
    out = RESULTS.with_name("delaylab_fleet.json")
    out.write_text(json.dumps({"machine": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "tokens": tokens, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(r["tokens_equal_local"] for r in rows) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pings", type=int, default=100)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fleet", action="store_true", help="a Sangama fleet at 3 distances (module docstring)")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    reason = delaylab_unavailable_reason()
    if reason is not None:
        print(f"cannot run the delay lab: {reason}", file=sys.stderr)
        return 2
    if args.fleet:
        return fleet(args.tokens)
    pings = 20 if args.quick else args.pings
    nbytes = 20_000_000 if args.quick else 100_000_000
    load0 = os.getloadavg()[0]
    t0 = time.monotonic()
    base = veth_baseline(pings, nbytes)
    rows, stats = round_trips(pings)
    tput = throughput(nbytes)
    cost = routing_cost()
    load1 = os.getloadavg()[0]
    print(f"round trips: UDP 64 B, {pings} pings 10 ms apart; load {load0:.2f} -> {load1:.2f}")
    print("| path | configured ms | min | median | p90 | max | median - configured |")
    print("|---|---|---|---|---|---|---|")
    b = base["rtt_ms"]
    print(f"| veth pair (no router) | - | {b['min']:.3f} | {b['median']:.3f} | {b['p90']:.3f} | {b['max']:.3f} | - |")
    for row in rows:
        m = row["measured_ms"]
        print(f"| router | {row['configured_ms']} | {m['min']:.3f} | {m['median']:.3f} | {m['p90']:.3f} | "
              f"{m['max']:.3f} | {row['excess_median_ms']:+.3f} |")
    print(f"\nrouter over all {stats['packets']} ping packets: busy {stats['busy_us_per_packet']:.1f} µs per packet "
          f"(of which write(2) {stats['write_us_per_packet']:.1f}); written after due time p50 "
          f"{stats['late_us_p50']:.0f} µs, p99 {stats['late_us_p99']:.0f} µs, max {stats['late_us_max']:.0f} µs; "
          f"its own Python work per packet, warm: route {cost['route_us']:.2f} µs + heap pop {cost['pop_us']:.2f} µs")
    print("\n| TCP transfer | rate limit Mbit/s | RTT ms | MB | measured Mbit/s | router busy µs/packet "
          "| queue drops |")
    print("|---|---|---|---|---|---|---|")
    t = base["tcp"]
    print(f"| veth pair (no router) | - | - | {t['bytes'] / 1e6:.0f} | {t['mbit_s']:.0f} | - | - |")
    for row in tput:
        print(f"| router | {row['rate_mbit'] or '-'} | {row['rtt_ms']} | {row['bytes'] / 1e6:.1f} | "
              f"{row['measured_mbit_s']:.1f} | {row['router_busy_us_per_packet']:.1f} | {row['dropped_queue']} |")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({
        "machine": platform.node(), "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "load": [load0, load1], "seconds": time.monotonic() - t0, "pings": pings, "veth": base,
        "round_trips": rows, "router_stats": stats, "routing_cost": cost,
        "throughput": tput}, indent=2) + "\n")
    print(f"\nwrote {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
