"""``sangama-peer generate``: through the swarm, or with ``--local`` through a chain of stages in this process."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ModelError, SangamaError
from .argtypes import guesses, non_negative_int, positive_int
from .threads import set_threads


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
    p.add_argument("--model", default=None, metavar="ID|DIR",
                   help="network mode: the model id to ask the swarm for, or a checkpoint directory (its name is "
                   "the id; its tokenizer encodes the prompt)")
    p.add_argument("--tokenizer", type=Path, default=None, help="network mode: checkpoint dir with tokenizer.json")
    p.add_argument("--bootstrap", action="append", default=None, metavar="MULTIADDR",
                   help="network mode: bootstrap address (repeatable; default: bootstrap/public.txt)")
    p.add_argument("--fleet-secret-file", type=Path, default=None, help="network mode: the private fleet's secret")
    from .peer_cmds import add_verify_arg

    add_verify_arg(p)
    p.add_argument("--timings", action="store_true",
                   help="network mode: print where the time goes per trip (each stage's queue/compute/send, network)")
    p.add_argument("--stages", default=None, metavar="A:B,B:C",
                   help="contiguous layer ranges covering the model, e.g. 0:3,3:8 (default: one stage)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true",
                   help="--local: the prompt is one user message in the checkpoint's chat template (the answer ends "
                   "at the template's end-of-turn tokens)")
    p.add_argument("--system", default=None, metavar="TEXT", help="--local --chat: a system message before it")
    p.add_argument("--max-new-tokens", type=non_negative_int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
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
                   help="torch intra-op threads for --local (default: every core this process may use; 1 is fastest "
                   "for tiny models on busy CPUs)")
    p.add_argument("--dequantize-per-use", action="store_true",
                   help="keep quantized GGUF weights as stored and dequantize them on every use (slow; for comparing "
                   "with the fused kernels)")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object at the end instead of text")
    out.add_argument("--jsonl", action="store_true",
                     help="stream one JSON line per token ({\"token\", \"text\"}), then a {\"done\": true, ...} line")
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
            raise ModelError(f"--prompt-ids must be comma-separated integers: {exc}") from exc
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
        from .peer_cmds import generate_network

        ids = _prompt_ids(args, None) if args.prompt_ids is not None else None
        return generate_network(args, [ids] if ids is not None else None)
    from ..model.chain import LocalChain  # heavy imports only when the command runs
    from ..model.checkpoint import open_checkpoint
    from ..model.sampling import SamplingParams
    from ..model.spec import LayerRange, parse_stages

    from ..model.device import default_dtype, resolve_device

    device = resolve_device(args.device or "cpu")  # before the checkpoint is read
    set_threads(args.threads)
    from .hub_cmds import from_hub

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
    chain = LocalChain.load(ckpt, ranges, dtype=default_dtype(device, args.dtype), device=device,
                            batch_invariant=args.batch_invariant,
                            fused=not args.dequantize_per_use)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    prompts = [ids] + [_variant(ids, i, spec.vocab_size) for i in range(1, args.batch)]
    if args.batch == 1:  # one request: its tokens print as they come
        from ..model.emit import TokenPrinter

        printer = TokenPrinter(ckpt.tokenizer, output_mode(args), hide=stops or ())
        try:
            r = chain.generate(ids, args.max_new_tokens, sampling, guesses=args.guesses,
                               stop_at_eos=not args.ignore_eos, stop_tokens=stops,
                               on_tokens=lambda i, new: printer.push(new))
        except SangamaError as exc:
            printer.fail(exc)
            raise
        printer.done(dict(r.as_dict(), text=_answer_text(r, stops, ckpt.tokenizer)))
        if printer.mode == "text":
            _local_stats(r)
        return 0
    results = chain.generate_many(prompts, args.max_new_tokens, sampling, guesses=args.guesses,
                                  stop_at_eos=not args.ignore_eos, stop_tokens=stops)
    texts = [_answer_text(r, stops, ckpt.tokenizer) for r in results]
    if args.json or args.jsonl:
        dicts = [dict(r.as_dict(), text=t) for r, t in zip(results, texts)]
        print(json.dumps(dicts[0] if args.batch == 1 else {"requests": dicts}))
        return 0
    for r, text in zip(results, texts):
        print(text if text is not None else " ".join(map(str, r.tokens)))
        _local_stats(r)
    return 0


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
    from ..model.chat import load_chat_template, render_chat

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


def _variant(ids: list[int], i: int, vocab: int) -> list[int]:
    """A different prompt for concurrent request ``i``: the prompt with a few ids rotated (deterministic)."""
    return [(t + 7 * i) % vocab if j % 3 == 0 else t for j, t in enumerate(ids)] + [(11 * i) % vocab]
