"""Train a made qwen3_5_moe checkpoint, main model and MTP head together, on Python's own standard library sources.

    python benchmarks/train_tiny.py [--preset small|tiny] [--minutes 5] [--out /tmp/sangama-trained-small]

Why: a random-weight model drafts nothing useful, so guesses (speculative decoding) cannot be benchmarked on it. A
few minutes of training on text every machine has (the stdlib ``.py`` files, sorted, fixed seed) gives a model whose
MTP head predicts the main model's next-next token often enough to measure acceptance, tokens per step and speed.

Engine: transformers' ``Qwen3_5MoeForCausalLM`` (benchmark-only dependency, never imported by ``src/``) runs the main
model's forward/backward; :class:`MTPHead` is our differentiable MTP layer, the same math as ``model/mtp.py``: at
position t, ``fc(cat[norm_e(embed(x_{t+1})), norm_h(h_t)]) -> full-attention MoE layer -> norm -> lm_head``
predicts x_{t+2}, with ``h_t`` the main model's final-normed hidden state (transformers' ``last_hidden_state``).
With ``--mtp-chain 2`` a second MTP pass feeds the first pass's normed output back as ``h`` (how the runtime drafts
guess 2 onwards) and learns x_{t+3}. Loss = main CE + MTP CE (+ chain CE). The trained weights are written back into
``--out`` in the exact layout ``make_model`` writes (same tensor names incl. ``mtp.*``, config and tokenizer files),
then our runtime (``LocalChain``) loads them and generates greedily, with and without guesses, as a check.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

RESULTS = Path(__file__).parent / "results"
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "idlelib", "turtledemo"}


def stdlib_text(max_chars: int) -> tuple[str, int]:
    """The stdlib's ``.py`` sources in sorted path order, joined, up to ``max_chars``; returns (text, files)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts))
    parts, total = [], 0
    for p in paths:
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        parts.append(text)
        total += len(text) + 2
        if total >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars], len(parts)


def tokenize(tokenizer, text: str) -> torch.Tensor:
    """Token ids of ``text`` in 64 KiB chunks split at blank lines (the BPE is byte level; splits are harmless)."""
    chunks, start = [], 0
    while start < len(text):
        end = text.find("\n\n", start + 65536)
        end = len(text) if end < 0 else end + 2
        chunks.append(text[start:end])
        start = end
    ids: list[int] = []
    for enc in tokenizer.backend.encode_batch(chunks, add_special_tokens=False):
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


class MTPHead(nn.Module):
    """The MTP layer, differentiable: fc over [norm_e(embed(x_{t+1})), norm_h(h_t)], one decoder layer, a norm."""

    def __init__(self, config, layer_cls, norm_cls, full_idx: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.pre_fc_norm_embedding = norm_cls(h, eps=config.rms_norm_eps)
        self.pre_fc_norm_hidden = norm_cls(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layer = layer_cls(config, full_idx)  # a full-attention decoder layer (same class as the main model's)
        self.norm = norm_cls(h, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, next_embed: torch.Tensor, pos_emb) -> torch.Tensor:
        x = torch.cat((self.pre_fc_norm_embedding(next_embed), self.pre_fc_norm_hidden(hidden)), dim=-1)
        x = self.layer(self.fc(x), position_embeddings=pos_emb, attention_mask=None)  # None + sdpa = causal
        return self.norm(x)

    def load_checkpoint(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy ``mtp.*`` tensors (experts un-fused, as the checkpoint stores them) into this module."""
        own = {}
        for name in self.state_dict():
            own[name] = _mtp_get(tensors, name, self.layer.mlp.experts.num_experts)
        self.load_state_dict(own, strict=True)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This module's weights under the checkpoint's ``mtp.*`` names, experts un-fused."""
        out = {}
        for name, t in self.state_dict().items():
            out.update(_unfuse("mtp." + name.replace("layer.", "layers.0.", 1), t))
        return out


def _mtp_get(tensors: dict[str, torch.Tensor], name: str, n_experts: int) -> torch.Tensor:
    ck = "mtp." + name.replace("layer.", "layers.0.", 1)
    if ck.endswith("mlp.experts.gate_up_proj"):
        pre = ck[: -len("gate_up_proj")]
        return torch.stack([torch.cat((tensors[f"{pre}{e}.gate_proj.weight"], tensors[f"{pre}{e}.up_proj.weight"]))
                            for e in range(n_experts)])
    if ck.endswith("mlp.experts.down_proj"):
        pre = ck[: -len("down_proj")]
        return torch.stack([tensors[f"{pre}{e}.down_proj.weight"] for e in range(n_experts)])
    return tensors[ck]


def _unfuse(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors -> the per-expert names the checkpoint (and save_pretrained) uses."""
    if name.endswith("mlp.experts.gate_up_proj"):
        pre = name[: -len("gate_up_proj")]
        out = {}
        for e in range(t.shape[0]):
            gate, up = t[e].chunk(2, dim=0)
            out[f"{pre}{e}.gate_proj.weight"] = gate
            out[f"{pre}{e}.up_proj.weight"] = up
        return out
    if name.endswith("mlp.experts.down_proj"):
        pre = name[: -len("down_proj")]
        return {f"{pre}{e}.down_proj.weight": t[e] for e in range(t.shape[0])}
    return {name: t}


def recurrent_delta_rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
                         use_qk_l2norm_in_kernel=False, **_kw):
    """The gated delta rule token by token, autograd-friendly (no in-place writes, no triangular solves).

    Why: transformers' CPU fallback for prefill (``torch_chunk_gated_delta_rule``) spent a third of a profiled
    training step in ``linalg_solve_triangular``; a plain loop over tokens has no triangular solve.
    """
    dtype = query.dtype
    nk, nv = key.shape[2], value.shape[2]
    if nk != nv:
        query = query.repeat_interleave(nv // nk, dim=2)
        key = key.repeat_interleave(nv // nk, dim=2)
    q, k, v, b, d = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q, k = F.normalize(q, dim=-1, eps=1e-6), F.normalize(k, dim=-1, eps=1e-6)
    q = q / (q.shape[-1] ** 0.5)
    bsz, heads, seq, dk = k.shape
    state = (initial_state.float() if initial_state is not None
             else torch.zeros(bsz, heads, dk, v.shape[-1], dtype=torch.float32))
    # unbind once: indexing a token per step would make autograd zero-fill a full-size gradient per step
    qs, ks, vs = q.unbind(2), k.unbind(2), v.unbind(2)
    bs, ds = b.unsqueeze(-1).unbind(2), d.exp()[..., None, None].unbind(2)
    outs = []
    for i in range(seq):
        state = state * ds[i]
        kv_mem = torch.einsum("bhkv,bhk->bhv", state, ks[i])
        delta = (vs[i] - kv_mem) * bs[i]
        state = state + ks[i][..., None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, qs[i]))
    out = torch.stack(outs, dim=2).transpose(1, 2).contiguous().to(dtype)
    return out, (state if output_final_state else None)


def trained_tensors(model: nn.Module, mtp: MTPHead) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        out.update(_unfuse(name, t))
    out.update(mtp.checkpoint_tensors())
    return out


class Trainer:
    """Holds the two modules, the optimizer and the rotary hook; ``losses`` runs one differentiable forward."""

    def __init__(self, path: Path, lr: float, chain: int) -> None:
        import transformers
        from safetensors.torch import load_file
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

        self._hf = hf
        self.model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        self.model.train()
        cfg = self.model.config
        full_idx = cfg.layer_types.index("full_attention")
        self.mtp = MTPHead(cfg, hf.Qwen3_5MoeDecoderLayer, hf.Qwen3_5MoeRMSNorm, full_idx)
        self.mtp.load_checkpoint(load_file(str(path / "model.safetensors")))
        self.mtp.train()
        self.chain = chain
        self._pos_emb = None
        self.model.model.rotary_emb.register_forward_hook(self._keep_rope)
        params = list(self.model.parameters()) + list(self.mtp.parameters())
        self.opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        self.params = params

    def _keep_rope(self, _module, _inputs, output) -> None:
        self._pos_emb = output  # the main model's (cos, sin) for this batch: the MTP uses the same positions

    def losses(self, batch: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """(main CE, [MTP CE per chain depth], [MTP top-1 accuracy per depth]) on ``batch`` [B, T]."""
        chunked = self._hf.torch_chunk_gated_delta_rule  # the module global a DeltaNet layer calls for T > 1
        self._hf.torch_chunk_gated_delta_rule = recurrent_delta_rule  # only for this forward: tests share the module
        try:
            out = self.model.model(input_ids=batch, use_cache=False)
        finally:
            self._hf.torch_chunk_gated_delta_rule = chunked
        h = out.last_hidden_state  # final-normed: what the head sees and what the runtime feeds the MTP
        logits = self.model.lm_head(h[:, :-1])
        main = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        embed = self.model.model.embed_tokens
        cos, sin = self._pos_emb
        mtp_losses, accs = [], []
        hid = h
        for d in range(1, self.chain + 1):
            # depth d at position t: hidden from depth d-1 at t, embedding of x_{t+d}, target x_{t+d+1}
            n = batch.shape[1] - d
            u = self.mtp(hid[:, :n], embed(batch[:, d:d + n]), (cos[:, :n], sin[:, :n]))
            lg = self.model.lm_head(u[:, : n - 1])
            tgt = batch[:, d + 1:d + n]
            mtp_losses.append(F.cross_entropy(lg.flatten(0, 1), tgt.flatten()))
            accs.append((lg.argmax(-1) == tgt).float().mean().detach())
            hid = u
        return main, mtp_losses, accs


def _batches(ids: torch.Tensor, batch: int, seq: int, g: torch.Generator):
    while True:
        starts = torch.randint(0, len(ids) - seq - 1, (batch,), generator=g)
        yield torch.stack([ids[s:s + seq] for s in starts.tolist()])


def _eval(tr: Trainer, val: torch.Tensor, batch: int, seq: int) -> dict:
    g = torch.Generator().manual_seed(1234)
    it = _batches(val, batch, seq, g)
    tr.model.eval(), tr.mtp.eval()
    rows = []
    with torch.no_grad():
        for _ in range(4):
            main, mtp, acc = tr.losses(next(it))
            rows.append((float(main), [float(m) for m in mtp], [float(a) for a in acc]))
    tr.model.train(), tr.mtp.train()
    n = len(rows)
    return {"main_loss": sum(r[0] for r in rows) / n,
            "mtp_loss": [sum(r[1][d] for r in rows) / n for d in range(tr.chain)],
            "mtp_top1": [sum(r[2][d] for r in rows) / n for d in range(tr.chain)]}


def save_checkpoint(tr: Trainer, out: Path) -> None:
    """Overwrite ``out/model.safetensors`` with the trained weights: same names, shapes and dtype as made."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from sangama_p2p.errors import CheckpointError

    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        made = {k: (tuple(f.get_slice(k).get_shape()), f.get_slice(k).get_dtype()) for k in f.keys()}
    tensors = {k: v.detach().contiguous() for k, v in trained_tensors(tr.model, tr.mtp).items()}
    if set(tensors) != set(made):
        extra = sorted(set(tensors) - set(made))[:5]
        raise CheckpointError(f"tensor names differ from the made checkpoint: extra {extra}, "
                              f"missing {sorted(set(made) - set(tensors))[:5]}")
    for k, t in tensors.items():
        if tuple(t.shape) != made[k][0]:
            raise CheckpointError(f"{k}: trained shape {tuple(t.shape)} != made {made[k][0]}")
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, out / "model.safetensors")


def check_runtime(out: Path, prompt: str, n: int) -> dict:
    """Our runtime loads the trained checkpoint and generates greedily; guesses must not change the tokens."""
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    ck = open_checkpoint(out)
    chain = LocalChain.load(ck, [LayerRange(0, ck.spec.num_layers)])
    ids = ck.tokenizer.encode(prompt)
    plain = chain.generate(ids, n, guesses=0, stop_at_eos=False)
    guessed = chain.generate(ids, n, guesses=4, stop_at_eos=False)
    return {"prompt": prompt, "text": plain.text, "same_tokens_with_guesses": plain.tokens == guessed.tokens,
            "tokens_per_step_k4": round(guessed.tokens_per_step, 3),
            "acceptance_by_position_k4": [round(a, 3) for a in guessed.accepted_at]}


def train(args: argparse.Namespace) -> dict:
    from sangama_p2p.model.make import make_model
    from sangama_p2p.model.tokenizer import Tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    make_model(out, "qwen3_5_moe", args.preset, seed=args.seed)
    tok = Tokenizer.from_dir(out)
    t0 = time.perf_counter()
    text, files = stdlib_text(args.max_chars)
    ids = tokenize(tok, text)
    n_val = max(len(ids) // 20, args.seq * 8)
    train_ids, val_ids = ids[:-n_val], ids[-n_val:]
    print(f"corpus: {files} stdlib files, {len(text)} chars, {len(ids)} tokens ({time.perf_counter() - t0:.1f} s)")
    tr = Trainer(out, args.lr, args.mtp_chain)
    n_params = sum(p.numel() for p in tr.params)
    print(f"model: qwen3_5_moe/{args.preset}, {n_params / 1e6:.1f} M parameters (main + MTP)")
    before = _eval(tr, val_ids, args.batch, args.seq)
    g = torch.Generator().manual_seed(args.seed)
    it = _batches(train_ids, args.batch, args.seq, g)
    budget = args.minutes * 60.0
    warmup = 20
    curve, step, t_start = [], 0, time.perf_counter()
    print(f"{'step':>6} {'time s':>7} {'main loss':>9} " + " ".join(f"{'mtp' + str(d + 1) + ' loss':>9}"
                                                               for d in range(args.mtp_chain)) + f" {'tok/s':>7}")
    while time.perf_counter() - t_start < budget and (not args.max_steps or step < args.max_steps):
        frac = (time.perf_counter() - t_start) / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))
        for grp in tr.opt.param_groups:
            grp["lr"] = lr
        main, mtp, acc = tr.losses(next(it))
        loss = main + sum(w * m for w, m in zip((1.0, 0.5, 0.25, 0.125), mtp))
        tr.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(tr.params, 1.0)
        tr.opt.step()
        step += 1
        if step == 1 or step % args.log_every == 0:
            el = time.perf_counter() - t_start
            row = {"step": step, "seconds": round(el, 1), "main_loss": round(main.item(), 4),
                   "mtp_loss": [round(m.item(), 4) for m in mtp], "mtp_top1": [round(float(a), 3) for a in acc],
                   "lr": lr}
            curve.append(row)
            tps = step * args.batch * args.seq / el
            print(f"{step:>6} {el:>7.1f} {row['main_loss']:>9.3f} "
                  + " ".join(f"{m:>9.3f}" for m in row["mtp_loss"]) + f" {tps:>7.0f}", flush=True)
    seconds = time.perf_counter() - t_start
    after = _eval(tr, val_ids, args.batch, args.seq)
    save_checkpoint(tr, out)
    check = check_runtime(out, "def read_config(path):\n    ", 32)
    return {"preset": args.preset, "out": str(out), "params_millions": round(n_params / 1e6, 2), "steps": step,
            "train_seconds": round(seconds, 1), "tokens_seen": step * args.batch * args.seq,
            "train_tokens_per_s": round(step * args.batch * args.seq / seconds, 1),
            "corpus": {"files": files, "chars": len(text), "tokens": len(ids), "val_tokens": n_val},
            "val_before": before, "val_after": after, "curve": curve, "runtime_check": check}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small", choices=["tiny", "small"])
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--out", default=None, help="checkpoint directory (default /tmp/sangama-trained-<preset>)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3 tiny, 1e-3 small)")
    ap.add_argument("--mtp-chain", type=int, default=2, choices=[1, 2, 3])
    ap.add_argument("--max-chars", type=int, default=8_000_000)
    ap.add_argument("--max-steps", type=int, default=0, help="stop after this many steps (0: only --minutes)")
    ap.add_argument("--log-every", type=int, default=20)
    ap.add_argument("--json", default=None, help="results file (default benchmarks/results/train_tiny.json)")
    args = ap.parse_args()
    args.out = args.out or f"/tmp/sangama-trained-{args.preset}"
    args.lr = args.lr or (3e-3 if args.preset == "tiny" else 1e-3)
    load0 = os.getloadavg()
    res = train(args)
    res["meta"] = {"threads": args.threads, "batch": args.batch, "seq": args.seq, "lr": args.lr,
                   "mtp_chain": args.mtp_chain, "seed": args.seed, "minutes": args.minutes,
                   "loadavg_start": [round(x, 2) for x in load0],
                   "loadavg_end": [round(x, 2) for x in os.getloadavg()], "torch": torch.__version__,
                   "machine": platform.machine(), "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                            time.gmtime())}
    b, a = res["val_before"], res["val_after"]
    print(f"\nvalidation   main loss {b['main_loss']:.3f} -> {a['main_loss']:.3f}   "
          + "   ".join(f"mtp{d + 1} loss {b['mtp_loss'][d]:.3f} -> {a['mtp_loss'][d]:.3f} "
                       f"(top-1 {a['mtp_top1'][d]:.2f})" for d in range(len(a["mtp_loss"]))))
    c = res["runtime_check"]
    print(f"runtime check: greedy tokens equal with 4 guesses: {c['same_tokens_with_guesses']}, "
          f"tokens/step {c['tokens_per_step_k4']}, acceptance by position {c['acceptance_by_position_k4']}")
    print(f"sample: {c['prompt']!r} -> {c['text']!r}")
    path = Path(args.json) if args.json else RESULTS / "train_tiny.json"
    path.parent.mkdir(exist_ok=True)
    runs = json.loads(path.read_text()).get("runs", {}) if path.is_file() else {}
    runs[f"{args.preset}-{args.minutes:g}min"] = res
    path.write_text(json.dumps({"runs": runs}, indent=2) + "\n")
    print(f"wrote {path}; checkpoint in {args.out}")


if __name__ == "__main__":
    main()
