"""The delay lab's router: one process, one TUN device per lab namespace, each IPv4 packet written to its destination's
TUN after the pair's one-way delay (this kernel has no netem). Started by ``delaylab.py``; not a public tool.

Run as ``python delay_router.py CONFIG_JSON`` with ``{"tuns": [name, ...], "ips": [ip, ...], "delay_us": [[...]],
"rate_bps": [...], "queue_bytes": [...]}`` (index i is namespace i; ``delay_us[i][j]`` is the one-way delay of a
packet from i to j; ``rate_bps[i]`` is i's sending rate, 0 for unlimited, with a drop-tail queue of ``queue_bytes[i]``).

It opens the TUNs (``IFF_TUN | IFF_NO_PI``: bare IP packets) in the namespace it runs in and prints one
``{"event": "ready"}`` line; the lab then moves each device into its namespace (the fd keeps working there) and gives it
an address. Each line ``stats`` on stdin is answered with one JSON line of counters; end of stdin ends the router, and
closing the fds destroys the devices. Timing: an epoll loop over the TUN fds, stdin and a ``timerfd`` armed (absolute,
``CLOCK_MONOTONIC``, through ctypes: Python 3.11 has no ``os.timerfd_*``) at the earliest due packet, so a delivery
is not rounded up to epoll's millisecond timeout. A packet's due time is counted from when the router read it.

Rate model: a namespace's packets leave one after another at its rate (FIFO serialisation: a packet departs when the
one before it has, plus ``8 * len / rate``), then travel the pair's delay. A packet that would find more than
``queue_bytes`` queued ahead of it is dropped (drop-tail).
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import heapq
import json
import os
import select
import struct
import sys
import time

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
CLOCK_MONOTONIC = 1
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1
BURST = 64  # packets read from one fd before the others get a turn
LATE_KEPT = 20000  # lateness samples kept for the percentiles


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class Timer:
    """A ``timerfd`` on ``CLOCK_MONOTONIC`` (the clock of ``time.monotonic_ns``), armed at absolute times."""

    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self._libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create")
        self._spec = _Itimerspec()
        self.armed = 0  # the absolute time it is armed at, 0 when disarmed

    def arm(self, at_ns: int) -> None:
        """Fire at ``at_ns`` (0 disarms)."""
        self._spec.it_value.tv_sec, self._spec.it_value.tv_nsec = divmod(at_ns, 1_000_000_000)
        if self._libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(self._spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime")
        self.armed = at_ns

    def clear(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass


def open_tun(name: str) -> int:
    """A new (non-persistent) TUN device ``name``: destroyed when its fd closes, in whatever namespace it is."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    except OSError:
        os.close(fd)
        raise
    return fd


class Router:
    """The packet loop; ``stats()`` is what a ``stats`` line answers."""

    def __init__(self, config: dict) -> None:
        self.fds = [open_tun(name) for name in config["tuns"]]
        self.index = {fd: i for i, fd in enumerate(self.fds)}
        self.by_ip = {bytes(int(x) for x in ip.split(".")): fd for ip, fd in zip(config["ips"], self.fds)}
        self.delay_ns = [[int(us * 1000) for us in row] for row in config["delay_us"]]
        self.rate_bps = [float(x) for x in config["rate_bps"]]
        self.queue_bytes = [int(x) for x in config["queue_bytes"]]
        self.free_at = [0] * len(self.fds)  # when each sender's link has sent what is queued on it
        self.heap: list[tuple[int, int, int, bytes]] = []  # (due ns, sequence, destination fd, packet)
        self.seq = 0
        self.timer = Timer()
        self.counts = collections.Counter()
        self.late_ns: collections.deque[int] = collections.deque(maxlen=LATE_KEPT)
        self.busy_ns = 0  # time spent outside epoll_wait, handling packets
        self.write_ns = 0  # of which in write(2) to a TUN: the kernel delivering the packet in the namespace
        self.started = time.monotonic_ns()

    def route(self, src: int, packet: bytes, now: int) -> None:
        """Schedule (or drop) one packet read from namespace ``src``."""
        if len(packet) < 20 or packet[0] >> 4 != 4:
            self.counts["dropped_not_ipv4"] += 1  # IPv6 router solicitations and the like
            return
        dst_fd = self.by_ip.get(packet[16:20])
        if dst_fd is None:
            self.counts["dropped_unroutable"] += 1
            return
        due = now
        rate = self.rate_bps[src]
        if rate:
            start = max(now, self.free_at[src])
            if (start - now) * rate / 8e9 > self.queue_bytes[src]:
                self.counts["dropped_queue"] += 1
                return
            self.free_at[src] = due = start + int(len(packet) * 8e9 / rate)
        due += self.delay_ns[src][self.index[dst_fd]]
        self.counts["packets"] += 1
        self.counts["bytes"] += len(packet)
        if due <= now:
            self.write(dst_fd, packet, now, due)
        else:
            self.seq += 1
            heapq.heappush(self.heap, (due, self.seq, dst_fd, packet))

    def write(self, fd: int, packet: bytes, now: int, due: int) -> None:
        self.late_ns.append(max(0, now - due))
        try:
            os.write(fd, packet)
        except OSError:  # the device is going away (teardown) or its queue is full
            self.counts["dropped_write"] += 1
        self.write_ns += time.monotonic_ns() - now

    def deliver_due(self) -> None:
        heap = self.heap
        now = time.monotonic_ns()
        while heap and heap[0][0] <= now:
            due, _, fd, packet = heapq.heappop(heap)
            self.write(fd, packet, now, due)
            now = time.monotonic_ns()
        head = heap[0][0] if heap else 0
        if head != self.timer.armed:
            self.timer.arm(head)

    def stats(self) -> dict:
        late = sorted(self.late_ns)

        def pct(p: float) -> float:
            return late[min(len(late) - 1, int(p * len(late)))] / 1000 if late else 0.0

        packets = self.counts["packets"]
        return {
            **self.counts,
            "packets": packets,
            "queued": len(self.heap),
            "busy_us_per_packet": self.busy_ns / 1000 / packets if packets else 0.0,
            "busy_us_per_wake": self.busy_ns / 1000 / self.counts["wakes"] if self.counts["wakes"] else 0.0,
            "write_us_per_packet": self.write_ns / 1000 / packets if packets else 0.0,
            "late_us_mean": sum(late) / len(late) / 1000 if late else 0.0,
            "late_us_p50": pct(0.5),
            "late_us_p99": pct(0.99),
            "late_us_max": late[-1] / 1000 if late else 0.0,
            "uptime_s": (time.monotonic_ns() - self.started) / 1e9,
        }

    def run(self) -> None:
        ep = select.epoll()
        for fd in self.fds:
            ep.register(fd, select.EPOLLIN)
        ep.register(self.timer.fd, select.EPOLLIN)
        stdin = sys.stdin.fileno()
        ep.register(stdin, select.EPOLLIN)
        control = b""
        print(json.dumps({"event": "ready"}), flush=True)
        while True:
            events = ep.poll()
            t0 = time.monotonic_ns()
            self.counts["wakes"] += 1
            for fd, _ in events:
                if fd == self.timer.fd:
                    self.timer.clear()
                elif fd == stdin:
                    data = os.read(stdin, 4096)
                    if not data:
                        return
                    control += data
                    while b"\n" in control:
                        line, control = control.split(b"\n", 1)
                        if line.strip() == b"stats":
                            print(json.dumps(self.stats()), flush=True)
                else:
                    src = self.index[fd]
                    for _ in range(BURST):
                        try:
                            packet = os.read(fd, 65536)
                        except BlockingIOError:
                            break
                        except OSError:  # the device was destroyed with its namespace
                            ep.unregister(fd)
                            break
                        self.route(src, packet, time.monotonic_ns())
                self.deliver_due()
            self.busy_ns += time.monotonic_ns() - t0


def main() -> int:
    config = json.loads(sys.argv[1])
    try:  # the lab's clock: ahead of the peers it carries packets for
        if config.get("realtime"):
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
        else:
            os.setpriority(os.PRIO_PROCESS, 0, -10)
    except OSError:
        pass
    Router(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
