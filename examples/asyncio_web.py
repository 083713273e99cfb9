"""An asyncio web app that embeds a Sangama peer and streams generated tokens to HTTP clients.

Standard library only (``asyncio.start_server``): ``GET /generate?prompt=TEXT&tokens=N&guesses=K`` answers with a
chunked ``text/plain`` body, one chunk per piece of text as the swarm produces it. The peer is
:class:`sangama_p2p.aio.Peer`: the trio core running as a guest of this asyncio loop, so the web server and the
peer share one thread and one loop.

Run it against a fleet that stays up, e.g. the one of ``peers/local/`` (one terminal each, or ``&``)::

    sangama-peer make-model /tmp/sangama-tiny --arch qwen3_5_moe
    sangama-peer bootstrap --config peers/local/bootstrap.toml    # prints ADDR: /ip4/127.0.0.1/tcp/4001/p2p/...
    sangama-peer join --config peers/local/stage1.toml --bootstrap ADDR   # and stage2.toml, stage3.toml
    python examples/asyncio_web.py --model /tmp/sangama-tiny --bootstrap ADDR
    curl -N 'http://127.0.0.1:8080/generate?prompt=def%20hello(&tokens=32'

(``sangama-peer demo`` and ``examples/private_fleet.py`` stop their fleets when they finish.) A private fleet adds
``--fleet-secret-file FILE``. Ctrl-C stops the server (exit code 130).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from sangama_p2p.aio import Peer
from sangama_p2p.client.config import ClientConfig
from sangama_p2p.errors import ModelError, SangamaError
from sangama_p2p.guesses import parse_guesses
from sangama_p2p.model.tokenizer import IncrementalDecoder
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.fleet import read_fleet_secret
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.peer import PeerConfig, default_model_id

MAX_TOKENS = 512


async def _respond(writer: asyncio.StreamWriter, status: str, body: str) -> None:
    data = body.encode()
    writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; charset=utf-8\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()


async def _chunk(writer: asyncio.StreamWriter, text: str) -> None:
    data = text.encode()
    writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    await writer.drain()


def make_handler(peer: Peer):
    """The connection handler: one request per connection, the answer streamed as it is generated."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout=10)
            method, target, _ = request.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            url = urlsplit(target)
            if method != "GET" or url.path != "/generate":
                await _respond(writer, "404 Not Found", "try GET /generate?prompt=...&tokens=N\n")
                return
            query = parse_qs(url.query)
            prompt = query.get("prompt", [""])[0]
            try:
                tokens = int(query.get("tokens", ["32"])[0])
                guesses = query.get("guesses", ["auto"])[0]
                parse_guesses(guesses)
                guesses = guesses if guesses == "auto" else int(guesses)
            except (ValueError, ModelError):
                tokens = 0
            if not 1 <= tokens <= MAX_TOKENS:  # also an unreadable tokens or guesses: say what is accepted
                await _respond(writer, "400 Bad Request",
                               f"tokens must be an integer in 1..{MAX_TOKENS}, guesses 0..8 or auto\n")
                return
            if not prompt:
                await _respond(writer, "400 Bad Request", "give a prompt: /generate?prompt=...\n")
                return
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\n"
                         b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")
            decoder = IncrementalDecoder(peer.tokenizer)  # the tokenizer of --model
            async for token_id in peer.stream(prompt, tokens, guesses=guesses):
                piece = decoder.push([token_id])
                if piece:
                    await _chunk(writer, piece)
            rest = decoder.flush()
            if rest:
                await _chunk(writer, rest)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError, ValueError):
            pass  # the client went away or spoke something else
        except Exception as exc:  # a failed generation ends this response (as its last chunk), never the server
            await _chunk(writer, f"\n[error: {exc}]\n")
            writer.write(b"0\r\n\r\n")
        finally:
            writer.close()

    return handle


async def main(args: argparse.Namespace) -> None:
    model = Path(args.model)
    config = PeerConfig(
        host=HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=tuple(args.bootstrap),
                        dht_server=False,
                        fleet_secret=read_fleet_secret(args.fleet_secret_file) if args.fleet_secret_file else None),
        client=ClientConfig(model_id=default_model_id(model)),
        tokenizer_path=model,
    )
    async with Peer(config, key_pair=generate_key_pair()) as peer:  # a throwaway identity: we only ask
        server = await asyncio.start_server(make_handler(peer), args.host, args.port)
        port = server.sockets[0].getsockname()[1]
        print(f"listening on http://{args.host}:{port}/generate (peer {peer.peer_id})", flush=True)
        async with server:
            await server.serve_forever()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="checkpoint directory (its name is the model id; its tokenizer)")
    p.add_argument("--bootstrap", action="append", required=True, help="bootstrap multiaddr (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="0 = any free port")
    p.add_argument("--fleet-secret-file", type=Path, default=None, help="the private fleet's secret, if any")
    return p.parse_args(argv)


if __name__ == "__main__":
    import logging

    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # routine stream resets are logged as warnings
    try:
        asyncio.run(main(parse_args()))
    except KeyboardInterrupt:
        sys.exit(130)
    except SangamaError as exc:  # e.g. the bootstrap node cannot be reached: one line, not a traceback
        print(f"asyncio_web: error: {exc}", file=sys.stderr)
        sys.exit(2)
