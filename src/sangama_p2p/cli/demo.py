"""``sangama-peer demo``: a whole fleet on loopback, measured, then stopped.

It makes the tiny Qwen3.5-MoE model, starts a bootstrap node and three stage peers (layers 0:3, 3:6, 6:8) as
separate ``sangama-peer`` processes (:class:`.local_fleet.LocalFleet`), then drives generations from this process
through a client :class:`~sangama_p2p.peer.Peer`: one request at each guess count, many requests at once, and the
per-trip breakdown. Every network result is checked against the same model run in this one process
(``LocalChain``): greedy tokens must be identical. The fleet stops on every exit path (normal, error, Ctrl-C,
SIGTERM), and its children die with us even on ``kill -9`` (see ``local_fleet``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import ModelError, SangamaError
from ..guesses import MAX_GUESSES
from ..model.spec import LayerRange
from .generate_cmds import prompt_variants
from .local_fleet import LocalFleet
from .process import show_progress
from .tables import guesses_table, print_tables, requests_table, where_time_goes_table
from .threads import available_cores

# torch (1.4-2.6 s to import), trio and libp2p (0.8-1.4 s) and the modules that import them (model, peer, client,
# net) are imported in the functions: cli/main.py imports every command module to build its parser.

__all__ = ["DEMO_SPLIT", "demo_split", "local_references", "measure_network", "run_demo"]

DEMO_SPLIT = ("0:3", "3:6", "6:8")
DEMO_PROMPT = "def fibonacci(n):"
TINY_LABEL = "qwen3_5_moe/tiny"  # the made model's name in the results


def _int_list(text: str, flag: str, low: int, high: int | None = None) -> list[int]:
    """``--guesses``/``--requests``: comma-separated integers in ``low..high``, checked before anything starts."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError as exc:
        raise SangamaError(f"{flag} expects comma-separated integers, got {text!r}") from exc
    bounds = f"{low}..{high}" if high is not None else f">= {low}"
    if not values or any(v < low or (high is not None and v > high) for v in values):
        raise SangamaError(f"{flag} expects comma-separated integers {bounds}, got {text!r}")
    return values


def demo_split(num_layers: int) -> tuple[str, ...]:
    """Three contiguous stages over ``num_layers`` layers, the earlier ones one layer longer where it does not divide
    (8 layers: 0:3, 3:6, 6:8, the tiny model's :data:`DEMO_SPLIT`)."""
    if num_layers < 3:
        raise ModelError(f"the demo runs three stages and needs a model of at least 3 layers; this one has "
                         f"{num_layers}")
    q, r = divmod(num_layers, 3)
    bounds = [0]
    for i in range(3):
        bounds.append(bounds[-1] + q + (i < r))
    return tuple(f"{a}:{b}" for a, b in zip(bounds, bounds[1:]))


def _own_model_split(path: Path, guesses: list[int]) -> tuple[str, ...]:
    """Check a ``--model`` checkpoint before any process starts (it opens, has 3+ layers, drafts if asked to) and
    split it into the demo's three stages."""
    from ..model.checkpoint import open_checkpoint

    spec = open_checkpoint(path).spec
    if any(guesses) and spec.mtp_num_layers == 0:
        raise ModelError(f"{path} has no MTP layer to draft guesses with: run the demo with --guesses 0")
    return demo_split(spec.num_layers)


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the fleet's __exit__ stops the children


def run_demo(args: argparse.Namespace) -> int:
    guesses = _int_list(args.guesses, "--guesses", 0, MAX_GUESSES)
    requests = _int_list(args.requests, "--requests", 1)
    if args.device:
        from ..model.device import resolve_device

        resolve_device(args.device)  # here, before the fleet starts, not in three stage logs

    import torch

    from ..model.make import make_model

    torch.set_grad_enabled(False)
    own_dir = args.workdir is None
    workdir = Path(tempfile.mkdtemp(prefix="sangama-demo-")) if own_dir else Path(args.workdir)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.model is not None:
            model_dir, label = args.model.resolve(), args.model.name
            split = _own_model_split(model_dir, guesses)
            print(f"using the model in {model_dir}", flush=True)
        else:
            print(f"making the tiny qwen3_5_moe model in {workdir} ...", flush=True)
            model_dir = make_model(workdir / "sangama-tiny", "qwen3_5_moe", "tiny")
            split, label = DEMO_SPLIT, TINY_LABEL
        torch.set_num_threads(1)  # this process only drives the client once the fleet runs
        refs = local_references(model_dir, guesses=guesses, requests=requests, new_tokens=args.tokens)
        print("one-process reference runs done", flush=True)
        t0 = time.monotonic()
        threads = getattr(args, "threads", None) or max(1, available_cores() // len(split))  # stages share the cores
        placement = (["--device", args.device] if args.device else []) + (["--dtype", args.dtype] if args.dtype else [])
        join_args = ["--threads", str(threads), *placement]
        on_ready = _fleet_progress(len(split)) if show_progress(args.progress) else None
        with LocalFleet(model_dir, split, workdir / "fleet", join_args=join_args, on_ready=on_ready) as fleet:
            print(f"fleet up in {time.monotonic() - t0:.1f} s: bootstrap + stages {', '.join(split)} "
                  f"(pids {', '.join(map(str, fleet.pids()))})", flush=True)
            results = measure_network(model_dir, fleet.bootstrap_addr, refs, guesses=guesses, requests=requests,
                                      new_tokens=args.tokens, split=split, label=label)
        print_tables(
            guesses_table(results["guesses"]),
            requests_table(results["requests"]),
            where_time_goes_table(results["where_the_time_goes"]),
        )
        if args.json is not None:
            args.json.write_text(json.dumps(results, indent=2))
        ok = all(r["same_tokens"] for r in results["guesses"] + results["requests"])
        print("tokens over the network equal the one-process run: " + ("yes" if ok else "NO"), flush=True)
        print("fleet stopped; demo done", flush=True)
        return 0 if ok else 1
    finally:
        signal.signal(signal.SIGTERM, previous)
        if own_dir:
            shutil.rmtree(workdir, ignore_errors=True)


def _fleet_progress(stages: int) -> Callable[[str, float], None]:
    """The fleet coming up, on stderr: a line as the bootstrap node and then each stage is ready."""
    print(f"starting a bootstrap node and {stages} stage processes ...", file=sys.stderr, flush=True)
    seen = [0]

    def on_ready(what: str, seconds: float) -> None:
        seen[0] += 1
        print(f"  [{seen[0]}/{stages + 1}] {what} ready after {seconds:.1f} s", file=sys.stderr, flush=True)

    return on_ready


def _progress(text: str) -> None:
    print(f"  {text}", flush=True)


def local_references(model_dir: Path, *, guesses: list[int | str], requests: list[int], new_tokens: int) -> dict:
    """The one-process runs every network result is checked against (and the one-process tokens/s).

    Run before the fleet starts, so the one-process numbers are not measured on cores the stages are using.
    """
    from ..model.chain import LocalChain
    from ..model.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    local = LocalChain.load(ckpt, [LayerRange(0, ckpt.spec.num_layers)])
    prompt = ckpt.tokenizer.encode(DEMO_PROMPT)
    local.generate(prompt, 4)  # warm up
    by_guesses = {}
    for g in guesses:
        r = local.generate(prompt, new_tokens, guesses=g, stop_at_eos=False)
        by_guesses[g] = {"tokens": r.tokens, "tokens_per_s": r.decode_tokens_per_s}
    prompts = prompt_variants(prompt, max(requests, default=1), ckpt.spec.vocab_size)
    solo = [local.generate(p, new_tokens, stop_at_eos=False).tokens for p in prompts]
    return {"prompt": prompt, "guesses": by_guesses, "prompts": prompts, "solo": solo}


def measure_network(
    model_dir: Path,
    bootstrap_addr: str,
    refs: dict,
    *,
    guesses: list[int | str],
    requests: list[int],
    new_tokens: int,
    split: tuple[str, ...] = DEMO_SPLIT,
    label: str = TINY_LABEL,
) -> dict[str, Any]:
    """Run the demo's measurements against a running fleet; every result carries its check against ``refs``."""
    import trio

    from ..client.config import ClientConfig
    from ..client.timing import summarize_trips
    from ..net.config import HostConfig
    from ..net.identity import generate_key_pair
    from ..config import PeerConfig, default_model_id
    from ..peer import Peer

    prompt = refs["prompt"]
    config = PeerConfig(
        host=HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(bootstrap_addr,), dht_server=False),
        client=ClientConfig(model_id=default_model_id(model_dir)),
        tokenizer_path=Path(model_dir),
    )
    out: dict[str, Any] = {"model": label, "split": list(split), "new_tokens": new_tokens,
                           "guesses": [], "requests": []}

    interrupted: list[int] = []

    async def main() -> None:
        # Ctrl-C (or SIGTERM) cancels the run and is raised once everything has unwound: trio raising it inside
        # whatever task runs could land in py-libp2p's service manager mid-exit and leave a corrupted nursery stack
        # (a RuntimeError and exit 1 instead of 130, seen once in the suite)
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                async def watch() -> None:
                    async for signum in signals:
                        interrupted.append(int(signum))
                        nursery.cancel_scope.cancel()

                nursery.start_soon(watch)
                await run()
                nursery.cancel_scope.cancel()

    async def run() -> None:
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            t = time.perf_counter()
            await peer.generate(prompt, 4)  # warm up: route, sessions, streams, first-call costs
            _progress(f"first generation (discovery, route, sessions) {time.perf_counter() - t:.1f} s")
            for g in guesses:
                net = await peer.generate(prompt, new_tokens, guesses=g, stop_at_eos=False)
                ref = refs["guesses"][g]
                r = net.result
                out["guesses"].append({
                    "guesses": g,
                    "tokens_per_s": round(r.decode_tokens_per_s, 2),
                    "tokens_per_trip": round((len(r.tokens) - 1) / max(r.steps, 1), 3),
                    "accepted_per_trip": round(r.guesses_accepted / max(r.steps, 1), 3),
                    "local_tokens_per_s": round(ref["tokens_per_s"], 2),
                    "same_tokens": list(net.tokens) == ref["tokens"],
                    "ttft_ms": round(r.prefill_s * 1e3, 2),
                })
                if g == 0:
                    out["where_the_time_goes"] = summarize_trips(r.trips)
                _progress(f"one request, {g} guesses: {r.decode_tokens_per_s:.1f} tokens/s")
            for n in requests:
                prompts = refs["prompts"][:n]
                gens: list[Any] = [None] * n

                async def one(i: int) -> None:
                    gens[i] = await peer.generate(prompts[i], new_tokens, stop_at_eos=False)

                t = time.perf_counter()
                async with trio.open_nursery() as nursery:
                    for i in range(n):
                        nursery.start_soon(one, i)
                wall = time.perf_counter() - t
                batches = [s.batch_size for g in gens for trip in g.result.trips[1:] for s in trip.stages]
                out["requests"].append({
                    "requests": n,
                    "aggregate_tokens_per_s": round(sum(len(g.tokens) for g in gens) / wall, 2),
                    "per_request_tokens_per_s": round(sum(g.result.decode_tokens_per_s for g in gens) / n, 2),
                    "mean_batch": round(sum(batches) / max(len(batches), 1), 2),
                    "same_tokens": all(list(g.tokens) == s for g, s in zip(gens, refs["solo"])),
                })
                _progress(f"{n} requests at once: {wall:.1f} s")

    trio.run(main)
    if interrupted:
        raise KeyboardInterrupt
    if "where_the_time_goes" not in out:
        out["where_the_time_goes"] = {"trips": 0, "trip_ms": 0.0, "network_ms": 0.0, "stages": []}
    return out
