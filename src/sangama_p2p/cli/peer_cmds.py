"""``sangama-peer join | demo`` and the network mode of ``generate`` (``chat`` is in :mod:`.chat_cmds`).

``join`` serves a layer range until interrupted (a live panel on a terminal; a ``ready ...`` line for scripts).
``generate`` without ``--local`` drives generations through the swarm from a throwaway identity.
``demo`` starts a whole fleet on loopback (see :mod:`.demo`). Heavy modules load inside the handlers only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .argtypes import positive_int
from .threads import set_threads
from .local_fleet import READY_PREFIX


def add_host_args(p: argparse.ArgumentParser, *, listen: bool = True) -> None:
    """The flags every networked command shares."""
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR",
                   help="bootstrap node address ending in /p2p/<id> (repeatable; default: bootstrap/public.txt)")
    if listen:
        p.add_argument("--listen", action="append", default=None, metavar="MULTIADDR",
                       help="listen address (repeatable; default /ip4/0.0.0.0/tcp/0)")
        p.add_argument("--announce", action="append", default=None, metavar="MULTIADDR",
                       help="public address to advertise instead of the listen addresses (repeatable)")
    p.add_argument("--fleet-secret-file", type=Path, default=None, help="file holding the private fleet's secret")


def add_verify_arg(p: argparse.ArgumentParser) -> None:
    """``--verify FRACTION``, for the commands that generate through the swarm."""
    from .argtypes import fraction

    p.add_argument("--verify", type=fraction, default=None, metavar="FRACTION",
                   help="re-run this fraction of trips on a second chain of other peers and ban a peer caught lying "
                   "(default: 0.05 in a public swarm, 0 with --fleet-secret-file); bans: ~/.sangama/bans.json")


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
    p.add_argument("--config", type=Path, default=None, help="peer config TOML ([host], [stage], [client])")
    add_host_args(p)
    p.add_argument("--key", type=Path, default=None, help="key file (default ~/.sangama/peer.key)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="cpu (default), cuda or cuda:N; the compute dtype defaults to bfloat16 on CUDA")
    p.add_argument("--batch-invariant", action="store_true",
                   help="make each request's numbers independent of its batch (slower on CPU)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: every core this process may use)")
    p.add_argument("--dequantize-per-use", action="store_true",
                   help="keep quantized GGUF weights as stored and dequantize them on every use (slow)")
    p.add_argument("--lane-port", type=int, default=None, metavar="PORT",
                   help="TCP port for direct lanes (stage traffic off libp2p; default: any free port)")
    p.add_argument("--no-lanes", action="store_true",
                   help="carry all stage traffic over libp2p streams (no direct lanes)")
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
    p.set_defaults(handler=_demo)


def host_config(args: argparse.Namespace, *, serving: bool) -> Any:
    """A HostConfig from ``--config``/flags (flags win); clients get a DHT-client host."""
    from ..net.config import HostConfig
    from ..net.fleet import read_fleet_secret
    from .net_cmds import default_bootstrap_addrs

    overrides = {
        "listen_addrs": tuple(args.listen) if getattr(args, "listen", None) else None,
        "announce_addrs": tuple(args.announce) if getattr(args, "announce", None) else None,
        "bootstrap_addrs": tuple(args.bootstrap) if args.bootstrap else None,
        "key_path": getattr(args, "key", None),
        "fleet_secret": read_fleet_secret(args.fleet_secret_file) if args.fleet_secret_file else None,
    }
    if getattr(args, "config", None) is not None:
        config = HostConfig.from_toml(args.config, **overrides)
    else:
        config = HostConfig().replace(**{k: v for k, v in overrides.items() if v is not None})
    if not config.bootstrap_addrs:
        config = config.replace(bootstrap_addrs=default_bootstrap_addrs())
    if not serving and not config.bootstrap_addrs:  # a serving peer may be a swarm's first; a client needs one
        from ..errors import NetworkError

        raise NetworkError("no bootstrap address: pass --bootstrap MULTIADDR (bootstrap/public.txt is empty), "
                           "or run in this process with --local")
    return config if serving else config.replace(dht_server=False)


def _quiet() -> None:
    from .net_cmds import _quiet_libp2p

    _quiet_libp2p()


async def _until_signal(signals: Any, seconds: float | None) -> None:
    """Return on SIGINT/SIGTERM (or after ``seconds``), so that every ``async with`` unwinds cleanly."""
    import trio

    with trio.move_on_after(seconds if seconds is not None else float("inf")):
        async for _ in signals:
            return


def _join(args: argparse.Namespace) -> int:
    import signal

    import torch
    import trio

    from ..errors import SangamaError
    from ..peer import Peer, PeerConfig, default_model_id

    _quiet()
    torch.set_grad_enabled(False)
    set_threads(args.threads)
    config = PeerConfig.from_toml(args.config) if args.config else PeerConfig()
    config = config.replace(host=host_config(args, serving=True))
    model = args.model or config.model_path
    if model is None:
        raise SangamaError("give the checkpoint to serve: --model DIR (or [stage] model in --config)")
    layers = args.layers or (config.layers if config.model_path is not None else "auto")
    model_id = args.model_id
    if (model_id is None and args.model is not None and config.stage is not None and config.model_path is not None
            and config.stage.model_id == default_model_id(config.model_path)):
        model_id = default_model_id(args.model)  # the id the file took from its own model follows --model
    from .hub_cmds import from_hub

    model, hub_id = from_hub(model, layers)  # hf:...: only the files (or byte ranges) of the layers served
    model_id = model_id or hub_id
    options: dict[str, Any] = {}
    if args.device is not None:
        from ..model.device import default_dtype, resolve_device

        device = resolve_device(args.device)  # before anything starts: a one-line error for cuda without CUDA
        options["device"] = str(device)
        options["dtype"] = default_dtype(device, args.dtype)
    elif args.dtype:
        options["dtype"] = args.dtype
    if args.batch_invariant:
        options["batch_invariant"] = True
    if args.dequantize_per_use:
        options["fused"] = False
    if args.lane_port is not None:
        options["lane_port"] = args.lane_port
    if args.no_lanes:
        options["lanes"] = False

    async def main() -> None:
        async with Peer(config.replace(model_path=None)) as peer:
            start, end = await peer.serve(model, layers, model_id=model_id, **options)
            server = peer.servers[-1]
            # `ready` means reachable: public, or with a relay circuit address in the published record
            reach = await peer.wait_reachable()
            # from here on a signal stops us through the normal exit path: install the handler before saying ready
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                print(f"{READY_PREFIX}{peer.peer_id} {server.config.model_id} {start}:{end}", flush=True)
                for addr in peer.addrs:
                    print(f"  listening {addr}", flush=True)
                print(f"  reachable {reach}", flush=True)
                if sys.stdout.isatty():
                    async with trio.open_nursery() as nursery:
                        nursery.start_soon(_live_panel, peer)
                        await _until_signal(signals, args.run_for)
                        nursery.cancel_scope.cancel()
                else:
                    await _until_signal(signals, args.run_for)
                print("stopping", flush=True)

    trio.run(main)
    return 0


def _panel(peer: Any) -> Any:
    from rich.table import Table

    table = Table(title=f"sangama peer {peer.peer_id[:12]}…", title_justify="left")
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
                      str(info.free_sessions), str(info.queue), f"{info.throughput_tps:.1f}", links)
    return table


async def _live_panel(peer: Any) -> None:
    import trio
    from rich.live import Live

    with Live(_panel(peer), refresh_per_second=2, transient=False) as live:
        while True:
            await trio.sleep(0.5)
            live.update(_panel(peer))


def client_peer_config(args: argparse.Namespace, model: str) -> tuple[Any, str]:
    """A client-only PeerConfig and the model id; ``model`` may be a checkpoint directory (name + tokenizer)."""
    from ..client.config import ClientConfig
    from ..peer import PeerConfig, default_model_id

    tokenizer = getattr(args, "tokenizer", None)
    model_id = model
    if model.startswith(("/", "./", "../", "~")) and not Path(model).expanduser().exists():
        from ..errors import CheckpointError  # a path that is not there, not a model id (those have no such start)

        raise CheckpointError(f"checkpoint {model} does not exist (--model takes a checkpoint directory or a model "
                              "id such as the directory's name)")
    model = str(Path(model).expanduser())
    fingerprint = None
    if Path(model).is_dir():
        model_id = default_model_id(model)
        tokenizer = tokenizer or Path(model)
        weights = ("model.safetensors", "model.safetensors.index.json")
        if (Path(model) / "config.json").is_file() and any((Path(model) / w).is_file() for w in weights):
            # a checkpoint, not just its tokenizer: chain only peers serving this very checkpoint
            from ..model.fingerprint import checkpoint_identity

            fingerprint = checkpoint_identity(model).fingerprint
    from ..net.bans import default_bans_path

    client = ClientConfig(model_id=model_id, fingerprint=fingerprint, verify=getattr(args, "verify", None),
                          bans_file=default_bans_path())
    config = PeerConfig(host=host_config(args, serving=False), client=client, tokenizer_path=tokenizer)
    return config, model_id


def _need_tokenizer(config: Any, model: str, what: str) -> None:
    """Text needs the model's tokenizer: say so before joining the swarm, in flags the user can pass."""
    from ..errors import SangamaError

    if config.tokenizer_path is None:
        raise SangamaError(f"{what} needs the model's tokenizer, and {model!r} is a model id, not a checkpoint "
                           "directory: pass --model DIR (the checkpoint) or --tokenizer DIR"
                           + (", or give token ids with --prompt-ids" if what == "a text prompt" else ""))


def generate_network(args: argparse.Namespace, prompts: list[list[int]] | None) -> int:
    """``generate`` over the swarm: ``prompts`` as ids, or None to take the text prompt through the tokenizer."""
    import trio

    from ..errors import SangamaError
    from ..net.identity import generate_key_pair
    from ..peer import Peer

    _quiet()
    if not args.model:
        raise SangamaError("give the model: --model ID (or a checkpoint directory), or run in-process with --local")
    config, model_id = client_peer_config(args, args.model)
    text = args.prompt if args.prompt is not None else args.text
    if prompts is None:
        if text is None:
            raise SangamaError("give a prompt: TEXT, --prompt TEXT or --prompt-ids 1,2,3")
        _need_tokenizer(config, args.model, "a text prompt")

    if args.batch == 1:
        return _generate_streamed(args, config, prompts[0] if prompts is not None else None, text)

    async def main() -> list[Any]:
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            todo = prompts if prompts is not None else [peer.encode(text)]
            from .model_cmds import _variant

            if args.batch > 1:  # the same prompt set as `generate --local --batch N`, so the two compare
                base = todo[0]
                todo = [base] + [_variant(base, i, _vocab_size(args.model, peer)) for i in range(1, args.batch)]
            results: list[Any] = [None] * len(todo)

            async def one(i: int, ids: list[int]) -> None:
                results[i] = await peer.generate(ids, args.max_new_tokens, guesses=args.guesses,
                                                 temperature=args.temperature, top_p=args.top_p,
                                                 seed=args.seed + i, stop_at_eos=not args.ignore_eos)

            async with trio.open_nursery() as nursery:
                for i, ids in enumerate(todo):
                    nursery.start_soon(one, i, ids)
            return results

    results = trio.run(main)
    if args.timings:  # on stderr: stdout stays the text (or the JSON)
        from .tables import print_where_time_goes

        print_where_time_goes(results[0].result.trips)
    if args.json or args.jsonl:
        dicts = [dict(g.result.as_dict(), text=g.text) for g in results]
        print(json.dumps(dicts[0] if len(dicts) == 1 else {"requests": dicts}))
        return 0
    for g in results:
        print(g.text if g.text is not None else " ".join(map(str, g.tokens)))
        _network_stats(g.result)
    return 0


def _network_stats(r: Any) -> None:
    print(f"[{len(r.tokens)} tokens, prefill {r.prefill_s * 1e3:.1f} ms, {r.decode_tokens_per_s:.1f} tokens/s "
          f"decode, {r.steps} trips, guesses accepted {r.guesses_accepted}/{r.guesses_proposed}, "
          f"route {' -> '.join(p[:8] for p in r.route)}]", file=sys.stderr)


def _generate_streamed(args: argparse.Namespace, config: Any, ids: list[int] | None, text: str | None) -> int:
    """One request over the swarm, printed token by token (``--json``: one document at the end); on a failure
    the tokens produced so far stay printed, then the error (exit code 2, from ``main``)."""
    import trio

    from ..errors import SangamaError
    from ..model.emit import TokenPrinter
    from ..net.identity import generate_key_pair
    from ..peer import Peer
    from .model_cmds import output_mode

    printer: Any = None

    async def main() -> Any:
        nonlocal printer
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            printer = TokenPrinter(peer.tokenizer, output_mode(args))
            prompt = ids if ids is not None else peer.encode(text or "")
            return await peer.generate(prompt, args.max_new_tokens, guesses=args.guesses,
                                       temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                       stop_at_eos=not args.ignore_eos, on_tokens=printer.push)

    try:
        g = trio.run(main)
    except BaseException as exc:
        from .chat_cmds import _sangama_errors

        errors = _sangama_errors(exc)
        if errors is None or printer is None:
            raise
        printer.fail(errors[0])
        raise errors[0] from exc
    printer.done(dict(g.result.as_dict(), text=g.text))
    if args.timings:
        from .tables import print_where_time_goes

        print_where_time_goes(g.result.trips)
    if printer.mode == "text":
        _network_stats(g.result)
    return 0


def _vocab_size(model: str, peer: Any) -> int:
    from ..errors import SangamaError

    if Path(model).is_dir():
        from ..model.spec import ModelSpec

        return ModelSpec.from_dir(model).vocab_size
    if peer.tokenizer is not None:
        return int(peer.tokenizer.vocab_size)
    raise SangamaError("--batch over the network needs the model's vocabulary: pass --model as a checkpoint dir")


def default_guesses(checkpoint: Path) -> int | str:
    """``auto`` for a model that drafts with an MTP layer, 0 for one without (a dense Llama refuses any guess)."""
    from ..errors import SangamaError
    from ..model.spec import ModelSpec

    try:
        spec = ModelSpec.from_dir(checkpoint)
    except SangamaError:  # a directory with only the tokenizer: ask for guesses and let the swarm say
        return "auto"
    return "auto" if spec.mtp_num_layers else 0


def _demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    _quiet()  # the demo's client sees routine churn too (dials to departed peers) that py-libp2p logs as errors
    return run_demo(args)
