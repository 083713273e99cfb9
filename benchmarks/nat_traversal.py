"""NAT traversal in the namespace lab: how long until a relayed link turns direct, and what each link costs per trip.

    sudo python benchmarks/nat_traversal.py [--pairs 3] [--frames 50]

Needs root, ``ip`` and ``iptables`` (the lab of ``tests/net/netns.py``: two peers behind their own Linux NAT, a relay
on the shared segment). For each of ``--pairs`` fresh peer pairs it measures the relayed connect, the time from the
relayed connection to a verified direct one (DCUtR driven by the accepting side), and the echo round trip of 4 KiB
frames on the direct link; then, with traffic between the NATs blocked, the echo round trip over the relay.
Prints a table and writes benchmarks/results/nat_traversal.json.

Goal: the direct link is up within 3 s of the relayed one, and a relayed link keeps working when punching fails.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

from libp2p.peer.id import ID

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "net"))

from netns import RELAY_IP, NatLab, netns_unavailable_reason  # noqa: E402

from sangama_p2p.net.identity import generate_key_pair, save_key_pair  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "nat_traversal.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--frames", type=int, default=50)
    args = parser.parse_args()
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"cannot run the NAT lab: {reason}", file=sys.stderr)
        return 2
    key = generate_key_pair()
    key_file = Path(tempfile.mkdtemp()) / "relay.key"
    save_key_pair(key, key_file)
    boot = f"/ip4/{RELAY_IP}/tcp/4001/p2p/{ID.from_pubkey(key.public_key)}"
    rows = []
    with NatLab() as lab:
        lab.spawn("relay", "relay", "--port", "4001", "--relay", "--key", str(key_file))
        for i in range(args.pairs):
            a = lab.spawn(f"a{i}", "priva", "--port", str(4300 + i), "--bootstrap", boot)
            b = lab.spawn(f"b{i}", "privb", "--port", str(4400 + i), "--bootstrap", boot)
            dest = b.endpoint.peer_id
            connect = a.call("connect", peer_id=dest, addrs=b.call("info")["circuit_addrs"])
            direct = a.call("wait_direct", peer_id=dest, limit=20.0)
            echo = a.call("echo", peer_id=dest, count=args.frames, size=4096)
            rows.append({
                "link": "direct" if direct["link"] else "relayed",
                "connect_s": connect["elapsed"],
                "to_direct_s": direct["elapsed"] if direct["link"] else None,
                "rtt_4k_ms": echo["rtt_median"] * 1e3,
            })
        lab.block_between_nats()
        c = lab.spawn("c", "priva", "--port", "4500", "--bootstrap", boot)
        d = lab.spawn("d", "privb", "--port", "4501", "--bootstrap", boot)
        connect = c.call("connect", peer_id=d.endpoint.peer_id, addrs=d.call("info")["circuit_addrs"])
        echo = c.call("echo", peer_id=d.endpoint.peer_id, count=args.frames, size=4096)
        rows.append({"link": echo["link"]["kind"], "connect_s": connect["elapsed"], "to_direct_s": None,
                     "rtt_4k_ms": echo["rtt_median"] * 1e3})

    print(f"{'pair':>6} {'link':>8} {'connect s':>10} {'to direct s':>12} {'4 KiB RTT ms':>13}")
    for i, row in enumerate(rows):
        to_direct = "-" if row["to_direct_s"] is None else f"{row['to_direct_s']:.2f}"
        name = str(i) if i < args.pairs else "block"
        print(f"{name:>6} {row['link']:>8} {row['connect_s']:>10.2f} {to_direct:>12} {row['rtt_4k_ms']:>13.2f}")
    punched = [r["to_direct_s"] for r in rows[: args.pairs] if r["to_direct_s"] is not None]
    summary = {
        "punched": f"{len(punched)}/{args.pairs}",
        "to_direct_median_s": statistics.median(punched) if punched else None,
    }
    print(summary)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"machine": platform.node(), "rows": rows, **summary}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
