"""NAT traversal in the namespace lab: how long until a relayed link turns direct, and what each link costs per trip.

    sudo python benchmarks/nat_traversal.py [--pairs 3] [--frames 50]
    sudo python benchmarks/nat_traversal.py --fleet [--tokens 32]

``--fleet``: the CLI only, a bootstrap on the public segment, three stages (``qwen3_5_moe/tiny``, 8 layers) each behind
its own NAT and a client behind a fourth, once with port-preserving NATs and once with ``--random-fully``. For each
topology: the time from start to the last ``ready``, from the last ``ready`` to the first token (client process
start included: the generation's total minus its decode time), the time from each stage-to-stage relayed connect
to its punch (from the stages' log lines), the per-token decode time of two generations, and the bytes the relay
carried per generation. Writes benchmarks/results/nat_fleet.json.

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
    parser.add_argument("--fleet", action="store_true", help="the CLI fleet per topology (see the module docstring)")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"cannot run the NAT lab: {reason}", file=sys.stderr)
        return 2
    if args.fleet:
        return fleet(args.tokens)
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


def _stamp(line: str) -> float:
    import datetime

    return datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _fleet_once(topology: str, tokens: int, tmp: Path) -> dict[str, object]:
    import subprocess
    import time

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.net.test_nat_fleet import PROMPT, _bootstrap, _cli, _join, _make_tiny, _Proc, _status

    tiny = tmp / "tiny"
    if not tiny.exists():
        _make_tiny(tiny)
    procs: list[_Proc] = []
    with NatLab(sides="abcd") as lab:
        if topology == "random-fully":
            lab.randomize_ports()
        try:
            boot_p, boot = _bootstrap(lab, tmp)
            procs.append(boot_p)
            t_start = time.monotonic()
            stages = [_join(tiny, boot, layers, tmp / f"{side}.key", lab.ns[f"priv{side}"])
                      for side, layers in zip("abc", ("0:3", "3:6", "6:8"))]
            procs.extend(stages)
            t_ready = max(s.wait_for("ready ", 120)[1] for s in stages)
            ids = [s.wait_for("ready ", 1)[0].split()[1] for s in stages]
            boot_id = boot.rsplit("/p2p/", 1)[1]
            gens = []
            for k in range(2):
                circuit0 = _status(boot, lab.ns["privd"])[boot_id]["circuit_bytes"] if k else None
                t0 = time.monotonic()
                gen = subprocess.run(_cli("generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap",
                                          boot, "--prompt-ids", PROMPT, "--max-new-tokens", str(tokens),
                                          "--ignore-eos", "--json", ns=lab.ns["privd"]),
                                     capture_output=True, text=True, timeout=180)
                took = time.monotonic() - t0
                if gen.returncode != 0:
                    raise RuntimeError(gen.stderr[-2000:])
                out = json.loads(gen.stdout.strip().splitlines()[-1])
                row = {"total_s": took, "first_token_s": took - out["decode_ms"] / 1e3,
                       "decode_ms_per_token": out["decode_ms"] / max(1, out["steps"]), "tokens": out["tokens"]}
                if k == 0:
                    row["ready_to_start_s"] = t0 - t_ready
                else:
                    after = _status(boot, lab.ns["privd"])
                    row["circuit_bytes"] = after[boot_id]["circuit_bytes"] - circuit0
                    row["stage_links"] = {i[-6:]: [x["link"] for x in after[i]["stage_links"]] for i in ids}
                    row["relayed_stage_bytes"] = sum(after[i]["traffic"]["relayed_in"] +
                                                     after[i]["traffic"]["relayed_out"] for i in ids)
                gens.append(row)
            punches = []
            for s, nxt in zip(stages[:2], ids[1:]):  # the dialler's circuit connect, the acceptor's punch
                reached = [x for x in s.err if f"reached {nxt}" in x and "p2p-circuit" in x]
                me = s.wait_for("ready ", 1)[0].split()[1]
                acceptor = stages[ids.index(nxt)]
                punched = [x for x in acceptor.err if f"hole punch to {me} succeeded" in x]
                if reached and punched:
                    punches.append(_stamp(punched[0]) - _stamp(reached[0]))
        finally:
            for p in procs:
                p.stop()
    return {"topology": topology, "start_to_ready_s": t_ready - t_start, "relayed_to_direct_s": punches,
            "generations": gens}


def fleet(tokens: int) -> int:
    tmp = Path(tempfile.mkdtemp())
    results = [_fleet_once(t, tokens, tmp) for t in ("port-preserving", "random-fully")]
    for r in results:
        g0, g1 = r["generations"]
        print(f"{r['topology']:>16}: start->ready {r['start_to_ready_s']:.1f} s, ready->first token "
              f"{g0['ready_to_start_s'] + g0['first_token_s']:.2f} s, relayed->direct {r['relayed_to_direct_s']}, "
              f"decode {g0['decode_ms_per_token']:.1f} / {g1['decode_ms_per_token']:.1f} ms per token, relay "
              f"{g1['circuit_bytes']} B in generation 2, stage frames relayed {g1['relayed_stage_bytes']} B, "
              f"links {g1['stage_links']}")
    same = results[0]["generations"][0]["tokens"] == results[1]["generations"][0]["tokens"]
    print("tokens equal across topologies:", same)
    out = RESULTS.with_name("nat_fleet.json")
    out.write_text(json.dumps({"machine": platform.node(), "tokens": tokens, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
