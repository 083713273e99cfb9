"""``sangama-peer join | demo``.

``join`` serves a layer range until interrupted (a live panel on a terminal; a ``ready ...`` line for scripts; a
closed output pipe, as ``join ... | head -1`` leaves, ends its output, not the stage). ``demo`` starts a whole
fleet on loopback (see :mod:`.demo`).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any

from ..errors import SangamaError
from .argtypes import positive_int
from .demo import run_demo
from .hub_cmds import from_hub
from .join_checks import check_checkpoint, hold_key, warn_if_unchainable
from .local_fleet import READY_PREFIX
from .process import add_progress_arg, progress, quiet_libp2p, say, show_progress, until_signal
from .swarm import add_host_args, host_config
from .threads import set_threads

# torch (1.4-2.6 s to import), trio with libp2p (0.8-1.4 s) and the modules that import them (peer, model, hub) are
# imported in the handlers, and rich (0.02-0.05 s) where the live panel draws: cli/main.py imports every command
# module to build its parser (`--help` takes 0.1 s).


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "join",
        help="serve a range of a model's layers in the swarm",
        description="Serve layers A:B of a checkpoint (or 'auto': the range the swarm covers worst) until "
        "interrupted, announcing them in the DHT.",
    )
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint directory, .gguf file or hf:ORG/REPO[@REV][:FILE.gguf] (fetches only --layers)")
    p.add_argument("--layers", default=None, metavar="A:B|auto[:N]",
                   help="layer range to serve; auto = the third of the model the swarm covers worst")
    p.add_argument("--model-id", default=None, help="swarm-wide model name (default: the checkpoint's name)")
    p.add_argument("--config", type=Path, default=None, help="peer config TOML ([host], [stage], [client], [api])")
    add_host_args(p)
    p.add_argument("--key", type=Path, default=None, help="key file (default ~/.sangama/peer.key)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="cpu (default), cuda or cuda:N; the compute dtype defaults to bfloat16 on CUDA")
    p.add_argument("--batch-invariant", action="store_true",
                   help="make each request's numbers independent of its batch (slower on CPU)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: half the cores this process may use, at least 1)")
    p.add_argument("--dequantize-per-use", action="store_true",
                   help="keep quantized GGUF weights as stored and dequantize them on every use (slow)")
    p.add_argument("--lane-port", type=int, default=None, metavar="PORT",
                   help="TCP port for direct lanes (stage traffic off libp2p; default: any free port)")
    p.add_argument("--no-lanes", action="store_true",
                   help="carry all stage traffic over libp2p streams (no direct lanes)")
    p.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (0 = any free port; default: off)")
    p.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="address the metrics server listens on (default 127.0.0.1)")
    add_progress_arg(p, "loading the stage")
    p.add_argument("--run-for", type=float, default=None, help=argparse.SUPPRESS)  # tests: stop after N seconds
    p.set_defaults(handler=_join)

    p = sub.add_parser("demo", help="start a local fleet on a tiny model and print its tables",
                       description="Make a tiny model, start a bootstrap node and three stage peers on loopback as "
                       "separate processes, generate with and without guesses, print the tables, stop everything.")
    p.add_argument("--tokens", type=positive_int, default=48, help="new tokens per request (default 48)")
    p.add_argument("--requests", default="1,4,16", help="concurrent request counts (default 1,4,16)")
    p.add_argument("--guesses", default="0,2,4,6", help="guess counts to compare (default 0,2,4,6)")
    p.add_argument("--workdir", type=Path, default=None, help="keep the model and logs here (default: a temp dir)")
    p.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="run this checkpoint (split into three even stages) instead of a random tiny model, e.g. one "
                   "that benchmarks/train_tiny.py trained, so that guesses get accepted")
    p.add_argument("--json", type=Path, default=None, help="also write the results as JSON to this file")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch threads of each stage process (default: this process's cores shared among the stages)")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="each stage's device: cpu (default), cuda or cuda:N (passed to join)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="each stage's compute dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    add_progress_arg(p, "the fleet coming up, stage by stage")
    p.set_defaults(handler=_demo)


def _join(args: argparse.Namespace) -> int:
    import torch

    from ..config import PeerConfig
    from ..net.host import check_ports_free

    quiet_libp2p()
    torch.set_grad_enabled(False)
    set_threads(args.threads)
    config = PeerConfig.from_toml(args.config) if args.config else PeerConfig()
    config = config.replace(host=host_config(args, serving=True))
    model = args.model or config.model_path
    if model is None:
        raise SangamaError("give the checkpoint to serve: --model DIR (or [stage] model in --config)")
    layers = args.layers or (config.layers if config.model_path is not None else "auto")
    # the key's lock first, then the checkpoint and the range: each refused in seconds, before any layer loads and
    # before the swarm is dialled
    key_pair, key_lock = hold_key(config.host.key_path)
    try:
        check_ports_free(config.host.listen_addrs)  # a busy --listen port, before the layers load
        return _join_holding(args, config, model, layers, key_pair)
    finally:
        key_lock.close()


def _join_holding(args: argparse.Namespace, config: Any, model: Any, layers: str, key_pair: Any) -> int:
    import trio

    from ..config import default_model_id
    from ..peer import Peer

    model_id = args.model_id
    if (model_id is None and args.model is not None and config.stage is not None and config.model_path is not None
            and config.stage.model_id == default_model_id(config.model_path)):
        model_id = default_model_id(args.model)  # the id the file took from its own model follows --model
    options: dict[str, Any] = {}
    if args.device is not None:
        from ..model.device import default_dtype, resolve_device

        device = resolve_device(args.device)  # before anything starts: a one-line error for cuda without CUDA
        options["device"] = str(device)
        options["dtype"] = default_dtype(device, args.dtype)
    elif args.dtype:
        options["dtype"] = args.dtype
    model, hub_id = from_hub(model, layers)  # hf:...: only the files (or byte ranges) of the layers served
    model_id = model_id or hub_id
    checked = check_checkpoint(model, layers)
    if not config.host.bootstrap_addrs:
        print("no --bootstrap (and bootstrap/public.txt lists none): serving alone, as the first peer of a new "
              "swarm; other peers join with --bootstrap and one of the addresses printed below", file=sys.stderr,
              flush=True)
    if args.batch_invariant:
        options["batch_invariant"] = True
    if args.dequantize_per_use:
        options["fused"] = False
    if args.lane_port is not None:
        options["lane_port"] = args.lane_port
    if args.no_lanes:
        options["lanes"] = False

    show = show_progress(args.progress)
    what = f"layers {layers}" if not str(layers).startswith("auto") else "the layers the swarm lacks"

    async def main() -> None:
        async with Peer(config.replace(model_path=None), key_pair=key_pair) as peer, trio.open_nursery() as extras:
            await _serve(peer, extras)
            extras.cancel_scope.cancel()

    async def _serve(peer: Any, extras: Any) -> None:
        metrics = None
        if args.metrics_port is not None:  # bound before the layers load: a busy port fails in seconds
            from ..net.bans import default_bans_path
            from ..stage.metrics import serve_metrics, stage_registry

            metrics = await extras.start(serve_metrics, stage_registry(lambda: peer.servers, default_bans_path()),
                                         args.metrics_host, args.metrics_port)
        mid = model_id or (config.stage.model_id if config.stage is not None else default_model_id(model))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(warn_if_unchainable, peer.node, mid, checked, extras)  # while the layers load
            with progress(f"loading {what} of {Path(model).name}", show=show):
                start, end = await peer.serve(model, layers, model_id=model_id, tokenizer=False, **options)
            # a lookup still under way gets a few seconds more, not the stage's readiness
            nursery.cancel_scope.deadline = min(nursery.cancel_scope.deadline, trio.current_time() + 10.0)
        server = peer.servers[-1]
        # `ready` means reachable: public, or with a relay circuit address in the published record
        with progress("waiting until other peers can reach this one", show=show):
            reach = await peer.wait_reachable()
        # from here on a signal stops us through the normal exit path: install the handler before saying ready
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            say(f"{READY_PREFIX}{peer.peer_id} {server.config.model_id} {start}:{end}")
            for addr in peer.addrs:
                say(f"  listening {addr}")
            say(f"  reachable {reach}")
            if server.identity is not None:  # what clients pin with --fingerprint (cli/pin.py)
                say(f"  pin {server.identity.fingerprint}:{server.identity.num_layers}")
            if metrics is not None:
                say(f"  metrics {metrics}/metrics")
            if peer.rebalancer is not None:  # an auto range may move later (stage/rebalance.py)
                peer.rebalancer.on_move = lambda m: say(f"moved {peer.peer_id} {server.config.model_id} "
                                                        f"{m.new[0]}:{m.new[1]}")
            if sys.stdout.isatty():
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(_live_panel, peer)
                    await until_signal(signals, args.run_for)
                    nursery.cancel_scope.cancel()
            else:
                await until_signal(signals, args.run_for)
            say("stopping")

    trio.run(main)
    return 0


def _panel(peer: Any) -> Any:
    from rich.table import Table

    table = Table(title=f"sangama peer {peer.peer_id}", title_justify="left")
    for col in ("model", "layers", "fingerprint", "sessions", "free", "queue", "steps/s (measured)", "links"):
        table.add_column(col)
    for server in peer.servers:
        try:
            info = server.info()
        except Exception as exc:  # a panel must never take the peer down
            table.add_row(server.config.model_id, f"{server.config.start}:{server.config.end}", "?", "?", "?", "?",
                          f"error: {exc}", "?")
            continue
        links = ", ".join(f"{n} {kind}" for kind, n in server.link_kinds().items() if n) or "-"
        ident = server.identity
        table.add_row(info.model_id, f"{info.start}:{info.end}", ident.fingerprint[:12] if ident else "-",
                      str(server.open_sessions),
                      str(info.free_sessions), str(info.queue), f"{info.throughput:.1f}", links)
    return table


async def _live_panel(peer: Any) -> None:
    import trio
    from rich.live import Live

    with Live(_panel(peer), refresh_per_second=2, transient=False) as live:
        while True:
            await trio.sleep(0.5)
            live.update(_panel(peer))


def _demo(args: argparse.Namespace) -> int:
    quiet_libp2p()  # the demo's client sees routine churn too (dials to departed peers) that py-libp2p logs as errors
    return run_demo(args)
