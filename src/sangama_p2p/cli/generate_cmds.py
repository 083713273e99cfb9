"""``sangama-peer generate``: through the swarm (``--model ID|DIR``), or with ``--local MODEL`` through a chain of
stages in this process, chained through the same per-stage API that peers use over the network.

One request streams its tokens as they come (text, or ``--jsonl`` lines; ``--json`` prints one document at the end);
on a failure the tokens produced so far stay printed, then the error (exit code 2, from ``main``). ``--batch N`` runs
N requests at once and prints them at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..errors import ModelError, SangamaError, translate
from ..model.chat import load_chat_template, render_chat
from ..model.emit import TokenPrinter
from ..model.spec import LayerRange, ModelSpec, parse_stages
from .argtypes import guesses, non_negative_int, positive_int
from .hub_cmds import from_hub
from .pin import add_fingerprint_arg
from .process import add_progress_arg, progress, quiet_libp2p, sangama_errors, show_progress
from .swarm import add_verify_arg, client_peer_config, need_tokenizer
from .tables import peer_label, print_where_time_goes
from .threads import set_threads

# torch (1.4-2.6 s to import), libp2p (0.8-1.4 s) and the modules that import them (model.chain, model.checkpoint,
# peer, hub, net) are imported in the handlers: cli/main.py imports every command module to build its parser, and
# `sangama-peer --help` takes 0.1 s (3-4 s with them here).

LONG_PREFILL = 256  # prompt tokens from which --local reports its prefill (with --progress, or on a terminal)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text through a chain of stages",
        description="Generate text through the swarm (--model ID [--bootstrap ADDR]), or with --local MODEL in this "
        "process, chained through the same per-stage API that peers use over the network.",
    )
    p.add_argument("text", nargs="?", help="the prompt (same as --prompt)")
    p.add_argument("--local", metavar="MODEL", default=None,
                   help="checkpoint directory (config.json + safetensors), .gguf file or hf:ORG/REPO[@REV][:FILE.gguf] "
                   "to run in this process")
    p.add_argument("--model", default=None, metavar="ID|DIR|FILE.gguf",
                   help="network mode: the model id to ask the swarm for, or a checkpoint directory or .gguf file "
                   "(its name is the id; its tokenizer encodes the prompt; only peers of that very checkpoint are "
                   "chained)")
    p.add_argument("--tokenizer", type=Path, default=None, help="network mode: checkpoint dir with tokenizer.json")
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR",
                   help="network mode: bootstrap address (repeatable; default: bootstrap/public.txt)")
    p.add_argument("--fleet-secret-file", type=Path, default=None, help="network mode: the private fleet's secret")
    add_verify_arg(p)
    add_fingerprint_arg(p)
    p.add_argument("--timings", action="store_true",
                   help="network mode: print where the time goes per trip (each stage's queue/compute/send, network) "
                   "and each hop's latency, measured or estimated")
    p.add_argument("--stages", default=None, metavar="A:B,B:C",
                   help="contiguous layer ranges covering the model, e.g. 0:3,3:8 (default: one stage)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true",
                   help="--local: the prompt is one user message in the checkpoint's chat template (the answer ends "
                   "at the template's end-of-turn tokens)")
    p.add_argument("--system", default=None, metavar="TEXT", help="--local --chat: a system message before it")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=32,
                   help="new tokens at most (default %(default)s)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 = greedy (default %(default)s)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling's probability mass (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default %(default)s)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="--local: compute dtype (default: float32 on the CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default=None, metavar="DEV",
                   help="--local: cpu (default), cuda or cuda:N; the compute dtype defaults to bfloat16 on CUDA")
    p.add_argument("--mtp-from", default=None, help="safetensors checkpoint to take mtp.* tensors from (GGUF)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--guesses", type=guesses, default=0, metavar="K|auto",
                   help="MTP guesses checked per trip: a fixed number (0 = none) or 'auto' (adaptive)")
    p.add_argument("--batch", type=positive_int, default=1, metavar="N",
                   help="run N concurrent requests as batched steps (request i uses prompt i of the built-in set "
                   "when N > 1, or the given prompt for all)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="make each request's numbers independent of its batch (slower on CPU)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads for --local (default: half the cores this process may use, at "
                   "least 1: all of them stall when other processes compete)")
    p.add_argument("--dequantize-per-use", action="store_true",
                   help="keep quantized GGUF weights as stored and dequantize them on every use (slow; for comparing "
                   "with the fused kernels)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object at the end instead of text")
    out.add_argument("--jsonl", action="store_true",
                     help="stream one JSON line per token ({\"token\", \"text\"}), then a {\"done\": true, ...} line")
    add_progress_arg(p, "loading the model and a long prefill")
    p.set_defaults(handler=_generate)


def _check_one_prompt(args: argparse.Namespace) -> None:
    given = [name for name, value in (("TEXT", args.text), ("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids))
             if value is not None]
    if len(given) > 1:
        raise ModelError(f"give the prompt once: {' and '.join(given)} were both given")


def _prompt_ids(args: argparse.Namespace, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            return [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError as exc:
            raise translate(exc, ModelError, "--prompt-ids must be comma-separated integers")
    text = args.prompt if args.prompt is not None else args.text
    if text is None:
        raise ModelError("give a prompt: TEXT, --prompt TEXT or --prompt-ids 1,2,3")
    if tokenizer is None:
        raise ModelError("this checkpoint has no tokenizer: use --prompt-ids")
    return tokenizer.encode(text)


_LOCAL_ONLY = ("stages", "mtp_from", "batch_invariant", "threads", "chat", "system", "dequantize_per_use", "device",
               "dtype")
_NETWORK_ONLY = ("model", "tokenizer", "bootstrap", "fleet_secret_file", "timings", "verify")


def _check_mode(args: argparse.Namespace) -> None:
    """A flag of the other mode would be ignored without a word: refuse it instead."""
    local = args.local is not None
    wrong = [name for name in (_NETWORK_ONLY if local else _LOCAL_ONLY) if getattr(args, name) not in (None, False)]
    if wrong:
        flags = ", ".join("--" + name.replace("_", "-") for name in wrong)
        raise ModelError(f"{flags} {'is' if len(wrong) == 1 else 'are'} for "
                         + ("the network mode (without --local)" if local else "--local runs in this process"))


def _generate(args: argparse.Namespace) -> int:
    _check_one_prompt(args)
    _check_mode(args)
    if args.local is None:
        ids = _prompt_ids(args, None) if args.prompt_ids is not None else None
        return _generate_network(args, [ids] if ids is not None else None)
    return _generate_local(args)


def _generate_local(args: argparse.Namespace) -> int:
    from ..model.chain import LocalChain
    from ..model.checkpoint import open_checkpoint
    from ..model.device import default_dtype, resolve_device
    from ..model.sampling import SamplingParams

    device = resolve_device(args.device or "cpu")  # before the checkpoint is read
    set_threads(args.threads)
    show = show_progress(args.progress)
    args.local = str(from_hub(args.local)[0])  # hf:...: fetched whole (a local run holds every layer)
    ckpt = open_checkpoint(args.local, mtp_from=args.mtp_from, need_tokenizer=args.prompt_ids is None)
    spec = ckpt.spec
    ranges = parse_stages(args.stages, spec.num_layers) if args.stages else [LayerRange(0, spec.num_layers)]
    for r in ranges:
        spec.check_range(r.start, r.end)
    stops = None
    if args.chat:
        ids, stops = _chat_prompt(args, ckpt)
    else:
        if args.system is not None:
            raise ModelError("--system needs --chat (the system message goes through the chat template)")
        ids = _prompt_ids(args, ckpt.tokenizer)
    if any(i < 0 or i >= spec.vocab_size for i in ids):
        raise ModelError(f"prompt token ids must be in 0..{spec.vocab_size - 1}")
    with progress(f"loading {spec.num_layers} layers of {Path(args.local).name}", show=show):
        chain = LocalChain.load(ckpt, ranges, dtype=default_dtype(device, args.dtype), device=device,
                                batch_invariant=args.batch_invariant, fused=not args.dequantize_per_use)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    if args.batch == 1:  # one request: its tokens print as they come
        printer = TokenPrinter(ckpt.tokenizer, output_mode(args), hide=stops or ())
        prefill = _PrefillNote(len(ids), show=show and len(ids) >= LONG_PREFILL)

        def push(i: int, new: list[int]) -> None:
            prefill.over()
            printer.push(new)

        try:
            with prefill:
                r = chain.generate(ids, args.max_new_tokens, sampling, guesses=args.guesses,
                                   stop_at_eos=not args.ignore_eos, stop_tokens=stops, on_tokens=push)
        except SangamaError as exc:
            printer.fail(exc)
            raise
        printer.done(dict(r.as_dict(), text=_answer_text(r, stops, ckpt.tokenizer)))
        if printer.mode == "text":
            _local_stats(r)
        return 0
    prompts = prompt_variants(ids, args.batch, spec.vocab_size)
    results = chain.generate_many(prompts, args.max_new_tokens, sampling, guesses=args.guesses,
                                  stop_at_eos=not args.ignore_eos, stop_tokens=stops)
    texts = [_answer_text(r, stops, ckpt.tokenizer) for r in results]
    if args.json or args.jsonl:
        print(json.dumps({"requests": [dict(r.as_dict(), text=t) for r, t in zip(results, texts)]}))
        return 0
    for r, text in zip(results, texts):
        print(text if text is not None else " ".join(map(str, r.tokens)))
        _local_stats(r)
    return 0


class _PrefillNote:
    """``with`` a generation: a long prompt's prefill as :func:`.process.progress` reports it, from the start until
    the first new token arrives (:meth:`over`), or until the generation fails before it."""

    def __init__(self, n: int, *, show: bool) -> None:
        self.n, self.show = n, show
        self._stack = ExitStack()

    def __enter__(self) -> _PrefillNote:
        if self.show:
            self._stack.enter_context(progress(f"prefill of {self.n:,} prompt tokens", show=True, count=self.n,
                                               unit="tokens"))
        return self

    def over(self) -> None:
        self._stack.close()  # once: later calls find it empty

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._stack.__exit__(*exc_info)


def _generate_network(args: argparse.Namespace, prompts: list[list[int]] | None) -> int:
    """``generate`` over the swarm: ``prompts`` as ids, or None to take the text prompt through the tokenizer."""
    import trio

    from ..net.identity import generate_key_pair
    from ..peer import Peer

    quiet_libp2p()
    if not args.model:
        raise SangamaError("give the model: --model ID (or a checkpoint directory or .gguf file), or run in-process "
                           "with --local")
    config, model_id = client_peer_config(args, args.model)
    text = args.prompt if args.prompt is not None else args.text
    if prompts is None:
        if text is None:
            raise SangamaError("give a prompt: TEXT, --prompt TEXT or --prompt-ids 1,2,3")
        need_tokenizer(config, args.model, "a text prompt")

    if args.batch == 1:
        return _generate_streamed(args, config, prompts[0] if prompts is not None else None, text)

    async def main() -> list[Any]:
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            base = prompts[0] if prompts is not None else peer.encode(text or "")
            # the same prompt set as `generate --local --batch N`, so the two compare
            todo = prompt_variants(base, args.batch, _vocab_size(args.model, peer))
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
        print_where_time_goes(results[0].result.trips)
        _print_hops(results[0].result)
    if args.json or args.jsonl:
        print(json.dumps({"requests": [dict(g.result.as_dict(), text=g.text) for g in results]}))
        return 0
    for g in results:
        print(g.text if g.text is not None else " ".join(map(str, g.tokens)))
        _network_stats(g.result)
    return 0


def _print_hops(r: Any) -> None:
    """``--timings``: the one-way latency of each hop the route was planned with, and whether it was measured (by
    the stage, for a stage-to-stage hop; by the client, for its own) or estimated."""
    def name(p: str) -> str:
        return peer_label(p) if p else "client"

    hops = ", ".join(f"{name(h['from'])}->{name(h['to'])} {h['ms']:.1f} ms {'measured' if h['measured'] else 'estimated'}"
                     for h in r.hops)
    if hops:
        print(f"[hops (one-way, as planned): {hops}]", file=sys.stderr)


def _network_stats(r: Any) -> None:
    """The text mode's summary on stderr, the route by unique peer-id suffixes, and any failover said."""
    print(f"[{len(r.tokens)} tokens, prefill {r.prefill_s * 1e3:.1f} ms, {r.decode_tokens_per_s:.1f} tokens/s "
          f"decode, {r.steps} trips, guesses accepted {r.guesses_accepted}/{r.guesses_proposed}, "
          f"route {' -> '.join(peer_label(p) for p in r.route)}]", file=sys.stderr)
    if r.links and any(link not in ("lane", "local") for link in r.links):  # say how each hop is carried
        print(f"[links {', '.join(f'{peer_label(p)}: {link}' for p, link in zip(r.route, r.links))}]", file=sys.stderr)
    if r.failovers:
        print(f"[{r.failover_note()}]", file=sys.stderr)
    if r.unverified_trips:  # --verify: never a silent "verified"
        print(f"[verify: {r.verified_trips} trips checked on a second chain, {r.unverified_trips} could not be "
              "(no second chain of other peers for the same ranges, or it failed): their tokens are unchecked]",
              file=sys.stderr)
    elif r.verified_trips is not None:
        print(f"[verify: {r.verified_trips} trips checked on a second chain]", file=sys.stderr)


def _generate_streamed(args: argparse.Namespace, config: Any, ids: list[int] | None, text: str | None) -> int:
    """One request over the swarm, printed token by token (``--json``: one document at the end); on a failure
    the tokens produced so far stay printed, then the error (exit code 2, from ``main``)."""
    import trio

    from ..net.identity import generate_key_pair
    from ..peer import Peer

    printer: TokenPrinter | None = None

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
        errors = sangama_errors(exc)
        if errors is None or printer is None:
            raise
        printer.fail(errors[0])
        raise errors[0] from exc
    printer.done(dict(g.result.as_dict(), text=g.text))
    if args.timings:
        print_where_time_goes(g.result.trips)
        _print_hops(g.result)
    if printer.mode == "text":
        _network_stats(g.result)
    return 0


def _vocab_size(model: str, peer: Any) -> int:
    if Path(model).is_dir():
        return ModelSpec.from_dir(model).vocab_size
    if peer.tokenizer is not None:
        return int(peer.tokenizer.vocab_size)
    raise SangamaError("--batch over the network needs the model's vocabulary: pass --model as a checkpoint dir")


def output_mode(args: argparse.Namespace) -> str:
    return "json" if args.json else "jsonl" if args.jsonl else "text"


def _local_stats(r) -> None:
    print(f"[{len(r.tokens)} tokens, prefill {r.prefill_s * 1e3:.1f} ms, {r.decode_tokens_per_s:.1f} tokens/s "
          f"decode, {r.steps} steps, {r.tokens_per_step:.2f} tokens/step, accepted guesses per step "
          f"{r.guesses_accepted / max(r.steps, 1):.2f}; stages "
          + ", ".join(f"{t.layers}: {t.seconds * 1e3 / max(t.calls, 1):.2f} ms/call" for t in r.stages)
          + "]", file=sys.stderr)


def _answer_text(result, stops: tuple[int, ...] | None, tokenizer) -> str | None:
    """The text of a result; with ``--chat`` without the stop token that ended the answer."""
    if stops is not None and result.tokens and result.tokens[-1] in stops:
        return tokenizer.decode(result.tokens[:-1])
    return result.text


def _chat_prompt(args: argparse.Namespace, ckpt) -> tuple[list[int], tuple[int, ...]]:
    """``--chat``: the text prompt as a user message (after ``--system``) in the checkpoint's template."""
    text = args.prompt if args.prompt is not None else args.text
    if text is None:
        raise ModelError("--chat needs a text prompt (TEXT or --prompt), not --prompt-ids")
    if ckpt.tokenizer is None:
        raise ModelError("--chat needs the checkpoint's tokenizer, and this checkpoint has none")
    template = load_chat_template(ckpt.path)
    if template.warning is not None:
        print(f"note: {template.warning}", file=sys.stderr)
    messages = [{"role": "system", "content": args.system}] if args.system is not None else []
    prompt = render_chat(template, ckpt.tokenizer, [*messages, {"role": "user", "content": text}])
    return list(prompt.ids), prompt.stop_ids


def prompt_variants(ids: list[int], n: int, vocab: int) -> list[list[int]]:
    """``n`` prompts for concurrent requests (``--batch N``, the demo): ``ids``, then ``ids`` with a few ids rotated
    (deterministic, so a local and a network run of the same set compare)."""
    return [ids] + [[(t + 7 * i) % vocab if j % 3 == 0 else t for j, t in enumerate(ids)] + [(11 * i) % vocab]
                    for i in range(1, n)]
