"""``sangama-peer id | bootstrap | status``: identity, a private fleet's bootstrap + relay node, the swarm's state.

Handlers import trio and libp2p lazily and never torch: a bootstrap node runs on machines without it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .argtypes import positive_float

_BOOTSTRAP_DIR = Path(__file__).resolve().parents[3] / "bootstrap"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("id", help="print this peer's id (creating its key if needed)")
    p.add_argument("--key", type=Path, default=None, help="key file (default ~/.sangama/peer.key)")
    p.set_defaults(handler=_id)

    p = sub.add_parser(
        "bootstrap",
        help="run a bootstrap + relay node (e.g. for a private fleet)",
        description="Run a DHT server that other peers bootstrap from, relaying circuits for peers behind NAT. "
        "With --fleet-secret-file only peers holding the same secret can connect.",
    )
    p.add_argument("--config", type=Path, default=None,
                   help=f"host config TOML with a [host] table (see {_BOOTSTRAP_DIR / 'bootstrap.toml'})")
    p.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                   help="listen address (repeatable; default /ip4/0.0.0.0/tcp/4001)")
    p.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                   help="public address to advertise instead of the listen addresses (repeatable)")
    p.add_argument("--fleet-secret-file", type=Path, default=None, help="file holding the private fleet's secret")
    p.add_argument("--key", type=Path, default=None, help="key file (default ~/.sangama/peer.key)")
    p.add_argument("--run-for", type=float, default=None, help=argparse.SUPPRESS)  # tests: stop after N seconds
    p.set_defaults(handler=_bootstrap)

    p = sub.add_parser("status", help="show the swarm: peers, models, layer ranges, throughput, links")
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR",
                   help="bootstrap node address ending in /p2p/<id> (repeatable; default: bootstrap/public.txt)")
    p.add_argument("--model", action="append", default=[], help="also look up the peers serving this model id")
    p.add_argument("--fleet-secret-file", type=Path, default=None, help="file holding the private fleet's secret")
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for each peer (default 5)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(handler=_status)


def default_bootstrap_addrs() -> tuple[str, ...]:
    """The public bootstrap list shipped in ``bootstrap/public.txt`` (one multiaddr a line, ``#`` comments)."""
    path = _BOOTSTRAP_DIR / "public.txt"
    if not path.exists():
        return ()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line)


def _id(args: argparse.Namespace) -> int:
    from ..net.identity import load_or_create_key_pair, peer_id_of

    print(peer_id_of(load_or_create_key_pair(args.key)).to_base58())
    return 0


def _quiet_libp2p() -> None:
    import logging

    import libp2p  # noqa: F401  its import resets the "libp2p" logger to WARNING: let that happen before, not after

    level = logging.getLogger().level
    if level > logging.INFO:  # no -v: py-libp2p logs routine stream resets as warnings, some on the root logger
        logging.getLogger("libp2p").setLevel(logging.CRITICAL)
        logging.getLogger().setLevel(logging.CRITICAL)
        logging.getLogger("sangama_p2p").setLevel(level)  # our own warnings still show
        return
    # libp2p's import gave its logger no handler and propagate=False: its lines reached only logging's last resort
    libp2p_log = logging.getLogger("libp2p")
    libp2p_log.propagate = True
    libp2p_log.setLevel(logging.WARNING if level > logging.DEBUG else level)  # -v: its warnings; -vv: everything


def _bootstrap(args: argparse.Namespace) -> int:
    import trio

    from ..net.config import HostConfig
    from ..net.fleet import read_fleet_secret
    from ..net.host import open_host
    from ..net.traversal import Traversal, TraversalConfig

    _quiet_libp2p()
    overrides = {
        "listen_addrs": tuple(args.listen) if args.listen else None,
        "announce_addrs": tuple(args.announce) if args.announce else None,
        "key_path": args.key,
        "fleet_secret": read_fleet_secret(args.fleet_secret_file) if args.fleet_secret_file else None,
    }
    if args.config is not None:
        config = HostConfig.from_toml(args.config, **overrides)
    else:
        config = HostConfig(listen_addrs=("/ip4/0.0.0.0/tcp/4001",))
        config = config.replace(**{k: v for k, v in overrides.items() if v is not None})
    config = config.replace(dht_server=True, relay_hop=True, bootstrap_addrs=())

    async def main() -> None:
        traversal = Traversal(TraversalConfig(serve_relay=True, reachability="public", hole_punch=False))
        async with open_host(config, services=[traversal.run]) as node:
            fleet = " (private fleet)" if config.fleet_secret is not None else ""
            print(f"bootstrap node {node.peer_id}{fleet}; peers join with:", flush=True)
            for addr in node.advertised_addrs():
                print(f"  --bootstrap {addr}", flush=True)
            if args.run_for is not None:
                await trio.sleep(args.run_for)
            else:
                await trio.sleep_forever()

    trio.run(main)
    return 0


def _status(args: argparse.Namespace) -> int:
    import trio

    from ..errors import NetworkError
    from ..net.config import HostConfig
    from ..net.fleet import read_fleet_secret
    from ..net.host import open_host
    from ..net.identity import generate_key_pair
    from ..net.status import survey

    _quiet_libp2p()
    bootstrap = tuple(args.bootstrap or default_bootstrap_addrs())
    if not bootstrap:
        raise NetworkError("no bootstrap address: pass --bootstrap MULTIADDR (bootstrap/public.txt is empty)")
    config = HostConfig(
        listen_addrs=("/ip4/0.0.0.0/tcp/0",),
        bootstrap_addrs=bootstrap,
        dht_server=False,
        handshake_timeout=args.timeout,
        fleet_secret=read_fleet_secret(args.fleet_secret_file) if args.fleet_secret_file else None,
    )

    from ..net.traversal import Traversal, TraversalConfig

    # the relay client, to reach peers behind NAT through their /p2p-circuit addresses (no reservation of our own:
    # nobody dials a survey, so no dial-back either)
    traversal = Traversal(TraversalConfig(reachability="public"))

    async def main():
        async with open_host(config, key_pair=generate_key_pair(), services=[traversal.run]) as node:
            return await survey(node, models=args.model, timeout=args.timeout)  # a throwaway identity: we only look

    status = trio.run(main)
    if args.json:
        json.dump(status.to_json(), sys.stdout, indent=2)
        print()
    else:
        _print_table(status)
    return 0


def _print_table(status) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Sangama swarm: {len(status.peers)} peers")
    for column in ("peer", "model", "layers", "fingerprint", "tok/s", "free", "link", "rtt ms", "reach", "addresses"):
        table.add_column(column, overflow="fold")
    for peer in status.peers:
        short = peer.peer_id[:8] + "…" + peer.peer_id[-6:]
        rtt = f"{peer.rtt_ms:.1f}" if peer.rtt_ms is not None else "-"
        if not peer.records:
            table.add_row(short, "-", "-", "-", "-", "-", peer.link, rtt, "-", peer.error or "")
        for rec in peer.records:
            table.add_row(short, rec.model_id, f"{rec.start}:{rec.end}", f"{rec.fingerprint[:12]} ({rec.num_layers})",
                          f"{rec.throughput:.1f}",
                          str(rec.free_cache), peer.link, rtt, rec.reachability[:14], "\n".join(rec.addrs[:3]))
    console = Console()
    console.print(table)
    lineups = status.lineups()
    for model, spans in status.models().items():
        covered = _coverage(spans)
        console.print(f"[bold]{model}[/bold]: layers covered {covered}")
        for line in lineup_lines(lineups[model]):
            console.print(line, markup=False, soft_wrap=True)


def lineup_lines(lineup) -> list[str]:
    """What a client would chain of one model, and every peer left out with the reason (plain text lines)."""
    if lineup.fingerprint is None:
        lines = ["  no usable peer"]
    else:
        spans = [(r.peer_id, r.start, r.end) for r in lineup.members]
        lines = [f"  chained: fingerprint {lineup.fingerprint[:12]}, {lineup.num_layers} layers, "
                 f"{len(lineup.members)} peers, layers covered {_coverage(spans)}"]
    for out in lineup.left_out:
        lines.append(f"  left out {out.peer_id[:8]}…{out.peer_id[-6:]} {out.start}:{out.end}: {out.reason}")
    for c in lineup.conflicts:
        held = "; ".join(f"{h[:12]} by {', '.join(p[:8] + '…' for p in peers)}" for h, peers in c.hashes)
        lines.append(f"  part {c.part} differs between peers of one fingerprint: {held}")
    return lines


def _coverage(spans: list[tuple[str, int, int]]) -> str:
    merged: list[list[int]] = []
    for _, start, end in sorted(spans, key=lambda s: s[1]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return ", ".join(f"{a}:{b}" for a, b in merged) or "none"
