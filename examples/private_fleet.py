"""A private fleet on this machine: a secret, a bootstrap + relay node, three stage peers, a member and a stranger.

Every process holds the same fleet secret, so every connection is keyed by it; a node without the secret cannot
even finish a handshake. The script starts the fleet as separate ``sangama-peer`` processes (what you would run on
separate machines), generates as a member, shows that a stranger is refused, and stops everything::

    python examples/private_fleet.py --model /tmp/sangama-tiny --layers 0:3,3:6,6:8

On real machines: copy the secret file to each, run ``sangama-peer bootstrap --fleet-secret-file fleet.key`` on
one, and ``sangama-peer join --model M --layers A:B --bootstrap <its address> --fleet-secret-file fleet.key`` on
the others (see peers/datacenter/).
"""

from __future__ import annotations

import argparse
import secrets
import sys
import tempfile
from pathlib import Path

import trio

from sangama_p2p import NetworkError, Peer, PeerConfig, SangamaError
from sangama_p2p.cli.local_fleet import LocalFleet
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.fleet import read_fleet_secret
from sangama_p2p.net.identity import generate_key_pair


async def generate(bootstrap: str, model: Path, secret: bytes | None, tokens: int) -> tuple[int, ...]:
    host = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(bootstrap,), dht_server=False,
                      fleet_secret=secret, handshake_timeout=3.0)
    async with Peer(PeerConfig(host=host, tokenizer_path=model), key_pair=generate_key_pair()) as peer:
        result = await peer.generate("def hello(", tokens, model_id=model.resolve().name, stop_at_eos=False)
        return result.tokens


def main(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="sangama-fleet-") as work:  # keys, the secret and logs go with it
        return run(Path(args.model), Path(work), args)


def run(model: Path, work: Path, args: argparse.Namespace) -> int:
    secret_file = work / "fleet.key"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    secret_args = ["--fleet-secret-file", str(secret_file)]
    with LocalFleet(model, args.layers.split(","), work, join_args=secret_args, bootstrap_args=secret_args) as fleet:
        print(f"private fleet up: bootstrap {fleet.bootstrap_addr}", flush=True)
        tokens = trio.run(generate, fleet.bootstrap_addr, model, read_fleet_secret(secret_file), args.tokens)
        print(f"member generated: {' '.join(map(str, tokens))}", flush=True)
        try:
            trio.run(generate, fleet.bootstrap_addr, model, None, args.tokens)
        except NetworkError as exc:
            print(f"stranger refused: {exc}", flush=True)
        else:
            print("stranger was NOT refused", flush=True)
            return 1
    print("fleet stopped", flush=True)
    return 0


if __name__ == "__main__":
    import logging

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # routine stream resets are logged as warnings
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--layers", default="0:3,3:6,6:8", help="one stage per range (default 0:3,3:6,6:8)")
    p.add_argument("--tokens", type=int, default=16)
    try:
        raise SystemExit(main(p.parse_args()))
    except KeyboardInterrupt:  # the fleet is already stopped (LocalFleet's exit)
        raise SystemExit(130) from None
    except SangamaError as exc:  # e.g. a stage that cannot load the model: its log is in the message
        print(f"private_fleet: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
