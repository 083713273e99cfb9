"""``sangama-peer chat``: a conversation with a model served by the swarm, in the checkpoint's own chat template.

Each line read from stdin is a user message; the conversation so far (``--system`` first) is rendered with the
model's template (:mod:`sangama_p2p.model.chat`), sent through the swarm, and the answer streams back until one of
the template's stop tokens. ``/reset`` starts over. When the conversation outgrows ``--context`` tokens, the oldest
turns are dropped (said once). An error from the swarm is printed and the prompt comes back: the conversation goes
on. The tokenizer and the template come from ``--model`` (a checkpoint directory or ``.gguf`` file) or
``--tokenizer``; they are read before the peer joins the swarm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import SangamaError
from ..guesses import MAX_GUESSES
from ..positions import session_length
from ..model.chat import ChatPrompt, ChatTemplate, trim_to_fit
from ..model.chat_model import open_chat_model
from ..model.tokenizer import IncrementalDecoder, Tokenizer
from .argtypes import guesses, non_negative_int, positive_int
from .pin import add_fingerprint_arg
from .process import quiet_libp2p, sangama_errors
from .swarm import add_host_args, add_verify_arg, client_model, default_guesses
from .tables import print_where_time_goes

if TYPE_CHECKING:
    from ..peer import Peer

# trio (0.07-0.2 s to import) and the peer (3-4 s: torch and libp2p) are imported in the handler: cli/main.py imports
# every command module to build its parser (`sangama-peer --help` takes 0.1 s).

DEFAULT_CONTEXT = 8192  # a stage's default max_session_length (StageConfig), when the checkpoint does not say
RESET = "/reset"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a model served by the swarm",
                       description="Read user messages from stdin (one per line; /reset starts over) and stream "
                       "each answer as the swarm generates it, in the checkpoint's own chat template.")
    p.add_argument("--model", required=True, metavar="ID|DIR|FILE.gguf|hf:ORG/REPO",
                   help="model id, or a checkpoint directory, .gguf file or hf:ORG/REPO[@REV][:FILE.gguf] (its name is "
                   "the id; its tokenizer and chat template format the conversation; from the Hub only those are "
                   "fetched)")
    p.add_argument("--tokenizer", type=Path, default=None, metavar="DIR|FILE.gguf",
                   help="checkpoint directory or .gguf file with the tokenizer and chat template")
    p.add_argument("--system", default=None, metavar="TEXT", help="system message that opens the conversation")
    p.add_argument("--context", type=positive_int, default=None, metavar="N",
                   help="tokens a turn may use, prompt + answer (default: the model's context length, at most "
                   f"{DEFAULT_CONTEXT}); older turns are dropped to fit")
    add_host_args(p, listen=False)
    add_verify_arg(p)
    add_fingerprint_arg(p)
    p.add_argument("--max-new-tokens", type=non_negative_int, default=128,
                   help="new tokens per answer at most (default %(default)s)")
    p.add_argument("--guesses", type=guesses, default=None, metavar="K|auto",
                   help="MTP guesses per trip (default: auto when the checkpoint has an MTP layer, else 0)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="sampling seed of the first answer, the next ones +1 each (default %(default)s)")
    p.add_argument("--json", action="store_true", help="one JSON object per answer instead of streamed text")
    p.add_argument("--timings", action="store_true", help="print where the time goes after each answer (stderr)")
    p.set_defaults(handler=_chat)


@dataclass
class Conversation:
    """The messages so far, and the rendering of the next prompt within a token budget (no I/O)."""

    template: ChatTemplate
    tokenizer: Tokenizer
    system: str | None
    budget: int  # ids the prompt may have: the context minus the answer's reserve
    messages: list[dict[str, str]] = field(default_factory=list)
    trimmed: int = 0  # messages dropped so far, to say it once

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.messages = [{"role": "system", "content": self.system}] if self.system is not None else []

    def ask(self, text: str) -> tuple[ChatPrompt, int]:
        """The prompt for a new user message (added to the history); ``(ChatPrompt, messages dropped to fit)``.

        On an error (the template fails, or the message alone does not fit) the history is as before.
        """
        self.messages.append({"role": "user", "content": text})
        try:
            prompt, dropped = trim_to_fit(self.template, self.tokenizer, self.messages, self.budget)
        except BaseException:
            self.messages.pop()
            raise
        if dropped:
            head = 1 if self.messages[0]["role"] == "system" else 0
            del self.messages[head:head + dropped]
            self.trimmed += dropped
        return prompt, dropped

    def answered(self, text: str) -> None:
        self.messages.append({"role": "assistant", "content": text})

    def failed(self) -> None:
        """The last question got no answer: take it back, so that the next one does not follow it."""
        if self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()


def _chat(args: argparse.Namespace) -> int:
    import trio

    from ..net.identity import generate_key_pair
    from ..peer import Peer

    quiet_libp2p()
    config, model_id, source = client_model(args, "chat")
    config = dataclasses.replace(config, tokenizer_path=None)  # the tokenizer is ours: read below, once
    model = open_chat_model(source)
    tokenizer, template = model.tokenizer, model.template
    context = args.context or min(model.context or DEFAULT_CONTEXT, DEFAULT_CONTEXT)
    reserve = session_length(0, args.max_new_tokens, MAX_GUESSES)  # what the stages hold beyond the prompt
    if context <= reserve:
        raise SangamaError(f"--context {context} leaves no room for a prompt: the answer alone needs {reserve} "
                           f"positions (--max-new-tokens {args.max_new_tokens} + {MAX_GUESSES} guesses + 1)")
    if template.warning is not None:
        print(f"note: {template.warning}", file=sys.stderr)
    k = args.guesses if args.guesses is not None else (default_guesses(source) if source.is_dir() else "auto")
    talk = Conversation(template, tokenizer, args.system, context - reserve)

    async def main() -> None:
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            interactive = sys.stdin.isatty()
            turn = 0
            while True:
                if interactive:
                    print("> ", end="", flush=True)
                # abandoned on Ctrl-C: a read blocked on the terminal must not hold the interrupt until Enter
                line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
                if not line:
                    return
                text = line.rstrip("\n")
                if not text.strip():
                    continue
                if text.strip() == RESET:
                    talk.reset()
                    print("(conversation reset)", file=sys.stderr, flush=True)
                    continue
                try:
                    await _turn(peer, model_id, talk, text, args, k, turn)
                except BaseException as exc:
                    errors = sangama_errors(exc)
                    if errors is None:
                        raise
                    talk.failed()
                    for err in errors:
                        if args.json:
                            print(json.dumps({"error": str(err)}), flush=True)
                        print(f"error: {err}", file=sys.stderr, flush=True)
                turn += 1

    trio.run(main)
    return 0


async def _turn(peer: Peer, model_id: str, talk: Conversation, text: str, args: argparse.Namespace, k: int | str,
                turn: int) -> None:
    """One question and its streamed answer."""
    before = talk.trimmed
    prompt, dropped = talk.ask(text)
    if dropped and not before:
        print(f"(the conversation outgrew {talk.budget} prompt tokens: the oldest turns are dropped from here on)",
              file=sys.stderr, flush=True)
    stops = frozenset(prompt.stop_ids)
    decoder = IncrementalDecoder(talk.tokenizer)

    def show(new: list[int]) -> None:
        piece = decoder.push([t for t in new if t not in stops])
        if not args.json:
            print(piece, end="", flush=True)

    client = await peer.client(model_id)
    result = await client.generate(list(prompt.ids), args.max_new_tokens, temperature=args.temperature,
                                   top_p=args.top_p, seed=args.seed + turn, guesses=k, stop_tokens=prompt.stop_ids,
                                   on_tokens=show)
    answer = result.tokens[:-1] if result.tokens and result.tokens[-1] in stops else result.tokens
    reply = talk.tokenizer.decode(answer)
    talk.answered(reply)
    if args.json:
        print(json.dumps(dict(result.as_dict(), text=reply, dropped=dropped)), flush=True)
    else:
        print(decoder.flush(), flush=True)
    if args.timings:
        print_where_time_goes(result.trips)
