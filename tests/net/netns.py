"""A small Internet in Linux network namespaces: one public segment, two home networks behind their own NATs.

Why namespaces: NAT traversal can only be tested against a real NAT. Loopback has none, and a fake one would test our
assumptions instead of Linux conntrack. Layout (benchmarking range 198.18.0.0/15 only, which belongs to no one; the
namespaces have no link to the host's own network, so nothing leaves the machine)::

                        <tag>-wan: bridge br0, 198.18.0.0/24 ("the Internet")
          +---------------+---------------+------------------+------------------+
     <tag>-relay      <tag>-pub       <tag>-nata           <tag>-natb
     198.18.0.1       198.18.0.2      wan0 198.18.0.11     wan0 198.18.0.12
     bootstrap/relay  public peer     lan0 198.19.1.1      lan0 198.19.2.1
                                          |                     |
                                      <tag>-priva           <tag>-privb
                                      198.19.1.2            198.19.2.2

Each NAT box masquerades its LAN onto the WAN, forwards only ESTABLISHED,RELATED traffic back in, and DROPs any
unsolicited packet on its WAN side, as home routers do (a bare Linux NAT answers an early SYN with RST, which kills a
TCP hole punch). Peers run as Python subprocesses inside their namespace (``ip netns exec``) and talk to the test in
JSON lines (see ``nat_agent.py``). Every namespace and process is removed on exit, even when setup fails half-way.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "AGENT_SCRIPT",
    "Agent",
    "AgentError",
    "NatLab",
    "netns_unavailable_reason",
]

AGENT_SCRIPT = Path(__file__).with_name("nat_agent.py")

RELAY_IP = "198.18.0.1"
PUBLIC_IP = "198.18.0.2"
SIDES = "abcdefgh"  # home networks a lab can have: side i is NAT 198.18.0.(11+i), LAN 198.19.(i+1).0/24
NAT_WAN_IPS = {s: f"198.18.0.{11 + i}" for i, s in enumerate(SIDES)}
LAN_GATEWAYS = {s: f"198.19.{i + 1}.1" for i, s in enumerate(SIDES)}
LAN_IPS = {s: f"198.19.{i + 1}.2" for i, s in enumerate(SIDES)}


class AgentError(RuntimeError):
    """An agent answered a command with an error, died, or did not answer in time."""


def _run(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, check=check, capture_output=True, text=True, timeout=30)


def netns_unavailable_reason() -> str | None:
    """Why the namespace tests cannot run here, or ``None`` when they can (root, ``ip``, ``iptables``, netns)."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: apt-get install iproute2 iptables)"
    probe = f"sgprobe{os.getpid()}{uuid.uuid4().hex[:4]}"
    try:
        made = _run(["ip", "netns", "add", probe], check=False)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        nat = _run(["ip", "netns", "exec", probe, "iptables", "-t", "nat", "-L", "-n"], check=False)
        if nat.returncode != 0:
            return f"iptables NAT table unusable inside a namespace: {nat.stderr.strip()}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def remove_stale_labs() -> None:
    """Delete namespaces of labs whose test process died without tearing down (e.g. killed by SIGKILL)."""
    listing = _run(["ip", "netns", "list"], check=False).stdout
    for name in {line.split()[0] for line in listing.splitlines() if line.strip()}:
        match = re.fullmatch(r"sg(\d+)x[0-9a-f]{3}-\w+", name)
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            _run(["ip", "netns", "del", name], check=False)
        except PermissionError:  # alive, owned by someone else
            pass


def delete_namespaces(made: list[str]) -> None:
    """Kill what still runs in each namespace of ``made`` (newest first), delete it, and empty the list."""
    for name in reversed(made):
        for pid in _run(["ip", "netns", "pids", name], check=False).stdout.split():
            try:
                os.kill(int(pid), 9)
            except (OSError, ValueError):
                pass
        _run(["ip", "netns", "del", name], check=False)
    made.clear()


@dataclass(frozen=True)
class Endpoint:
    """A started agent's identity as the other agents need it."""

    peer_id: str
    addrs: tuple[str, ...]


class Agent:
    """One peer process in a namespace, driven by JSON-line commands on stdin, answering on stdout."""

    def __init__(self, name: str, ns: str, args: list[str]) -> None:
        self.name = name
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        cmd = ["ip", "netns", "exec", ns, sys.executable, str(AGENT_SCRIPT), *args]
        self._proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._stderr: list[str] = []
        self._next_id = 0
        threading.Thread(target=self._pump_stdout, daemon=True).start()
        threading.Thread(target=self._pump_stderr, daemon=True).start()
        self._endpoint: Endpoint | None = None

    @property
    def endpoint(self) -> Endpoint:
        """Its peer id and addresses, waiting for the ready line on first use."""
        if self._endpoint is None:
            ready = self._read(timeout=40.0)
            if ready.get("event") != "ready":
                raise AgentError(f"{self.name}: expected a ready line, got {ready}")
            self._endpoint = Endpoint(ready["peer_id"], tuple(ready["addrs"]))
        return self._endpoint

    def _pump_stdout(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._lines.put(line)
        self._lines.put(None)  # end of stream: readers stop waiting

    def _pump_stderr(self) -> None:
        assert self._proc.stderr is not None
        for line in self._proc.stderr:
            self._stderr.append(line)

    def _read(self, timeout: float) -> dict[str, Any]:
        while True:
            try:
                line = self._lines.get(timeout=timeout)
            except queue.Empty:
                raise AgentError(f"{self.name}: no answer within {timeout} s; stderr:\n{self.stderr_tail()}") from None
            if line is None:
                raise AgentError(f"{self.name}: process exited; stderr tail:\n{self.stderr_tail()}")
            try:
                return json.loads(line)
            except json.JSONDecodeError:  # a library printed to stdout: keep it for the error report, read on
                self._stderr.append(f"[stdout] {line}")

    def stderr_tail(self, lines: int = 30) -> str:
        return "".join(self._stderr[-lines:])

    def call(self, cmd: str, timeout: float = 30.0, **params: Any) -> dict[str, Any]:
        """Send one command and return its result; an error answer raises :class:`AgentError`."""
        _ = self.endpoint  # the ready line comes first
        self._next_id += 1
        ident = self._next_id
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps({"id": ident, "cmd": cmd, **params}) + "\n")
        self._proc.stdin.flush()
        while True:
            reply = self._read(timeout)
            if reply.get("id") == ident:
                break
        if not reply.get("ok"):
            raise AgentError(f"{self.name}.{cmd}: {reply.get('error')}")
        return reply

    def close(self) -> None:
        """Stop the agent (SIGTERM, then SIGKILL): its state dies with the lab, so no graceful shutdown is needed."""
        if self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        for pipe in (self._proc.stdin, self._proc.stdout, self._proc.stderr):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


class NatLab:
    """Creates the namespaces on ``__enter__`` and always removes them (and its agents) on ``__exit__``."""

    def __init__(self, tag: str | None = None, sides: str = "ab") -> None:
        """``sides``: the home networks, each a NAT box ``nat<s>`` and a host ``priv<s>`` behind it (see SIDES)."""
        if not sides or any(s not in SIDES for s in sides) or len(set(sides)) != len(sides):
            raise ValueError(f"sides must be distinct letters of {SIDES!r}, got {sides!r}")
        self.sides = sides
        self.tag = tag or f"sg{os.getpid()}x{uuid.uuid4().hex[:3]}"
        roles = ("wan", "relay", "pub", *(f"nat{s}" for s in sides), *(f"priv{s}" for s in sides))
        self.ns = {role: f"{self.tag}-{role}" for role in roles}
        self._made: list[str] = []
        self._agents: list[Agent] = []

    # -- lifecycle -----------------------------------------------------------------------------------------------
    def __enter__(self) -> NatLab:
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
        """Stop every agent, then delete every namespace this lab made (veths and rules go with them)."""
        for agent in self._agents:
            try:
                agent.close()
            except Exception:  # keep tearing down: a stuck agent must not leave namespaces behind
                pass
        self._agents.clear()
        delete_namespaces(self._made)

    # -- building ------------------------------------------------------------------------------------------------
    def sh(self, role: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside one namespace."""
        return _run(["ip", "netns", "exec", self.ns[role], *args], check=check)

    def _build(self) -> None:
        for role, name in self.ns.items():
            _run(["ip", "netns", "add", name])
            self._made.append(name)
            self.sh(role, "ip", "link", "set", "lo", "up")
        wan = self.ns["wan"]
        _run(["ip", "-n", wan, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", wan, "link", "set", "br0", "up"])
        wan_members = {"relay": RELAY_IP, "pub": PUBLIC_IP, **{f"nat{s}": NAT_WAN_IPS[s] for s in self.sides}}
        for role, ip in wan_members.items():
            port = f"p-{role}"
            _run(["ip", "-n", wan, "link", "add", port, "type", "veth", "peer", "name", "wan0", "netns", self.ns[role]])
            _run(["ip", "-n", wan, "link", "set", port, "master", "br0", "up"])
            self.sh(role, "ip", "addr", "add", f"{ip}/24", "dev", "wan0")
            self.sh(role, "ip", "link", "set", "wan0", "up")
        for side in self.sides:
            nat, priv = f"nat{side}", f"priv{side}"
            _run(["ip", "-n", self.ns[nat], "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
                  "netns", self.ns[priv]])
            self.sh(nat, "ip", "addr", "add", f"{LAN_GATEWAYS[side]}/24", "dev", "lan0")
            self.sh(nat, "ip", "link", "set", "lan0", "up")
            self.sh(priv, "ip", "addr", "add", f"{LAN_IPS[side]}/24", "dev", "eth0")
            self.sh(priv, "ip", "link", "set", "eth0", "up")
            self.sh(priv, "ip", "route", "add", "default", "via", LAN_GATEWAYS[side])
            self._home_router(nat)

    def _home_router(self, nat: str) -> None:
        self.sh(nat, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        rules = [
            ["-t", "nat", "-A", "POSTROUTING", "-o", "wan0", "-j", "MASQUERADE"],
            ["-P", "FORWARD", "DROP"],
            ["-A", "FORWARD", "-i", "lan0", "-o", "wan0", "-j", "ACCEPT"],
            ["-A", "FORWARD", "-i", "wan0", "-o", "lan0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED",
             "-j", "ACCEPT"],
            ["-A", "INPUT", "-i", "wan0", "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
            ["-A", "INPUT", "-i", "wan0", "-j", "DROP"],
        ]
        for rule in rules:
            self.sh(nat, "iptables", *rule)

    def randomize_ports(self) -> None:
        """Make every NAT box pick a random source port per connection (``MASQUERADE --random-fully``, as carrier-grade
        NATs do): DCUtR's prediction (NAT address : listen port) is then wrong and only relays connect the peers."""
        for side in self.sides:
            self.sh(f"nat{side}", "iptables", "-t", "nat", "-R", "POSTROUTING", "1", "-o", "wan0", "-j", "MASQUERADE",
                    "--random-fully")

    def block_between_nats(self) -> None:
        """Drop every packet between the two NATs' WAN addresses, so that only the relay path is left."""
        for nat, other in (("nata", NAT_WAN_IPS["b"]), ("natb", NAT_WAN_IPS["a"])):
            self.sh(nat, "iptables", "-t", "raw", "-I", "PREROUTING", "-s", other, "-j", "DROP")
            self.sh(nat, "iptables", "-t", "raw", "-I", "PREROUTING", "-d", other, "-j", "DROP")
            self.sh(nat, "iptables", "-t", "raw", "-I", "OUTPUT", "-d", other, "-j", "DROP")

    # -- agents --------------------------------------------------------------------------------------------------
    def spawn(self, name: str, role: str, *args: str) -> Agent:
        """Start an agent in the namespace of ``role`` (without waiting: ``agent.endpoint`` waits); closed at teardown."""
        agent = Agent(name, self.ns[role], list(args))
        self._agents.append(agent)
        return agent
