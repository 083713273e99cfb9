"""Measuring tools for the delay lab, run inside its namespaces (``DelayLab.probe(host, ...)``, ``ip netns exec``).

    lab_probe.py udp-echo PORT                        echo every datagram back; prints {"event": "ready"} when bound
    lab_probe.py udp-ping IP PORT COUNT [GAP_MS]      COUNT pings of 64 B, one at a time; prints {"rtt_ms": [...]}
    lab_probe.py udp-burst IP PORT COUNT SIZE         COUNT datagrams at once; prints {"sent": n}
    lab_probe.py udp-count PORT WAIT_S                counts datagrams until WAIT_S pass without one; prints {"got": n}
    lab_probe.py tcp-sink PORT                        reads connections to EOF, answers each with one byte
    lab_probe.py tcp-send IP PORT BYTES               sends BYTES, waits for the sink's byte; prints {"mbit_s", ...}

A lost ping (no answer in 1 s) is reported as null. Every line on stdout is one JSON object.
"""

from __future__ import annotations

import json
import socket
import sys
import time


def _say(obj: dict) -> None:
    print(json.dumps(obj), flush=True)


def udp_echo(port: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    _say({"event": "ready"})
    while True:
        data, peer = sock.recvfrom(65536)
        sock.sendto(data, peer)


def udp_ping(ip: str, port: int, count: int, gap_ms: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((ip, port))
    sock.settimeout(1.0)
    rtts: list[float | None] = []
    for seq in range(count):
        payload = seq.to_bytes(8, "big") + bytes(56)
        t0 = time.perf_counter()
        sock.send(payload)
        try:
            while sock.recv(65536)[:8] != payload[:8]:  # a late answer to a lost ping: not this one
                pass
            rtts.append((time.perf_counter() - t0) * 1000)
        except socket.timeout:
            rtts.append(None)
        time.sleep(gap_ms / 1000)
    _say({"rtt_ms": rtts})


def udp_burst(ip: str, port: int, count: int, size: int) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.connect((ip, port))
    for seq in range(count):
        sock.send(seq.to_bytes(8, "big") + bytes(size - 8))
    _say({"sent": count})


def udp_count(port: int, wait_s: float) -> None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", port))
    _say({"event": "ready"})
    sock.settimeout(30.0)  # the first datagram
    got = 0
    try:
        while True:
            sock.recv(65536)
            got += 1
            sock.settimeout(wait_s)
    except socket.timeout:
        pass
    _say({"got": got})


def tcp_sink(port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("0.0.0.0", port))
    srv.listen()
    _say({"event": "ready"})
    while True:
        conn, _ = srv.accept()
        with conn:
            while conn.recv(1 << 20):
                pass
            conn.sendall(b"k")


def tcp_send(ip: str, port: int, nbytes: int) -> None:
    t0 = time.perf_counter()
    with socket.create_connection((ip, port), timeout=60) as sock:
        t_conn = time.perf_counter()
        chunk = bytes(1 << 16)
        left = nbytes
        while left > 0:
            left -= sock.send(chunk[: min(left, len(chunk))])
        sock.shutdown(socket.SHUT_WR)
        sock.recv(1)
        took = time.perf_counter() - t_conn
    _say({"bytes": nbytes, "seconds": took, "connect_ms": (t_conn - t0) * 1000, "mbit_s": nbytes * 8 / took / 1e6})


def main(argv: list[str]) -> int:
    cmd, args = argv[0], argv[1:]
    if cmd == "udp-echo":
        udp_echo(int(args[0]))
    elif cmd == "udp-ping":
        udp_ping(args[0], int(args[1]), int(args[2]), float(args[3]) if len(args) > 3 else 10.0)
    elif cmd == "udp-burst":
        udp_burst(args[0], int(args[1]), int(args[2]), int(args[3]))
    elif cmd == "udp-count":
        udp_count(int(args[0]), float(args[1]))
    elif cmd == "tcp-sink":
        tcp_sink(int(args[0]))
    elif cmd == "tcp-send":
        tcp_send(args[0], int(args[1]), int(args[2]))
    else:
        print(__doc__, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
