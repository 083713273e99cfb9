"""Hosts at real distance: N network namespaces joined by a userspace router that delays each packet by its pair's
one-way latency (``delay_router.py``; this kernel has no netem), with an optional sending rate per host.

Layout: host i is namespace ``<tag>-<host>`` with one device, ``tun0``, address ``198.18.100.(i+1)/24`` (the
benchmarking range: Sangama counts it as public, so the hosts dial each other as Internet peers; the namespaces have
no link to the host's network, so nothing leaves the machine). Every packet between two hosts goes through the router
process, which runs in the test's own namespace and holds every TUN fd::

    with DelayLab({"a": "eu", "b": "eu", "c": "us"}, rtt_ms={("eu", "eu"): 2, ("eu", "us"): 80}) as lab:
        lab.popen("c", "python", "server.py")          # runs in c's namespace (ip netns exec)
        lab.ip["c"], lab.ns["c"], lab.rtt_ms("a", "c")   # '198.18.100.3', 'sg123x4f2-c', 80.0

``rtt_ms`` keys are unordered pairs of hosts or regions (a host pair wins over its regions' pair); every pair of
distinct hosts must have one, so a forgotten pair is an error rather than 0 ms. ``rate_mbit`` caps what a host sends
(a drop-tail queue of ``queue_kb`` in front of it). The router, the processes started with ``popen`` and the
namespaces are removed on exit, even when setup fails half-way; a lab whose test died is swept by the next one.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

try:
    from .netns import delete_namespaces, remove_stale_labs
except ImportError:  # imported as a top-level module (benchmarks put tests/net on sys.path)
    from netns import delete_namespaces, remove_stale_labs  # type: ignore[no-redef]

__all__ = ["DelayLab", "delaylab_unavailable_reason"]

ROUTER_SCRIPT = Path(__file__).with_name("delay_router.py")
PROBE_SCRIPT = Path(__file__).with_name("lab_probe.py")
ECHO_PORT, SINK_PORT = 7, 9
SUBNET = "198.18.100"  # host i: SUBNET.(i+1)/24
MAX_HOSTS = 250


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def delaylab_unavailable_reason() -> str | None:
    """Why the delay lab cannot run here, or ``None`` when it can (Linux, root, ``ip``, netns, ``/dev/net/tun``)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and TUN devices need root"
    if shutil.which("ip") is None:
        return "`ip` is not installed (Debian: apt-get install iproute2)"
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
    except OSError as exc:
        return f"cannot open /dev/net/tun: {exc}"
    try:
        fcntl.ioctl(fd, 0x400454CA, struct.pack("16sH", f"sgp{os.getpid() % 10**6}".encode(), 0x1001))  # TUNSETIFF
    except OSError as exc:
        return f"cannot create a TUN device: {exc}"
    finally:
        os.close(fd)
    probe = f"sgprobe{os.getpid()}{uuid.uuid4().hex[:4]}"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _pair_rtt(hosts: Mapping[str, str], rtt_ms: Mapping[tuple[str, str], float], a: str, b: str) -> float:
    for x, y in ((a, b), (hosts[a], hosts[b])):
        for key in ((x, y), (y, x)):
            if key in rtt_ms:
                return float(rtt_ms[key])
    raise ValueError(f"no round trip for {a} ({hosts[a]}) - {b} ({hosts[b]}): add ({hosts[a]!r}, {hosts[b]!r}) "
                     f"or ({a!r}, {b!r}) to rtt_ms")


class DelayLab:
    """The namespaces and the router, made on ``__enter__`` and always removed on ``__exit__``."""

    def __init__(self, hosts: Mapping[str, str], rtt_ms: Mapping[tuple[str, str], float],
                 rate_mbit: Mapping[str, float] | None = None, queue_kb: float = 256.0, tag: str | None = None,
                 realtime: bool = True) -> None:
        """``hosts``: host name -> region; ``rtt_ms``: round trip per host or region pair (see the module docstring);
        ``rate_mbit``: host -> its sending rate in Mbit/s (absent: unlimited); ``queue_kb``: the queue before a rate;
        ``realtime``: the router runs ``SCHED_FIFO`` (priority 1), else at nice -10: on 2 busy cores this cut its p99
        delivery lateness from 0.6-3.3 ms to 0.25-0.37 ms (benchmarks/delaylab.py)."""
        if not hosts or len(hosts) > MAX_HOSTS:
            raise ValueError(f"a lab has 1 to {MAX_HOSTS} hosts, got {len(hosts)}")
        bad = [h for h in hosts if not re.fullmatch(r"[a-z0-9_]{1,20}", h)]
        if bad:
            raise ValueError(f"host names are 1-20 of [a-z0-9_] (namespace names): {bad}")
        unknown = set(rate_mbit or ()) - set(hosts)
        if unknown:
            raise ValueError(f"rate_mbit names hosts the lab does not have: {sorted(unknown)}")
        clash = sorted({tuple(sorted(k)) for k, v in rtt_ms.items() if rtt_ms.get((k[1], k[0]), v) != v})
        if clash:
            raise ValueError(f"rtt_ms gives these pairs two different round trips (one per order): {clash}")
        self.hosts = dict(hosts)
        names = list(hosts)
        self._rtt = {(a, b): _pair_rtt(hosts, rtt_ms, a, b) for a in names for b in names if a != b}
        if any(v < 0 for v in self._rtt.values()):
            raise ValueError("round trips must be >= 0 ms")
        self.rate_mbit = {h: float((rate_mbit or {}).get(h, 0.0)) for h in names}
        self.queue_kb = queue_kb
        self.realtime = realtime
        self.tag = tag or f"sg{os.getpid()}x{uuid.uuid4().hex[:3]}"  # netns.remove_stale_labs sweeps this pattern
        self.ns = {h: f"{self.tag}-{h}" for h in names}
        self.ip = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(names)}
        self._tuns = [f"sgt{uuid.uuid4().hex[:6]}{i}" for i in range(len(names))]  # <= 15 characters
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._router: subprocess.Popen | None = None
        self._servers: set[tuple[str, tuple[str, ...]]] = set()

    def rtt_ms(self, a: str, b: str) -> float:
        """The configured round trip between hosts ``a`` and ``b`` (0 for a host with itself: loopback)."""
        return 0.0 if a == b else self._rtt[(a, b)]

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> DelayLab:
        remove_stale_labs()
        try:
            self._build()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def teardown(self) -> None:
        """Stop the processes started here and the router (its TUNs go with it), then delete the namespaces."""
        for proc in self._procs:
            _stop(proc)
        self._procs.clear()
        self._servers.clear()
        if self._router is not None:
            for pipe in (self._router.stdin,):
                try:
                    pipe.close()  # end of stdin: the router returns and its fds (the TUNs) close
                except OSError:
                    pass
            _stop(self._router, grace=2)
            self._router = None
        delete_namespaces(self._made)

    def _build(self) -> None:
        names = list(self.hosts)
        for host in names:
            _run(["ip", "netns", "add", self.ns[host]])
            self._made.append(self.ns[host])
            self.sh(host, "ip", "link", "set", "lo", "up")
            self.sh(host, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1")  # no IPv6 chatter through the router
        config = {
            "tuns": self._tuns,
            "ips": [self.ip[h] for h in names],
            "delay_us": [[self.rtt_ms(a, b) * 500 for b in names] for a in names],  # one way: half the round trip
            "rate_bps": [self.rate_mbit[h] * 1e6 for h in names],
            "queue_bytes": [int(self.queue_kb * 1024)] * len(names),
            "realtime": self.realtime,
        }
        self._router = subprocess.Popen([sys.executable, str(ROUTER_SCRIPT), json.dumps(config)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready = self._router.stdout.readline()  # type: ignore[union-attr]
        if not ready.startswith('{"event": "ready"'):
            err = self._router.stderr.read()[-2000:]  # type: ignore[union-attr]
            raise RuntimeError(f"the delay router did not start: {ready!r} {err}")
        for host, tun in zip(names, self._tuns):
            _run(["ip", "link", "set", tun, "netns", self.ns[host]])
            self.sh(host, "ip", "link", "set", tun, "name", "tun0")
            self.sh(host, "ip", "addr", "add", f"{self.ip[host]}/24", "dev", "tun0")
            self.sh(host, "ip", "link", "set", "tun0", "up")

    # -- using it ------------------------------------------------------------------------------------------------
    def sh(self, host: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``host``'s namespace and wait for it."""
        return _run(["ip", "netns", "exec", self.ns[host], *args], check=check)

    def popen(self, host: str, *args: str, **kwargs: Any) -> subprocess.Popen:
        """Start a command inside ``host``'s namespace (``subprocess.Popen`` keywords pass through); stopped on exit."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *args], **kwargs)
        self._procs.append(proc)
        return proc

    def probe(self, host: str, *args: str) -> subprocess.Popen:
        """Start ``lab_probe.py`` in ``host`` (stdout a pipe of JSON lines); stopped on exit."""
        return self.popen(host, sys.executable, str(PROBE_SCRIPT), *args, stdout=subprocess.PIPE, text=True)

    def _server(self, host: str, *args: str) -> None:
        if (host, args) not in self._servers:
            proc = self.probe(host, *args)
            line = proc.stdout.readline()  # type: ignore[union-attr]
            if not line.startswith('{"event": "ready"'):
                raise RuntimeError(f"{args[0]} in {host} did not start: {line!r}")
            self._servers.add((host, args))

    def ping(self, src: str, dst: str, count: int = 20, gap_ms: float = 10.0) -> list[float | None]:
        """``count`` UDP round trips (64 B) from ``src`` to an echo server in ``dst``, in ms (None: lost, 1 s)."""
        self._server(dst, "udp-echo", str(ECHO_PORT))
        out = self.probe(src, "udp-ping", self.ip[dst], str(ECHO_PORT), str(count), str(gap_ms)).communicate(
            timeout=30 + count * (1 + gap_ms / 1000))[0]
        return json.loads(out.strip().splitlines()[-1])["rtt_ms"]

    def send(self, src: str, dst: str, nbytes: int) -> dict[str, float]:
        """One TCP transfer of ``nbytes`` from ``src`` to a sink in ``dst``, timed from connected to the sink's
        answer after EOF: ``{"mbit_s", "seconds", "connect_ms", "bytes"}``."""
        self._server(dst, "tcp-sink", str(SINK_PORT))
        out = self.probe(src, "tcp-send", self.ip[dst], str(SINK_PORT), str(nbytes)).communicate(timeout=120)[0]
        return json.loads(out.strip().splitlines()[-1])

    def stats(self) -> dict[str, Any]:
        """The router's counters: packets, bytes, drops by cause, busy time per packet, delivery lateness (µs)."""
        if self._router is None or self._router.poll() is not None:
            raise RuntimeError("the delay router is not running")
        assert self._router.stdin is not None and self._router.stdout is not None
        self._router.stdin.write("stats\n")
        self._router.stdin.flush()
        return json.loads(self._router.stdout.readline())


def _stop(proc: subprocess.Popen, grace: float = 5) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
