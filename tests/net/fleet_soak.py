"""Churn a NATed home fleet with short-lived clients and count the dial attempts each stage makes, per minute.

The fleet is :mod:`.cli_fleet`'s: a bootstrap/relay on the public host, stages behind their own NATs, clients
(``generate`` and ``status`` in turn, a new one every ``every_s`` seconds) behind one more NAT. A dial attempt is a
TCP SYN the stage's host sends: every NAT box counts the SYNs arriving from its LAN (``iptables -t mangle``
PREROUTING, so SYNs to unroutable private addresses count too), split by destination - the relay, the clients' NAT
and LAN (what departed clients cost), the other stages, anything else. Used by ``benchmarks/dial_soak.py`` and by
``test_dial_soak.py``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .cli_fleet import PROMPT, Proc, bootstrap, cli, join
from .netns import LAN_IPS, NAT_WAN_IPS, RELAY_IP, NatLab

__all__ = ["CLASSES", "HEADER", "STAGE_SIDES", "Minute", "SoakResult", "SynCounter", "format_row", "run_soak"]

CHAIN = "SGSYN"
CLASSES = ("relay", "clients", "stages", "other")
CLIENT_SIDE = "d"
STAGE_SIDES = "abc"
CLIENT_LIFETIME_S = 90.0  # a client still running after this is killed (counted as failed)


def _subnet(ip: str) -> str:
    return ip.rsplit(".", 1)[0] + ".0/24"


class SynCounter:
    """SYN counters in one NAT box: :meth:`read` gives the totals by destination class since installation."""

    def __init__(self, lab: NatLab, side: str) -> None:
        self.lab = lab
        self.role = f"nat{side}"
        others = [s for s in STAGE_SIDES if s != side]
        self._rules = [
            ("relay", [RELAY_IP]),
            ("clients", [NAT_WAN_IPS[CLIENT_SIDE], _subnet(LAN_IPS[CLIENT_SIDE])]),
            ("stages", [ip for s in others for ip in (NAT_WAN_IPS[s], _subnet(LAN_IPS[s]))]),
        ]
        sh = lab.sh
        sh(self.role, "iptables", "-t", "mangle", "-N", CHAIN)
        sh(self.role, "iptables", "-t", "mangle", "-A", "PREROUTING", "-i", "lan0", "-p", "tcp", "--syn", "-j", CHAIN)
        for _, dests in self._rules:
            for dest in dests:
                sh(self.role, "iptables", "-t", "mangle", "-A", CHAIN, "-d", dest, "-j", "RETURN")
        sh(self.role, "iptables", "-t", "mangle", "-A", CHAIN, "-j", "RETURN")  # other

    def read(self) -> dict[str, int]:
        out = self.lab.sh(self.role, "iptables", "-t", "mangle", "-L", CHAIN, "-v", "-x", "-n").stdout
        counts = [int(line.split()[0]) for line in out.splitlines()[2:] if line.strip()]
        totals = dict.fromkeys(CLASSES, 0)
        i = 0
        for name, dests in self._rules:
            totals[name] = sum(counts[i:i + len(dests)])
            i += len(dests)
        totals["other"] = counts[i] if i < len(counts) else 0
        return totals


@dataclass
class Minute:
    """One minute of the soak: SYNs per stage (by class), and the clients started and finished in it."""

    minute: int
    syns: dict[str, dict[str, int]]  # stage side -> class -> SYNs in this minute
    clients_started: int
    clients_ok: int
    clients_failed: int

    def total(self, side: str) -> int:
        return sum(self.syns[side].values())


@dataclass
class SoakResult:
    minutes: list[Minute] = field(default_factory=list)

    def totals(self, side: str) -> list[int]:
        return [m.total(side) for m in self.minutes]

    def worst_ratio(self) -> float:
        """The largest (minute's SYNs / first minute's SYNs) over stages and later minutes (first minute >= 1)."""
        worst = 0.0
        for side in STAGE_SIDES:
            t = self.totals(side)
            if t:
                worst = max(worst, max(x / max(t[0], 1) for x in t))
        return worst


def _client(tiny: Path, boot: str, ns: str, k: int) -> Proc:
    if k % 2 == 0:
        args = ["generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot, "--prompt-ids",
                PROMPT, "--max-new-tokens", "8", "--ignore-eos", "--json"]
    else:
        args = ["status", "--bootstrap", boot, "--model", "tiny", "--json", "--timeout", "10"]
    return Proc(cli(*args, ns=ns))


def run_soak(lab: NatLab, tiny: Path, tmp: Path, *, minutes: int, every_s: float = 20.0,
             on_minute: Callable[[Minute], None] = lambda m: None) -> SoakResult:
    """Start the fleet in ``lab`` (sides a-d), churn clients for ``minutes`` and return the per-minute counts."""
    procs: list[Proc] = []
    result = SoakResult()
    try:
        boot_p, boot = bootstrap(lab, tmp)
        procs.append(boot_p)
        stages = [join(tiny, boot, layers, tmp / f"{side}.key", lab.ns[f"priv{side}"])
                  for side, layers in zip(STAGE_SIDES, ("0:3", "3:6", "6:8"))]
        procs.extend(stages)
        for s in stages:
            s.wait_for("ready ", 120)
        counters = {side: SynCounter(lab, side) for side in STAGE_SIDES}
        last = {side: c.read() for side, c in counters.items()}
        running: list[tuple[Proc, float]] = []
        started = ok = failed = 0
        k = 0
        t0 = time.monotonic()
        next_client = t0
        for minute in range(1, minutes + 1):
            end = t0 + 60.0 * minute
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= next_client:
                    running.append((_client(tiny, boot, lab.ns[f"priv{CLIENT_SIDE}"], k), now))
                    k += 1
                    started += 1
                    next_client += every_s
                still = []
                for proc, born in running:
                    code = proc.proc.poll()
                    if code is None and now - born > CLIENT_LIFETIME_S:
                        proc.stop()
                        code = -1
                    if code is None:
                        still.append((proc, born))
                    elif code == 0:
                        ok += 1
                    else:
                        failed += 1
                running = still
                time.sleep(0.2)
            now_counts = {side: c.read() for side, c in counters.items()}
            syns = {side: {cls: now_counts[side][cls] - last[side][cls] for cls in CLASSES} for side in STAGE_SIDES}
            last = now_counts
            row = Minute(minute, syns, started, ok, failed)
            started = ok = failed = 0
            result.minutes.append(row)
            on_minute(row)
        for proc, _ in running:
            proc.stop()
        for s in stages:
            if s.proc.poll() is not None:
                raise RuntimeError(f"a stage exited during the soak: {s.err[-20:]}")
        return result
    finally:
        for p in procs:
            p.stop()


def format_row(m: Minute) -> str:
    cells = "  ".join(f"{side}:{m.total(side):5d} ({m.syns[side]['clients']:4d})" for side in STAGE_SIDES)
    return (f"{m.minute:4d}  {cells}  clients +{m.clients_started} ok {m.clients_ok} failed {m.clients_failed}")


HEADER = "min   SYNs per stage (of them to departed/current clients' NAT and LAN)                 clients"

