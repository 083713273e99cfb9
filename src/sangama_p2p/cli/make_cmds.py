"""``sangama-peer make-model``: write a random-weight tiny/small checkpoint the project can serve and test with;
``sangama-peer requantize``: re-quantize a GGUF file with one of llama-quantize's presets."""

from __future__ import annotations

import argparse

from ..errors import CheckpointError, translate

# model.make and model.gguf import torch (1.4-2.6 s): imported in the handlers, as cli/main.py imports this module
# to build its parser

_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_moe")
_PRESETS = ("tiny", "small", "micro", "mid")
_DTYPES = ("float32", "bfloat16")
# model.gguf.mix.PRESETS (spelt out so that registering the command imports no torch; a test keeps them equal)
REQUANT_PRESETS = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "Q6_K", "Q4_K_M")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "make-model",
        help="write a random-weight model checkpoint (Hugging Face format) with its tokenizer",
        description="Write a random-weight checkpoint (config.json, model.safetensors, tokenizer) into OUT. "
        "The same seed always gives the same bytes.",
    )
    p.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--arch", required=True, choices=_ARCHS, help="architecture")
    p.add_argument("--preset", default="tiny", choices=_PRESETS,
                   help="size (default: tiny; micro: hidden 32, vocab 384, dense archs only)")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tie-embeddings", dest="tie", action="store_true", default=None,
                     help="tie the head to the embedding (no lm_head tensor; dense archs)")
    tie.add_argument("--untie-embeddings", dest="tie", action="store_false", help="give the model its own lm_head")
    p.add_argument("--rope-scaling", metavar="SPEC", type=_rope_scaling,
                   help="RoPE scaling of a dense arch: linear:FACTOR or llama3:FACTOR[:LOW:HIGH:ORIGINAL_MAX] "
                   "(llama3 defaults: low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 64)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--dtype", default="float32", choices=_DTYPES, help="weight dtype (default: float32)")
    p.add_argument(
        "--gguf",
        metavar="TYPE",
        choices=("F32", "F16", "Q8_0", "Q4_K", "Q6_K"),
        help="also write OUT/model-TYPE.gguf the way llama.cpp's converter would (F32, F16, Q8_0, Q4_K, Q6_K)",
    )
    p.set_defaults(handler=_make_model)
    q = subparsers.add_parser(
        "requantize",
        help="re-quantize a GGUF file with a llama-quantize preset (e.g. Q4_K_M)",
        description="Write SRC (a GGUF file) as DST with llama-quantize's per-tensor type mix for PRESET; "
        "metadata is kept as is apart from general.file_type. The same input always gives the same bytes.",
    )
    q.add_argument("src", metavar="SRC", help="GGUF file (or the first of its -0000K-of-0000N splits)")
    q.add_argument("dst", metavar="DST", help="output GGUF file")
    q.add_argument("preset", metavar="PRESET", choices=REQUANT_PRESETS, help=", ".join(REQUANT_PRESETS))
    q.set_defaults(handler=_requantize)


def _rope_scaling(text: str) -> dict:
    kind, _, rest = text.partition(":")
    try:
        nums = [float(x) for x in rest.split(":")] if rest else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad RoPE scaling {text!r}: numbers after the type") from None
    if kind == "linear" and len(nums) == 1:
        return {"rope_type": "linear", "factor": nums[0]}
    if kind == "llama3" and len(nums) in (1, 4):
        low, high, orig = nums[1:] if len(nums) == 4 else (1.0, 4.0, 64)
        return {"rope_type": "llama3", "factor": nums[0], "low_freq_factor": low, "high_freq_factor": high,
                "original_max_position_embeddings": int(orig)}
    raise argparse.ArgumentTypeError(f"bad RoPE scaling {text!r}: use linear:FACTOR or llama3:FACTOR[:LOW:HIGH:MAX]")


def _make_model(args: argparse.Namespace) -> int:
    from ..model.make import checkpoint_num_params, make_model  # imports torch: only when the command runs

    try:
        out = make_model(args.out, args.arch, preset=args.preset, seed=args.seed, dtype=args.dtype,
                         tie_word_embeddings=getattr(args, "tie", None),
                         rope_scaling=getattr(args, "rope_scaling", None))
    except OSError as exc:  # a path that cannot be created or written: the user's to fix, not a crash
        raise translate(exc, CheckpointError, f"cannot write the model to {args.out}")
    n = checkpoint_num_params(out)
    print(f"{out}  {args.arch}/{args.preset}  {n:,} parameters ({args.dtype}, seed {args.seed})")
    if getattr(args, "gguf", None):
        from ..model.gguf import write_gguf

        for path in write_gguf(out, out / f"model-{args.gguf}.gguf", args.gguf):
            print(f"{path}  GGUF {args.gguf}")
    return 0


def _requantize(args: argparse.Namespace) -> int:
    from ..model.gguf import requantize_gguf

    r = requantize_gguf(args.src, args.dst, args.preset)
    types = ", ".join(f"{k} {v}" for k, v in r.types.items())
    print(f"{r.path}  GGUF {args.preset}  {r.nbytes:,} bytes in {r.seconds:.1f} s  ({types})")
    return 0
