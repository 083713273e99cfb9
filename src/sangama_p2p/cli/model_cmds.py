"""``sangama-peer generate --local``: run a chain of stages in this process."""

from __future__ import annotations

import argparse
import json
import sys

from ..errors import ModelError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text through a chain of stages",
        description="Generate text. With --local MODEL the stages run in this process, chained through the same "
        "per-stage API that peers use over the network.",
    )
    p.add_argument("text", nargs="?", help="the prompt (same as --prompt)")
    p.add_argument("--local", metavar="MODEL", required=True,
                   help="checkpoint directory (config.json + safetensors) or .gguf file to run in this process")
    p.add_argument("--stages", default=None, metavar="A:B,B:C",
                   help="contiguous layer ranges covering the model, e.g. 0:3,3:8 (default: one stage)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--mtp-from", default=None, help="safetensors checkpoint to take mtp.* tensors from (GGUF)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice; 1 is fastest for tiny models on busy CPUs)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(handler=_generate)


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


def _generate(args: argparse.Namespace) -> int:
    import torch  # heavy imports only when the command runs

    from ..model.chain import LocalChain
    from ..model.checkpoint import open_checkpoint
    from ..model.sampling import SamplingParams
    from ..model.spec import LayerRange, parse_stages

    torch.set_grad_enabled(False)
    if args.threads:
        torch.set_num_threads(args.threads)
    ckpt = open_checkpoint(args.local, mtp_from=args.mtp_from)
    spec = ckpt.spec
    ranges = parse_stages(args.stages, spec.num_layers) if args.stages else [LayerRange(0, spec.num_layers)]
    for r in ranges:
        spec.check_range(r.start, r.end)
    ids = _prompt_ids(args, ckpt.tokenizer)
    if any(i < 0 or i >= spec.vocab_size for i in ids):
        raise ModelError(f"prompt token ids must be in 0..{spec.vocab_size - 1}")
    chain = LocalChain.load(ckpt, ranges, dtype=args.dtype)
    sampling = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    result = chain.generate(ids, args.max_new_tokens, sampling, stop_at_eos=not args.ignore_eos)
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(result.text if result.text is not None else " ".join(map(str, result.tokens)))
        print(f"[{len(result.tokens)} tokens, prefill {result.prefill_s * 1e3:.1f} ms, "
              f"{result.decode_tokens_per_s:.1f} tokens/s decode, stages "
              + ", ".join(f"{t.layers}: {t.seconds * 1e3 / max(t.calls, 1):.2f} ms/call" for t in result.stages)
              + "]", file=sys.stderr)
    return 0
