"""A stage whose lane port a firewall drops (SYNs unanswered, as most firewalls do): the client gives up on the lane
after ``lane_timeout``, carries the stage traffic over libp2p, and does not try again. Runs in a network namespace of
its own (lo only), so the firewall rule never touches the host."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from .netns import netns_unavailable_reason

_REASON = netns_unavailable_reason()
pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(_REASON is not None, reason=f"network namespaces unavailable: {_REASON}"),
]

AGENT = Path(__file__).with_name("lane_firewall_agent.py")
LANE_PORT = 47123


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def test_a_firewalled_lane_port_falls_back_to_libp2p_after_the_lane_timeout():
    ns = f"sglane{os.getpid()}{uuid.uuid4().hex[:4]}"
    _ip("netns", "add", ns)
    try:
        _ip("netns", "exec", ns, "ip", "link", "set", "lo", "up")
        _ip("netns", "exec", ns, "iptables", "-A", "INPUT", "-p", "tcp", "--dport", str(LANE_PORT), "--syn",
            "-j", "DROP")
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(AGENT), str(LANE_PORT), "1.0"],
                             capture_output=True, text=True, timeout=180, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        res = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        _ip("netns", "del", ns)
    assert res["bound_port"] == LANE_PORT
    assert res["first"] == res["second"] == res["want"]
    assert res["links"]["lane"] == 0 and res["links"]["libp2p"] >= 1, res["links"]
    assert len(res["failed"]) == 1 and "within 1.0 s" in next(iter(res["failed"].values()))
    assert res["first_s"] >= 1.0  # the first generation waited for the lane once...
    assert res["second_s"] < 1.0  # ...the second did not wait again
