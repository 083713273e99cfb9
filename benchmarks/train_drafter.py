"""Teach a trained checkpoint's MTP layer to guess what its own main model will say (self-distillation).

    python benchmarks/train_drafter.py --model /tmp/sangama-trained-tiny-20min --out /tmp/sangama-drafter-tiny \
        [--minutes 10] [--sequences 1024] [--chain 4]

Why: a guess is accepted when it equals the main model's next token, not the corpus's. ``train_tiny.py`` trains the
MTP layer on the corpus, and chained only 2-3 deep, so on our 20-minute model the 4th guess of a step was never
accepted (acceptance 0.67 / 0.67 / 0.67 / 0.00 on the code prompt). Speculative decoding's drafters are usually
trained on the target model's own outputs (EAGLE, Medusa); this does that for Qwen3.5's MTP layer:

1. the main model (our runtime, batched) continues ``--sequences`` prompts cut from the stdlib sources greedily;
2. transformers' implementation of the same checkpoint gives, for every position of those sequences, the final
   normed hidden state and the main model's greedy next token (the *teacher*); the main model is frozen;
3. only the ``mtp.*`` weights train, chained ``--chain`` deep as the runtime drafts (depth d feeds depth d-1's
   output back as the hidden state): at position t, depth d reads the token at t+d and learns the teacher's token
   for t+d+1;
4. the checkpoint is copied to ``--out`` with the new ``mtp.*`` tensors (the main model's tensors are the same
   bytes), and our runtime generates with 4 guesses before and after: same tokens, acceptance by position.

Benchmark-only (transformers is not a runtime dependency). Writes benchmarks/results/train_drafter.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from train_tiny import MTPHead, recurrent_delta_rule, stdlib_text, tokenize  # noqa: E402

RESULTS = Path(__file__).parent / "results"
CHECK_PROMPTS = {
    "code": 'def read_lines(path, encoding="utf-8"):\n    """Return the lines of the file at path."""\n    with open(',
    "prose": "This module provides a simple interface to the operating system. The functions described here are",
}


def self_generated(model_dir: Path, ids: torch.Tensor, n: int, prompt_len: int, new: int, seed: int) -> torch.Tensor:
    """[n, prompt_len + new]: prompts cut from ``ids`` at random, continued greedily by our runtime."""
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    ck = open_checkpoint(model_dir)
    chain = LocalChain.load(ck, [LayerRange(0, ck.spec.num_layers)])
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - prompt_len, (n,), generator=g).tolist()
    prompts = [ids[s:s + prompt_len].tolist() for s in starts]
    rows = []
    for i in range(0, n, 48):
        for p, r in zip(prompts[i:i + 48], chain.generate_many(prompts[i:i + 48], new, stop_at_eos=False)):
            rows.append(p + r.tokens)
    return torch.tensor(rows, dtype=torch.long)


class Teacher:
    """The frozen main model (transformers): final normed hidden states, greedy next tokens, rotary tables."""

    def __init__(self, path: Path) -> None:
        import transformers
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

        self.hf = hf
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.pos_emb = None
        self.model.model.rotary_emb.register_forward_hook(self._keep_rope)

    def _keep_rope(self, _module, _inputs, output) -> None:
        self.pos_emb = output

    @torch.no_grad()
    def run(self, seqs: torch.Tensor, batch: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden [N, T, H], teacher tokens [N, T]: the main model's argmax after each position)."""
        chunked = self.hf.torch_chunk_gated_delta_rule
        self.hf.torch_chunk_gated_delta_rule = recurrent_delta_rule  # no triangular solves on CPU
        try:
            hs, ts = [], []
            for i in range(0, len(seqs), batch):
                h = self.model.model(input_ids=seqs[i:i + batch], use_cache=False).last_hidden_state
                hs.append(h)
                ts.append(self.model.lm_head(h).argmax(-1))
        finally:
            self.hf.torch_chunk_gated_delta_rule = chunked
        return torch.cat(hs), torch.cat(ts)


def depth_losses(mtp: MTPHead, teacher: Teacher, hidden: torch.Tensor, seqs: torch.Tensor, targets: torch.Tensor,
                 chain: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per chain depth: CE against the teacher's tokens and top-1 agreement (what greedy acceptance needs)."""
    embed, head = teacher.model.model.embed_tokens, teacher.model.lm_head
    cos, sin = teacher.pos_emb
    b = seqs.shape[0]
    losses, agree = [], []
    hid = hidden
    for d in range(1, chain + 1):
        n = seqs.shape[1] - d
        pe = (cos[:1, :n].expand(b, -1, -1), sin[:1, :n].expand(b, -1, -1))
        u = mtp(hid[:, :n], embed(seqs[:, d:d + n]), pe)
        lg = head(u[:, :n - 1])
        tgt = targets[:, d:d + n - 1]
        losses.append(F.cross_entropy(lg.flatten(0, 1), tgt.flatten()))
        agree.append((lg.argmax(-1) == tgt).float().mean().detach())
        hid = u
    return losses, agree


def runtime_check(model_dir: Path, new: int) -> dict:
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    ck = open_checkpoint(model_dir)
    chain = LocalChain.load(ck, [LayerRange(0, ck.spec.num_layers)])
    out = {}
    for name, text in CHECK_PROMPTS.items():
        ids = ck.tokenizer.encode(text)
        plain = chain.generate(ids, new, guesses=0)
        guessed = chain.generate(ids, new, guesses=4)
        out[name] = {"same_tokens_with_guesses": plain.tokens == guessed.tokens,
                     "tokens_per_step_k4": round(guessed.tokens_per_step, 3),
                     "acceptance_by_position_k4": [round(a, 3) for a in guessed.accepted_at],
                     "tokens": plain.tokens}
    return out


def save_mtp(src: Path, out: Path, mtp: MTPHead) -> None:
    """``out`` = ``src`` with the ``mtp.*`` tensors replaced (names, shapes and dtypes checked)."""
    from safetensors.torch import load_file, save_file

    from sangama_p2p.errors import CheckpointError

    tensors = load_file(str(src / "model.safetensors"))
    new = {k: v.detach().contiguous() for k, v in mtp.checkpoint_tensors().items()}
    for k, t in new.items():
        if k not in tensors or tensors[k].shape != t.shape or tensors[k].dtype != t.dtype:
            raise CheckpointError(f"{k}: the trained MTP tensor does not fit the checkpoint")
    if set(new) != {k for k in tensors if k.startswith("mtp.")}:
        raise CheckpointError("the trained MTP layer's tensors differ from the checkpoint's mtp.* tensors")
    tensors.update(new)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(src, out)
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")


def main() -> None:
    from safetensors.torch import load_file

    from sangama_p2p.model.checkpoint import open_checkpoint

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a trained checkpoint (benchmarks/train_tiny.py)")
    ap.add_argument("--out", type=Path, required=True, help="where the checkpoint with the new MTP layer goes")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sequences", type=int, default=1024, help="self-generated training sequences")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--new", type=int, default=112, help="greedy tokens per sequence")
    ap.add_argument("--chain", type=int, default=4, choices=range(1, 7), help="depths trained (guesses drafted)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=RESULTS / "train_drafter.json")
    args = ap.parse_args()
    if args.sequences < 16:  # 8 or more of them are held out for validation; the rest train
        ap.error(f"--sequences must be >= 16 (8 are held out for validation), got {args.sequences}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    load0, t0 = os.getloadavg(), time.perf_counter()
    src = args.model.resolve()
    ck = open_checkpoint(src)
    text, files = stdlib_text(2_000_000)
    ids = tokenize(ck.tokenizer, text)
    seqs = self_generated(src, ids, args.sequences, args.prompt_len, args.new, args.seed)
    t_gen = time.perf_counter() - t0
    teacher = Teacher(src)
    hidden, targets = teacher.run(seqs)
    t_teach = time.perf_counter() - t0 - t_gen
    print(f"{len(seqs)} sequences of {seqs.shape[1]} tokens: generated in {t_gen:.0f} s, teacher pass {t_teach:.0f} s")
    n_val = max(len(seqs) // 16, 8)
    tr_s, va_s = seqs[:-n_val], seqs[-n_val:]
    tr_h, va_h = hidden[:-n_val], hidden[-n_val:]
    tr_t, va_t = targets[:-n_val], targets[-n_val:]

    cfg = teacher.model.config
    hf = teacher.hf
    mtp = MTPHead(cfg, hf.Qwen3_5MoeDecoderLayer, hf.Qwen3_5MoeRMSNorm, cfg.layer_types.index("full_attention"))
    mtp.load_checkpoint(load_file(str(src / "model.safetensors")))
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(mtp.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)

    def evaluate() -> list[float]:
        mtp.eval()
        with torch.no_grad():
            _, agree = depth_losses(mtp, teacher, va_h, va_s, va_t, args.chain)
        mtp.train()
        return [round(float(a), 3) for a in agree]

    before_val = evaluate()
    before_rt = runtime_check(src, 64)
    print(f"before: validation agreement by depth {before_val}; runtime k=4 "
          + ", ".join(f"{k} {v['tokens_per_step_k4']} tokens/step {v['acceptance_by_position_k4']}"
                      for k, v in before_rt.items()))
    g = torch.Generator().manual_seed(args.seed)
    budget, step, t_start, curve = args.minutes * 60.0, 0, time.perf_counter(), []
    while time.perf_counter() - t_start < budget:
        frac = (time.perf_counter() - t_start) / budget
        lr = args.lr * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for grp in opt.param_groups:
            grp["lr"] = lr
        pick = torch.randint(0, len(tr_s), (args.batch,), generator=g)
        losses, agree = depth_losses(mtp, teacher, tr_h[pick], tr_s[pick], tr_t[pick], args.chain)
        loss = sum(losses) / len(losses)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        step += 1
        if step == 1 or step % 50 == 0:
            row = {"step": step, "seconds": round(time.perf_counter() - t_start, 1),
                   "loss": [round(float(x.detach()), 4) for x in losses], "agree": [round(float(a), 3) for a in agree]}
            curve.append(row)
            print(f"step {step:>5} {row['seconds']:>7.1f} s  loss {row['loss']}  agreement {row['agree']}", flush=True)
    after_val = evaluate()
    save_mtp(src, args.out, mtp)
    after_rt = runtime_check(args.out, 64)
    for name in CHECK_PROMPTS:  # the main model is untouched: its greedy tokens must not change
        if after_rt[name]["tokens"] != before_rt[name]["tokens"]:
            raise SystemExit(f"{name}: the main model's tokens changed; the checkpoint was not copied faithfully")
    print(f"after {step} steps: validation agreement by depth {after_val}; runtime k=4 "
          + ", ".join(f"{k} {v['tokens_per_step_k4']} tokens/step {v['acceptance_by_position_k4']} "
                      f"(same tokens: {v['same_tokens_with_guesses']})" for k, v in after_rt.items()))
    for r in (before_rt, after_rt):
        for v in r.values():
            v.pop("tokens")
    res = {"model": str(src), "out": str(args.out), "sequences": len(seqs), "tokens_per_sequence": seqs.shape[1],
           "corpus_files": files, "generate_s": round(t_gen, 1), "teacher_s": round(t_teach, 1), "steps": step,
           "train_s": round(time.perf_counter() - t_start, 1), "chain": args.chain,
           "validation_agreement": {"before": before_val, "after": after_val},
           "runtime_k4": {"before": before_rt, "after": after_rt}, "curve": curve,
           "meta": {"threads": args.threads, "batch": args.batch, "lr": args.lr, "seed": args.seed,
                    "minutes": args.minutes, "loadavg_start": [round(x, 2) for x in load0],
                    "loadavg_end": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
                    "machine": platform.machine(), "cpus": os.cpu_count(),
                    "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}}
    args.json.parent.mkdir(exist_ok=True)
    runs = json.loads(args.json.read_text()).get("runs", {}) if args.json.is_file() else {}
    runs[f"{src.name}->{args.out.name}"] = res
    args.json.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"wrote {args.json}; checkpoint in {args.out}")


if __name__ == "__main__":
    main()
