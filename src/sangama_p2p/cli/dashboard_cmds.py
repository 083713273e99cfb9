"""``sangama-peer dashboard``: a live web page of the swarm, with Prometheus metrics (:mod:`sangama_p2p.dashboard`).

Prints ``dashboard listening http://HOST:PORT`` once the page is served; SIGINT/SIGTERM stop it. Like ``status`` it
joins the swarm with a throwaway identity and serves nothing; it never imports torch.
"""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

from ..errors import NetworkError
from .argtypes import positive_float
from .process import quiet_libp2p, say, until_signal
from .swarm import check_bootstrap_dialable, default_bootstrap_addrs

# trio, libp2p, starlette and hypercorn are imported in the handler: cli/main.py imports every command module to
# build its parser (`sangama-peer --help` takes 0.1 s)

READY = "dashboard listening "


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dashboard", help="serve a live web page of the swarm (and Prometheus /metrics)",
                       description="Survey the swarm every few seconds (as `status` does) and serve a page that "
                       "updates live: models and their layer coverage, each peer's range, measured steps/s, sessions, "
                       "queue, reachability and version, the links between stages, moves and bans. Routes: / (the "
                       "page), /events (server-sent events), /state.json, /metrics, /health.")
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR",
                   help="bootstrap node address ending in /p2p/<id> (repeatable; default: bootstrap/public.txt)")
    p.add_argument("--model", action="append", default=[], metavar="ID",
                   help="also look up the peers serving this model id (repeatable)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8090, help="port to listen on (default 8090; 0 = any free port)")
    p.add_argument("--refresh", type=positive_float, default=5.0, metavar="S",
                   help="seconds between surveys (default 5)")
    p.add_argument("--timeout", type=positive_float, default=5.0, help="seconds to wait for each peer (default 5)")
    p.add_argument("--fleet-secret-file", type=Path, default=None, help="file holding the private fleet's secret")
    p.add_argument("--run-for", type=float, default=None, help=argparse.SUPPRESS)  # tests: stop after N seconds
    p.set_defaults(handler=_dashboard)


def _dashboard(args: argparse.Namespace) -> int:
    import trio

    from ..dashboard.live import SwarmWatch
    from ..dashboard.server import serve_dashboard
    from ..net.bans import default_bans_path
    from ..net.config import HostConfig
    from ..net.fleet import read_fleet_secret
    from ..net.host import open_host
    from ..net.identity import generate_key_pair
    from ..net.traversal import Traversal, TraversalConfig
    from .net_cmds import bootstrap_peer_ids

    quiet_libp2p()
    bootstrap = tuple(args.bootstrap or default_bootstrap_addrs())
    if not bootstrap:
        raise NetworkError("no bootstrap address: pass --bootstrap MULTIADDR (bootstrap/public.txt is empty)")
    check_bootstrap_dialable(bootstrap, ("/ip4/0.0.0.0/tcp/0",))
    config = HostConfig(listen_addrs=("/ip4/0.0.0.0/tcp/0",), bootstrap_addrs=bootstrap, dht_server=False,
                        handshake_timeout=args.timeout,
                        fleet_secret=read_fleet_secret(args.fleet_secret_file) if args.fleet_secret_file else None)
    traversal = Traversal(TraversalConfig(reachability="public"))  # the relay client, as `status` has

    async def main() -> None:
        async with open_host(config, key_pair=generate_key_pair(), services=[traversal.run]) as node:
            watch = SwarmWatch(node, models=args.model, refresh_s=args.refresh, timeout=args.timeout,
                               bans_path=default_bans_path(), bootstrap_ids=bootstrap_peer_ids(bootstrap))
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async with trio.open_nursery() as nursery:
                    url = await nursery.start(serve_dashboard, watch, args.host, args.port)
                    say(f"{READY}{url}")
                    got = await until_signal(signals, args.run_for)
                    say(f"stopping ({signal.Signals(got).name})" if got is not None else "stopping")
                    nursery.cancel_scope.cancel()

    trio.run(main)
    return 0
