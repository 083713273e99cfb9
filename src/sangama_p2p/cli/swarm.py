"""How a command reaches the swarm: the host flags every networked command shares, the bootstrap list shipped in
``bootstrap/public.txt``, a client peer's config from ``--model ID|DIR|FILE.gguf``, and where its tokenizer comes
from.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import CheckpointError, NetworkError, SangamaError
from ..model.spec import ModelSpec
from .argtypes import fraction
from .hub_cmds import from_hub

if TYPE_CHECKING:
    from ..net.config import HostConfig
    from ..config import PeerConfig

# Imports of the host, peer and client modules stay inside the functions below: each pulls in libp2p (0.8-1.4 s) or
# torch (1.4-2.6 s), and every command module imports this one to build the parser (cli/main.py).

__all__ = ["BOOTSTRAP_DIR", "add_host_args", "add_verify_arg", "check_bootstrap_dialable", "client_model",
           "client_peer_config", "default_bootstrap_addrs", "default_guesses", "host_config", "is_tcp",
           "need_tokenizer", "tokenizer_source"]

BOOTSTRAP_DIR = Path(__file__).resolve().parents[3] / "bootstrap"

log = logging.getLogger(__name__)


def default_bootstrap_addrs() -> tuple[str, ...]:
    """The public bootstrap list shipped in ``bootstrap/public.txt`` (one multiaddr a line, ``#`` comments)."""
    path = BOOTSTRAP_DIR / "public.txt"
    if not path.exists():
        return ()
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return tuple(line for line in lines if line)


def is_tcp(addr: str) -> bool:
    """Whether a multiaddr is plain TCP (``/ip4|ip6|dns*/<host>/tcp/<port>[/p2p/<id>]``), what every peer dials."""
    parts = str(addr).strip("/").split("/")
    return len(parts) >= 4 and parts[2] == "tcp" and (len(parts) == 4 or parts[4] == "p2p")


def check_bootstrap_dialable(bootstrap: tuple[str, ...], listen: tuple[str, ...]) -> None:
    """Refuse a bootstrap address this peer cannot dial: its host has the transports of its own listen addresses
    (TCP by default), so a QUIC bootstrap address fails after the dial timeout with "No registered transport"."""
    quic_here = any("/quic" in a for a in listen)
    bad = [a for a in bootstrap if not is_tcp(a) and not (quic_here and "/quic" in a)]
    if bad and len(bad) == len(bootstrap):
        raise NetworkError(f"cannot dial the bootstrap address {', '.join(bad)}: peers dial over TCP (this one "
                           f"listens on {', '.join(listen)}); give the bootstrap node's /ip4/<ip>/tcp/<port>/p2p/<id> "
                           "address (it prints one at start)")
    if bad:
        log.warning("skipping bootstrap addresses this peer cannot dial (peers dial over TCP): %s", ", ".join(bad))


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
    p.add_argument("--verify", type=fraction, default=None, metavar="FRACTION",
                   help="re-run this fraction of trips on a second chain of other peers and ban a peer caught lying "
                   "(default: 0.05 in a public swarm, 0 with --fleet-secret-file); bans: ~/.sangama/bans.json")
    p.add_argument("--ring", action=argparse.BooleanOptionalAction, default=None,
                   help="the last stage hands each next trip on to the first stage itself, and this client only "
                   "checks the answers (default: on; --no-ring: every trip goes through this client)")
    p.add_argument("--windows", type=int, default=1, choices=range(1, 5), metavar="N",
                   help="with the ring (implied), greedy and a fixed --guesses: up to N guess windows in flight at "
                   "once (default 1)")


def host_config(args: argparse.Namespace, *, serving: bool) -> HostConfig:
    """A HostConfig from ``--config``/flags (flags win); clients get a DHT-client host."""
    from ..net.config import HostConfig
    from ..net.fleet import read_fleet_secret

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
    check_bootstrap_dialable(config.bootstrap_addrs, config.listen_addrs)
    if not serving and not config.bootstrap_addrs:  # a serving peer may be a swarm's first; a client needs one
        raise NetworkError("no bootstrap address: pass --bootstrap MULTIADDR (bootstrap/public.txt is empty), "
                           "or run in this process with --local")
    return config if serving else config.replace(dht_server=False)


def client_peer_config(args: argparse.Namespace, model: str) -> tuple[PeerConfig, str]:
    """A client-only PeerConfig and the model id; ``model`` may be a checkpoint directory or a ``.gguf`` file (its
    name is the id, its tokenizer encodes the prompt, and only peers of that very checkpoint are chained, at its
    depth: :mod:`.pin`). In a public swarm an unpinned model id is refused."""
    from ..client.config import ClientConfig
    from ..config import PeerConfig, default_model_id
    from ..net.bans import default_bans_path
    from .pin import local_pin, merge_pins, require_pin

    tokenizer = getattr(args, "tokenizer", None)
    model_id = model
    if model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf"):
        if not Path(model).expanduser().exists():  # a path that is not there, not a model id (no such start or end)
            raise CheckpointError(f"checkpoint {model} does not exist (--model takes a checkpoint directory, a "
                                  ".gguf file or a model id such as the directory's name)")
    model = str(Path(model).expanduser())
    if Path(model).is_dir() or Path(model).suffix == ".gguf" and Path(model).is_file():
        model_id = default_model_id(model)  # the file holds its tokenizer (a GGUF) or is the tokenizer's directory
        tokenizer = tokenizer or Path(model)
    mine = local_pin(Path(model), Path(tokenizer).expanduser() if tokenizer else None)
    # a pin from the tokenizer's source alone gives way to --fingerprint (a tokenizer borrowed from a base model)
    chosen = merge_pins(mine, getattr(args, "fingerprint", None), strict=mine.source == model)
    host = host_config(args, serving=False)
    require_pin(chosen, model_id, private=host.fleet_secret is not None)
    client = ClientConfig(model_id=model_id, fingerprint=chosen.fingerprint, num_layers=chosen.num_layers,
                          verify=getattr(args, "verify", None), bans_file=default_bans_path(),
                          ring=getattr(args, "ring", None) is not False, windows=getattr(args, "windows", 1))
    config = PeerConfig(host=host, client=client, tokenizer_path=tokenizer)
    return config, model_id


def need_tokenizer(config: PeerConfig, model: str, what: str) -> None:
    """Text needs the model's tokenizer: say so before joining the swarm, in flags the user can pass."""
    if config.tokenizer_path is None:
        raise SangamaError(f"{what} needs the model's tokenizer, and {model!r} is a model id, not a checkpoint: "
                           "pass --model DIR|FILE.gguf (the checkpoint) or --tokenizer DIR"
                           + (", or give token ids with --prompt-ids" if what == "a text prompt" else ""))


def tokenizer_source(args: argparse.Namespace, config: PeerConfig, model_id: str,
                     command: str) -> tuple[PeerConfig, str, Path]:
    """(config, model id, where the tokenizer comes from) for a client command given ``--model ID|DIR|FILE.gguf``
    and ``--tokenizer`` (:func:`client_peer_config` named a GGUF file's model by its stem); a bare id needs
    ``--tokenizer``."""
    given = Path(args.model).expanduser()
    source = args.tokenizer or (given if given.is_dir() or given.suffix == ".gguf" and given.is_file() else None)
    if source is None:
        raise SangamaError(f"{command} needs the model's tokenizer, and {args.model!r} is a model id, not a "
                           "checkpoint: pass --model DIR|FILE.gguf (the checkpoint) or --tokenizer DIR")
    return config, model_id, source


def default_guesses(checkpoint: Path) -> int | str:
    """``auto`` for a model that drafts with an MTP layer, 0 for one without (a dense Llama refuses any guess)."""
    try:
        spec = ModelSpec.from_dir(checkpoint)
    except SangamaError:  # a directory with only the tokenizer: ask for guesses and let the swarm say
        return "auto"
    return "auto" if spec.mtp_num_layers else 0


def client_model(args: argparse.Namespace, command: str) -> tuple[PeerConfig, str, Path]:
    """(client config, model id, tokenizer source) for a client command's ``--model``, ``hf:ORG/REPO[...]`` included
    (only its tokenizer, template and config are fetched: the stages hold the weights)."""
    hub_path, hub_id = from_hub(args.model, metadata_only=True)
    if hub_id is not None:
        args.model = str(hub_path)
    # a Hub checkpoint's metadata copy holds the fingerprint's sample windows of every tensor (resolve_model): pinned
    config, model_id = client_peer_config(args, args.model)
    if hub_id is not None:
        model_id = hub_id
        config = config.replace(client=config.client.replace(model_id=hub_id))
    return tokenizer_source(args, config, model_id, command)
