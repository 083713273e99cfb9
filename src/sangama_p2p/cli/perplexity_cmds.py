"""``sangama-peer perplexity MODEL --text-file F``: a text's perplexity in this process, as llama-perplexity's.

Computed as llama.cpp's ``llama-perplexity -m MODEL -f F -c CTX --chunks K`` computes it (the rules:
model/perplexity.py).

It prints what llama-perplexity prints: the running figure after each chunk (``[1]12.3456,[2]...``) and ``Final
estimate: PPL = X +/- Y``; ``--json``: one document instead. Local only: a swarm's last stage sends back tokens (or a
few log-probabilities), not every position's whole distribution, which scoring a window needs.

Every layer runs on one stage with the fused kernels, as ``generate --local`` does; the head's logits are computed
whole in float32 from the stored weight (``Head.whole``), since every scored token's logit counts, not only the top.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import CheckpointError, ModelError, translate
from .argtypes import positive_int
from .hub_cmds import from_hub
from .threads import set_threads

# torch (1.4-2.6 s to import) and the model modules that import it are imported in the handler: cli/main.py imports
# every command module to build its parser


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "perplexity",
        help="a text's perplexity under a model, in this process, as llama.cpp's llama-perplexity computes it",
        description="Perplexity of --text-file under MODEL (a .gguf file or a checkpoint directory), computed as "
        "llama-perplexity does: the whole text tokenized (BOS added when the model adds it), split into chunks of "
        "--ctx tokens, each evaluated alone with its first token replaced by BOS, the second half of each scored. "
        "Runs in this process (no swarm).",
    )
    p.add_argument("model", metavar="MODEL", help="a .gguf file, a checkpoint directory or hf:OWNER/NAME[:FILE]")
    p.add_argument("--text-file", "-f", required=True, metavar="FILE", help="the text (UTF-8)")
    p.add_argument("--ctx", "-c", type=positive_int, default=512, metavar="N",
                   help="tokens per chunk (default: 512, llama-perplexity's)")
    p.add_argument("--chunks", type=positive_int, default=None, metavar="K",
                   help="score at most K chunks (default: all the text holds)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch intra-op threads (default: half the cores this process may use)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of llama.cpp's lines")
    p.set_defaults(handler=_perplexity)


def encode_like_llamacpp(tokenizer, text: str) -> tuple[list[int], int | None]:
    """``(ids, bos)``: ``text``'s ids with BOS added when the model adds it (``common_tokenize(..., true)``), and
    the BOS id (None when the model adds none). A tokenizer that also appends EOS is refused, as llama.cpp does."""
    plain = tokenizer.backend.encode(text, add_special_tokens=False).ids
    full = tokenizer.backend.encode(text, add_special_tokens=True).ids
    probe, probe_full = (tokenizer.backend.encode("a", add_special_tokens=s).ids for s in (False, True))
    extra = len(probe_full) - len(probe)
    if extra == 0:
        return list(plain), None
    if extra == 1 and probe_full[1:] == probe:
        return list(full), int(probe_full[0])
    raise ModelError("the model's tokenizer appends an end-of-sequence token; llama-perplexity refuses such models")


def _perplexity(args: argparse.Namespace) -> int:
    import torch

    from ..model.checkpoint import open_checkpoint
    from ..model.perplexity import PerplexityRun, chunk_starts, read_text, scored_rows, token_nll, window
    from ..model.stage import StageModel, StepInput

    set_threads(args.threads)
    try:
        text = read_text(Path(args.text_file).read_bytes())
    except OSError as exc:
        raise translate(exc, CheckpointError, f"cannot read the text file {args.text_file}")
    model = str(from_hub(args.model)[0])
    ckpt = open_checkpoint(model)
    if ckpt.tokenizer is None:
        raise CheckpointError(f"{model} ships no tokenizer; perplexity needs one to tokenize the text")
    spec = ckpt.spec
    if args.ctx > spec.max_position_embeddings:
        raise ModelError(f"--ctx {args.ctx} exceeds the model's {spec.max_position_embeddings} positions")
    t0 = time.perf_counter()
    tokens, bos = encode_like_llamacpp(ckpt.tokenizer, text)
    starts = chunk_starts(len(tokens), args.ctx, args.chunks)
    first, n_scored = scored_rows(args.ctx)
    say = (lambda *a: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
    say(f"perplexity: the text tokenizes to {len(tokens)} tokens ({'BOS added' if bos is not None else 'no BOS'})")
    stage = StageModel.load(spec, ckpt.source, 0, spec.num_layers)
    say(f"perplexity: calculating perplexity over {len(starts)} chunks, n_ctx={args.ctx}")
    run = PerplexityRun()
    for start in starts:
        ids = window(tokens, start, args.ctx, bos)
        hidden = stage.forward([StepInput(stage.new_session(args.ctx), 0, tokens=torch.tensor(ids))])
        with torch.inference_mode():
            normed = stage.final_normed(hidden[first : first + n_scored])
            logits = stage.exact_head.whole(normed) if stage.exact_head is not None else stage.head_logits(normed)
        ppl = run.add(token_nll(logits, tokens[start + first + 1 : start + first + 1 + n_scored]))
        if not args.json:
            print(f"[{len(run.chunks)}]{ppl:.4f},", end="", flush=True)
    seconds = time.perf_counter() - t0
    if args.json:
        doc = {"model": model, "text_file": args.text_file, "tokens": len(tokens), "bos": bos, "n_ctx": args.ctx,
               "chunks": len(starts), **run.as_dict(), "seconds": round(seconds, 3)}
        print(json.dumps(doc))
    else:
        print()
        print(f"Final estimate: PPL = {run.ppl:.4f} +/- {run.ppl_error:.5f}")
        say(f"perplexity: {run.count} tokens scored in {seconds:.1f} s")
    return 0
