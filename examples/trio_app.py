"""A trio program that is a whole swarm: two serving peers and a client, all embedded ``sangama_p2p.Peer`` objects.

The first peer serves the first half of the model and is everyone's bootstrap node; the second serves the rest;
a third, client-only peer finds them in the DHT and generates, streaming tokens as each trip returns. Works with
any checkpoint, e.g. the tiny one::

    sangama-peer make-model /tmp/sangama-tiny --arch qwen3_5_moe
    python examples/trio_app.py --model /tmp/sangama-tiny --prompt "def hello(" --tokens 24
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import trio

from sangama_p2p import Peer, PeerConfig, SangamaError
from sangama_p2p.model.spec import ModelSpec
from sangama_p2p.net.config import HostConfig

LOOPBACK = ("/ip4/127.0.0.1/tcp/0",)


async def main(args: argparse.Namespace) -> None:
    spec = ModelSpec.from_dir(args.model)
    num_layers = spec.num_layers
    half = num_layers // 2
    guesses = "auto" if spec.mtp_num_layers else 0  # guesses are drafted by the MTP layer; a dense Llama has none
    with tempfile.TemporaryDirectory(prefix="sangama-keys-") as tmp:  # each peer needs its own identity
        await run(args, Path(tmp), num_layers, half, guesses)


async def run(args: argparse.Namespace, keys: Path, num_layers: int, half: int, guesses: int | str) -> None:
    async with Peer(PeerConfig(host=HostConfig(listen_addrs=LOOPBACK, key_path=keys / "a"))) as first:
        await first.serve(args.model, (0, half))
        boot = HostConfig(listen_addrs=LOOPBACK, bootstrap_addrs=(first.addrs[0],), key_path=keys / "b")
        async with Peer(PeerConfig(host=boot)) as second:
            await second.serve(args.model, f"auto:{num_layers - half}")  # what the swarm lacks: the rest
            print(f"serving: {first.peer_id[:12]}… layers 0:{half}, {second.peer_id[:12]}… the rest", flush=True)
            client_host = boot.replace(key_path=keys / "c", dht_server=False)
            async with Peer(PeerConfig(host=client_host, tokenizer_path=Path(args.model))) as client:
                model_id = first.servers[0].config.model_id
                print("streamed ids:", end=" ", flush=True)
                async for token_id in client.stream(args.prompt, args.tokens, model_id=model_id, stop_at_eos=False):
                    print(token_id, end=" ", flush=True)
                print(flush=True)
                result = await client.generate(args.prompt, args.tokens, model_id=model_id, guesses=guesses,
                                               stop_at_eos=False)
                print(f"tokens: {' '.join(map(str, result.tokens))}", flush=True)
                print(f"text: {result.text!r}", flush=True)
                print(f"{result.result.decode_tokens_per_s:.1f} tokens/s with guesses={guesses}, "
                      f"{result.result.steps} trips", flush=True)


if __name__ == "__main__":
    import logging

    import torch

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # routine stream resets are logged as warnings
    torch.set_num_threads(1)  # three stages in one process: one torch thread each beats oversubscribed cores
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--prompt", default="def hello(")
    p.add_argument("--tokens", type=int, default=24)
    try:
        trio.run(main, p.parse_args())
    except KeyboardInterrupt:
        sys.exit(130)
    except SangamaError as exc:  # e.g. not a checkpoint directory: one line, not a traceback
        print(f"trio_app: error: {exc}", file=sys.stderr)
        sys.exit(2)
