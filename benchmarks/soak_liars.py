"""The liars of benchmarks/soak.py (issue 26): real stages in one process of their own, each a ``Peer`` of its own
key on loopback, that serve the soak's model over the real wire and lie the ways the trust audit found, until
``--seconds`` pass. Each liar computes for real and changes its outputs before they go on the wire
(tests/client/liars.py), announcing a high throughput so that routing picks it:

* ``constant`` (last stage): answers token 0 as every trip's new token; every ``--rekey-s`` it leaves and joins
  again under a fresh key (a Sybil: the same liar under a new identity after its bans);
* ``after_first`` (last stage): honest on a session's first step (its prefill), token 1 on every later one;
* ``noise`` (first stage): Gaussian noise of 1x their own deviation on the hidden states it forwards;
* ``framer0`` / ``framer1``: colluders that lie only beside one honest peer, to get it banned - the first stage
  beside the honest last stage ``--beside1``, the last stage (token 2) beside the honest first stage ``--beside0``;

* ``checkpoint`` (both ranges): honest stages of another checkpoint (``--other``, another seed) under the soak's
  model id; a pinned client never chains them;
* ``depth`` (last stage): a stage of the soak's checkpoint whose record and answers claim a million layers.

Each lies its own way (its own token, its own noise seed): liars that answer alike in both chains of a check
collude, which verification does not catch (docs/operations.md); a first run whose three last-stage liars all
answered token 0 measured that, not verification.

Counted per liar: ``lies`` (steps answered wrong), ``steps`` (steps served), ``incarnations`` (keys used). What a
pinned client must never do is count as ``BAD``: a step served by ``checkpoint`` or ``depth``. The counts go to
``--out`` as JSON every 5 s and at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.logs import quiet_libp2p
from sangama_p2p.peer import Peer, PeerConfig

HERE = Path(__file__).resolve().parent
LIARS = ("constant", "after_first", "noise", "framer0", "framer1", "checkpoint0", "checkpoint1", "depth")
NEVER_CHAINED = ("checkpoint0", "checkpoint1", "depth")  # a pinned client must never send these a step


def load_liars():
    """tests/client/liars.py, by path (test folders are no packages)."""
    spec = importlib.util.spec_from_file_location("sangama_liars", HERE.parent / "tests" / "client" / "liars.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def count_steps(server: Any, tally: Counter) -> None:
    """Count every step ``server`` answers (wrapping its scheduler's ``deliver``, as the liars do)."""
    real = server.scheduler.deliver

    def deliver(job: Any, out: Any) -> None:
        tally["steps"] += 1
        real(job, out)

    server.scheduler.deliver = deliver


def claim_depth(server: Any, depth: int) -> None:
    """Make ``server``'s probe answers and record claim that the model has ``depth`` layers."""
    info = server.info
    server.info = lambda: dataclasses.replace(info(), end=depth)
    current = server.announcer.current
    server.announcer.current = lambda: dataclasses.replace(current(), end=depth, num_layers=depth)


async def run_liar(name: str, args: argparse.Namespace, liars: Any, tally: Counter, told: list) -> None:
    """Serve liar ``name`` until cancelled (``constant``: a fresh key every ``--rekey-s``); ``told`` gets each
    incarnation's lie counter."""
    model = args.other if name.startswith("checkpoint") else args.model
    layers = "0:4" if name in ("noise", "framer0", "checkpoint0") else "4:8"
    while True:
        tally["incarnations"] += 1
        host = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(args.bootstrap,),
                          key_path=args.keys / f"{name}-{tally['incarnations']}.key")
        async with Peer(PeerConfig(host=host)) as peer:
            await peer.serve(model, layers, model_id=args.model_id, tokenizer=False, batch_invariant=True)
            server = peer.servers[0]
            lies: list[int] = []
            if name == "constant":
                lies = liars.lie_constant(server, 0)
            elif name == "after_first":
                lies = liars.lie_constant(server, 1, when=liars.after_first_step)
            elif name == "noise":
                lies = liars.lie_noise(server, 1.0)
            elif name == "framer0":
                lies = liars.lie_noise(server, 1.0, seed=1, when=liars.beside(args.beside1))
            elif name == "framer1":
                lies = liars.lie_constant(server, 2, when=liars.beside(args.beside0))
            elif name == "depth":
                liars._attractive(server)  # noqa: SLF001 - the liars' own boast, so routing would pick it
                claim_depth(server, 1_000_000)
                await server.announcer.publish()
            else:  # another checkpoint, honest about itself, boasting like the liars
                liars._attractive(server)  # noqa: SLF001
            count_steps(server, tally)
            told.append(lies)
            print(f"liar {name} ready: {peer.peer_id} {layers}", flush=True)
            await (trio.sleep(args.rekey_s) if name == "constant" else trio.sleep_forever())


async def main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)  # as the soak's stages (--threads 1)
    liars = load_liars()
    args.keys.mkdir(parents=True, exist_ok=True)
    tallies = {name: Counter() for name in LIARS}
    told: dict[str, list] = {name: [] for name in LIARS}
    started = time.monotonic()

    def dump(final: bool) -> None:
        classes = {}
        for name, t in tallies.items():
            row = dict(t) | {"lies": sum(map(len, told[name]))}
            if name in NEVER_CHAINED and t["steps"]:
                row["BAD steps served to a pinned client"] = t["steps"]
            classes[name] = row
        data = {"liars_s": round(time.monotonic() - started, 1), "final": final, "classes": classes}
        tmp = Path(str(args.out) + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(args.out)

    with trio.move_on_after(args.seconds):
        async with trio.open_nursery() as nursery:
            for name in LIARS:
                nursery.start_soon(run_liar, name, args, liars, tallies[name], told[name])

            async def dumper() -> None:
                while True:
                    await trio.sleep(5)
                    dump(False)

            nursery.start_soon(dumper)
    dump(True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--model", type=Path, required=True, help="the soak's checkpoint")
    p.add_argument("--other", type=Path, required=True, help="another checkpoint (served under the same model id)")
    p.add_argument("--model-id", required=True)
    p.add_argument("--beside0", required=True, help="the honest first stage the framers frame")
    p.add_argument("--beside1", required=True, help="the honest last stage the framers frame")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--rekey-s", type=float, default=120.0, help="the constant liar's life under one key")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keys", type=Path, required=True)
    quiet_libp2p()
    trio.run(main, p.parse_args())
