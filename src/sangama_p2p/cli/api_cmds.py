"""``sangama-peer api``: an OpenAI-compatible HTTP API over the swarm (:mod:`sangama_p2p.api`).

Prints ``api listening http://HOST:PORT`` once the server accepts requests; SIGINT/SIGTERM stop it.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
from pathlib import Path
from typing import Any

from .argtypes import guesses, non_negative_int, positive_int
from .pin import add_fingerprint_arg
from .process import quiet_libp2p, until_signal
from .swarm import add_host_args, add_verify_arg, client_model

# the API server, trio and the peer (3-4 s to import: torch and libp2p) are imported in the handler: cli/main.py
# imports every command module to build its parser (`sangama-peer --help` takes 0.1 s).

READY = "api listening "


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("api", help="serve an OpenAI-compatible HTTP API over the swarm",
                       description="Serve /v1/models, /v1/completions and /v1/chat/completions (streamed with "
                       "server-sent events) for a model served by the swarm; prompts are tokenized and chats "
                       "formatted with the checkpoint's own tokenizer and chat template.")
    p.add_argument("--model", required=True, metavar="ID|DIR|FILE.gguf|hf:ORG/REPO",
                   help="checkpoint directory or .gguf file (its name is the model id), hf:ORG/REPO[@REV][:FILE.gguf] "
                   "(only its tokenizer, template and config are fetched), or a model id with --tokenizer")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR|FILE.gguf",
                   help="checkpoint directory or .gguf file with the tokenizer and chat template (for --model ID)")
    p.add_argument("--config", type=Path, default=None, help="peer config TOML ([host], [client], [api])")
    add_host_args(p, listen=False)
    add_verify_arg(p)
    add_fingerprint_arg(p)
    p.add_argument("--host", default=None, help="address to listen on (default 127.0.0.1; elsewhere without "
                   "--api-key-file, a warning)")
    p.add_argument("--port", type=int, default=None, help="port to listen on (default 8000; 0 = any free port)")
    p.add_argument("--api-key-file", type=Path, default=None, metavar="FILE",
                   help="file holding the key clients must send as 'Authorization: Bearer KEY' (default: none)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help="new tokens when a request gives no max_tokens (default 256)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=None,
                   help="the most new tokens a request may ask for (default 4096; more: 400)")
    p.add_argument("--max-body-bytes", type=positive_int, default=None,
                   help="largest request body, read in chunks and refused with 413 past it (default 4194304)")
    p.add_argument("--max-prompt-chars", type=non_negative_int, default=None,
                   help="longest prompt text, checked before tokenizing (default 0: 16 per position of the "
                   "model's context)")
    p.add_argument("--max-requests-per-client", type=non_negative_int, default=None,
                   help="requests one client address runs at once, beyond them 429 (default 4; 0: no limit): "
                   "the API is one peer to the stages, which give one peer a share of their sessions")
    p.add_argument("--allow-host", action="append", default=None, metavar="NAME",
                   help="a Host name to accept besides loopback's (repeatable; '*': any)")
    p.add_argument("--allow-origin", action="append", default=None, metavar="ORIGIN",
                   help="a browser origin allowed to call the API, e.g. http://app.example:3000 (repeatable; "
                   "'*': any); default: the API's own only")
    p.add_argument("--guesses", type=guesses, default=None, metavar="K|auto",
                   help="MTP guesses per trip unless a request sets 'guesses' (default auto)")
    p.add_argument("--dashboard", action="store_true", default=None,
                   help="serve the swarm's live page at /dashboard/ (as `sangama-peer dashboard` does; no key needed)")
    p.set_defaults(handler=_api)


def _api(args: argparse.Namespace) -> int:
    import trio

    from ..api.config import ApiConfig
    from ..api.guard import check_port
    from ..api.server import served_model
    from ..config import PeerConfig
    from ..net.identity import generate_key_pair
    from ..peer import Peer

    quiet_libp2p()
    file_config = PeerConfig.from_toml(args.config) if args.config else PeerConfig()
    api = file_config.api or ApiConfig()
    flags: dict[str, Any] = {"host": args.host, "port": args.port, "api_key_file": args.api_key_file,
                             "max_tokens": args.max_tokens, "guesses": args.guesses,
                             "max_tokens_cap": args.max_tokens_cap, "max_body_bytes": args.max_body_bytes,
                             "max_prompt_chars": args.max_prompt_chars,
                             "max_requests_per_client": args.max_requests_per_client,
                             "allowed_hosts": args.allow_host and tuple(args.allow_host),
                             "allowed_origins": args.allow_origin and tuple(args.allow_origin),
                             "dashboard": args.dashboard}
    api = api.replace(**{k: v for k, v in flags.items() if v is not None})
    api.api_key()  # a missing or empty key file fails here, before joining the swarm
    check_port(api.host, api.port)  # and a port in use
    config, model_id, source = client_model(args, "api")
    if file_config.client is not None:
        config = config.replace(client=file_config.client.replace(model_id=model_id))
    config = dataclasses.replace(config, tokenizer_path=None)
    served = served_model(source, model_id)

    async def main() -> None:
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                url = await peer.serve_api(served=served, config=api)
                print(f"{READY}{url} (model {model_id})", flush=True)
                await until_signal(signals, None)
                print("stopping", flush=True)

    trio.run(main)
    return 0
