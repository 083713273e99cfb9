"""``sangama-peer id | bootstrap | status``: identity, a private fleet's bootstrap + relay node, the swarm's state.

Handlers import trio and libp2p lazily and never torch: a bootstrap node runs on machines without it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from ..errors import NetworkError
from .argtypes import positive_float
from .process import quiet_libp2p, say, until_signal
from .swarm import BOOTSTRAP_DIR, check_bootstrap_dialable, default_bootstrap_addrs, is_tcp
from .tables import peer_label

# trio and libp2p (0.8-1.4 s to import) and the net modules that import them are imported in the handlers: cli/main.py
# imports every command module to build its parser (`sangama-peer --help` takes 0.1 s).


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
                   help=f"host config TOML with a [host] table (see {BOOTSTRAP_DIR / 'bootstrap.toml'})")
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


def _id(args: argparse.Namespace) -> int:
    from ..net.identity import load_or_create_key_pair, peer_id_of

    print(peer_id_of(load_or_create_key_pair(args.key)).to_base58())
    return 0


def _bootstrap(args: argparse.Namespace) -> int:
    import trio

    from ..net.config import HostConfig
    from ..net.fleet import read_fleet_secret
    from ..net.host import open_host
    from ..net.traversal import Traversal, TraversalConfig

    quiet_libp2p()
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

    check_dialable_listen(config.listen_addrs)

    async def main() -> None:
        traversal = Traversal(TraversalConfig(serve_relay=True, reachability="public", hole_punch=False))
        async with open_host(config, services=[traversal.run]) as node:
            # from here on a signal stops the node through its normal exit path, saying so
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                fleet = " (private fleet)" if config.fleet_secret is not None else ""
                say(f"bootstrap node {node.peer_id}{fleet}; peers join with:")
                for addr in node.advertised_addrs():
                    if is_tcp(str(addr)):
                        say(f"  --bootstrap {addr}")
                got = await until_signal(signals, args.run_for)
                say(f"stopping ({signal.Signals(got).name})" if got is not None else "stopping")

    trio.run(main)
    return 0


def check_dialable_listen(listen_addrs: tuple[str, ...]) -> None:
    """A bootstrap node must listen where peers dial: TCP (a peer's host has the transports of its own listen
    addresses, TCP by default). Only QUIC (or another transport): refused; QUIC beside TCP: a warning."""
    others = [a for a in listen_addrs if not is_tcp(a)]
    if len(others) == len(listen_addrs):
        raise NetworkError(f"cannot bootstrap on {', '.join(others)}: peers dial bootstrap nodes over TCP (their "
                           "hosts listen on TCP by default and dial only what they listen on); listen on "
                           "/ip4/0.0.0.0/tcp/4001")
    if others:
        print(f"warning: peers dial bootstrap nodes over TCP: {', '.join(others)} reach only peers that listen "
              "there too, so only the TCP addresses are printed", file=sys.stderr, flush=True)


def _status(args: argparse.Namespace) -> int:
    import trio

    from ..net.config import HostConfig
    from ..net.fleet import read_fleet_secret
    from ..net.host import open_host
    from ..net.identity import generate_key_pair
    from ..net.status import survey

    quiet_libp2p()
    bootstrap = tuple(args.bootstrap or default_bootstrap_addrs())
    if not bootstrap:
        raise NetworkError("no bootstrap address: pass --bootstrap MULTIADDR (bootstrap/public.txt is empty)")
    check_bootstrap_dialable(bootstrap, ("/ip4/0.0.0.0/tcp/0",))
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

    from ..net.bans import default_bans_path

    status = trio.run(main).with_bans(default_bans_path())
    if args.json:
        json.dump(status.to_json(), sys.stdout, indent=2)
        print()
    else:
        _print_table(status, bootstrap_peer_ids(bootstrap))
    return 0


def _print_table(status, bootstrap_ids: frozenset[str] = frozenset(), console=None) -> None:
    """The swarm within 80 columns: per model, what a client would chain and a row per peer serving it; then the
    peers serving nothing (``bootstrap`` for the nodes we bootstrapped from); then every peer's full id and
    addresses. Peers are named by a unique id suffix in the tables."""
    from rich import box  # rich: 0.02-0.05 s to import, only when a table is printed
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    console.print(f"[bold]Sangama swarm: {len(status.peers)} peers[/bold]")
    lineups = status.lineups()
    by_model: dict[str, list[tuple[object, object]]] = {}
    for peer in status.peers:
        for rec in peer.records:
            by_model.setdefault(rec.model_id, []).append((peer, rec))
    for model, spans in status.models().items():
        table = Table(title=f"{model}: layers covered {_coverage(spans)}", title_justify="left",
                      box=box.SIMPLE_HEAD)
        for column in ("peer", "layers", "steps/s", "free", "link", "rtt ms", "reach"):
            table.add_column(column, no_wrap=column != "link")
        for peer, rec in sorted(by_model[model], key=lambda pr: (pr[1].start, pr[1].end)):
            table.add_row(peer_label(peer.peer_id), f"{rec.start}:{rec.end}", f"{rec.throughput:.1f}",
                          str(rec.free_sessions), _short_link(peer.link), _rtt(peer), _short_link(rec.reachability))
        console.print(table)
        for line in lineup_lines(lineups[model]):
            console.print(line, markup=False, soft_wrap=True)
    others = [p for p in status.peers if not p.records]
    if others:
        table = Table(title="Peers serving no model", title_justify="left", box=box.SIMPLE_HEAD)
        for column in ("peer", "role", "link", "rtt ms"):
            table.add_column(column)
        for peer in others:
            role = "bootstrap" if peer.peer_id in bootstrap_ids else (peer.error or "-")
            table.add_row(peer_label(peer.peer_id), role, _short_link(peer.link), _rtt(peer))
        console.print(table)
    if status.bans:
        from ..net.status import ban_lines

        console.print(f"[bold]banned here[/bold] ({len(status.bans)}, local to this machine):")
        for line in ban_lines(status):
            console.print(line, markup=False, soft_wrap=True)
    console.print("steps/s: measured steps per second of one session; free: sessions it can still open; "
                  "link: how this peer reached it; reach: what it announces (direct, or the relay it is reached "
                  "through)", soft_wrap=False)
    console.print("peers (full ids, announced addresses without their /p2p/<id>):")
    for peer in status.peers:
        addrs = sorted({a.removesuffix(f"/p2p/{peer.peer_id}") for rec in peer.records for a in rec.addrs})
        role = " (bootstrap)" if peer.peer_id in bootstrap_ids else ""
        moves = peer.rebalance or {}
        if moves.get("moves") and isinstance(moves.get("last"), dict):
            last = moves["last"]
            role += f" (moved {moves['moves']}x, last {last.get('from')} -> {last.get('to')})"
        console.print(f"  {peer.peer_id}{role}", markup=False, soft_wrap=True)
        for addr in addrs[:3]:
            console.print(f"    {addr}", markup=False, soft_wrap=True)


def _rtt(peer) -> str:
    return f"{peer.rtt_ms:.1f}" if peer.rtt_ms is not None else "-"


def _short_link(link: str) -> str:
    """``relayed via <id>`` / a relay's id, by its unique suffix."""
    if link.startswith("relayed via "):
        return "relay " + peer_label(link.removeprefix("relayed via "))
    return link if len(link) <= 14 else peer_label(link)


def bootstrap_peer_ids(addrs: tuple[str, ...]) -> frozenset[str]:
    """The peer ids that bootstrap multiaddrs end in (``.../p2p/<id>``)."""
    return frozenset(a.rsplit("/p2p/", 1)[1].split("/", 1)[0] for a in addrs if "/p2p/" in a)


def lineup_lines(lineup) -> list[str]:
    """What a client would chain of one model, and every peer left out with the reason (plain text lines)."""
    if lineup.fingerprint is None:
        lines = ["  no usable peer"]
    else:
        spans = [(r.peer_id, r.start, r.end) for r in lineup.members]
        lines = [f"  chained: fingerprint {lineup.fingerprint[:12]}, {lineup.num_layers} layers, "
                 f"{len(lineup.members)} peers, layers covered {_coverage(spans)}",
                 f"  pin (for --fingerprint): {lineup.fingerprint}:{lineup.num_layers}"]
    for out in lineup.left_out:
        lines.append(f"  left out {peer_label(out.peer_id)} {out.start}:{out.end}: {out.reason}")
    for c in lineup.conflicts:
        held = "; ".join(f"{h[:12]} by {', '.join(peer_label(p) for p in peers)}" for h, peers in c.hashes)
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
