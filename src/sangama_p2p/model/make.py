"""Make a random-weight model checkpoint in Hugging Face format: the project's own test and demo models.

``make_model(out_dir, arch, preset, seed)`` (arch: llama, qwen2, qwen3, qwen3_moe, qwen3_5_moe) writes
``config.json`` (the keys transformers 5.24 writes), ``generation_config.json``, ``model.safetensors`` (canonical HF
tensor names; MoE experts un-fused, one tensor per expert and projection, as the published Qwen3-MoE and Qwen3.5-MoE
checkpoints hold them; Qwen3.5-MoE's MTP layer under ``mtp.*`` in the real checkpoint layout; no ``lm_head`` when the
head is tied) and a byte-level
BPE tokenizer. Same seed, same preset -> the same bytes on every run: every tensor is drawn from one
``torch.Generator`` in a fixed order, in float32, then cast.

Random init (not transformers' init, which would make routing and outputs degenerate): projections ~ N(0, 1/fan_in),
embeddings and lm_head ~ N(0, 0.5^2), zero-centred norms ~ N(0, 0.1^2), plain norms ~ 1 + N(0, 0.1^2),
A_log = log U(1, 16), dt_bias and conv1d ~ N(0, 0.5^2). Residual-branch output projections are scaled by 0.25 and the
MoE router by 4, so that activations stay bounded and expert choice is not a coin toss between near-equal scores.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from ..errors import CheckpointError, ModelError, UnsupportedModelError, translate
from .presets import DensePreset, Preset, QwenMoePreset, generation_config, get_preset, hf_config, with_options
from .tokenizer import EOS_TOKEN, PAD_TOKEN, atomic_write, train_bpe, write_tokenizer_files

__all__ = ["DTYPES", "checkpoint_num_params", "make_model", "tensor_plan"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# init kinds: ("proj", fan_in, scale) | ("normal", std) | ("norm0",) | ("norm1",) | ("alog",)
_Init = tuple
_Plan = Iterator[tuple[str, tuple[int, ...], _Init]]

_RESIDUAL_OUT = 0.25
_ROUTER = 4.0


def _proj(name: str, out_f: int, in_f: int, scale: float = 1.0) -> tuple[str, tuple[int, ...], _Init]:
    return name, (out_f, in_f), ("proj", in_f, scale)


def _swiglu(pre: str, hidden: int, inter: int) -> _Plan:
    yield _proj(f"{pre}.gate_proj.weight", inter, hidden)
    yield _proj(f"{pre}.up_proj.weight", inter, hidden)
    yield _proj(f"{pre}.down_proj.weight", hidden, inter, _RESIDUAL_OUT)


def _qwen_attention(pre: str, p: QwenMoePreset) -> _Plan:
    h, hd = p.hidden_size, p.head_dim
    yield _proj(f"{pre}.self_attn.q_proj.weight", 2 * p.num_attention_heads * hd, h)  # query + output gate
    yield _proj(f"{pre}.self_attn.k_proj.weight", p.num_key_value_heads * hd, h)
    yield _proj(f"{pre}.self_attn.v_proj.weight", p.num_key_value_heads * hd, h)
    yield _proj(f"{pre}.self_attn.o_proj.weight", h, p.num_attention_heads * hd, _RESIDUAL_OUT)
    yield f"{pre}.self_attn.q_norm.weight", (hd,), ("norm0",)
    yield f"{pre}.self_attn.k_norm.weight", (hd,), ("norm0",)


def _qwen_linear(pre: str, p: QwenMoePreset) -> _Plan:
    h = p.hidden_size
    key_dim = p.linear_num_key_heads * p.linear_key_head_dim
    value_dim = p.linear_num_value_heads * p.linear_value_head_dim
    conv_dim = 2 * key_dim + value_dim
    nv = p.linear_num_value_heads
    la = f"{pre}.linear_attn"
    yield _proj(f"{la}.in_proj_qkv.weight", conv_dim, h)
    yield _proj(f"{la}.in_proj_z.weight", value_dim, h)
    yield _proj(f"{la}.in_proj_b.weight", nv, h)
    yield _proj(f"{la}.in_proj_a.weight", nv, h)
    yield f"{la}.conv1d.weight", (conv_dim, 1, p.linear_conv_kernel_dim), ("normal", 0.5)  # [C, 1, K] depthwise
    yield f"{la}.dt_bias", (nv,), ("normal", 0.5)
    yield f"{la}.A_log", (nv,), ("alog",)
    yield f"{la}.norm.weight", (p.linear_value_head_dim,), ("norm1",)  # gated RMSNorm: plain weight
    yield _proj(f"{la}.out_proj.weight", h, value_dim, _RESIDUAL_OUT)


def _qwen_moe(pre: str, p: QwenMoePreset) -> _Plan:
    h = p.hidden_size
    yield _proj(f"{pre}.mlp.gate.weight", p.num_experts, h, _ROUTER)
    for e in range(p.num_experts):
        yield from _swiglu(f"{pre}.mlp.experts.{e}", h, p.moe_intermediate_size)
    yield from _swiglu(f"{pre}.mlp.shared_expert", h, p.shared_expert_intermediate_size)
    yield _proj(f"{pre}.mlp.shared_expert_gate.weight", 1, h)


def _qwen_layer(pre: str, p: QwenMoePreset, layer_type: str) -> _Plan:
    yield f"{pre}.input_layernorm.weight", (p.hidden_size,), ("norm0",)
    if layer_type == "full_attention":
        yield from _qwen_attention(pre, p)
    else:
        yield from _qwen_linear(pre, p)
    yield f"{pre}.post_attention_layernorm.weight", (p.hidden_size,), ("norm0",)
    yield from _qwen_moe(pre, p)


def _qwen_plan(p: QwenMoePreset) -> _Plan:
    h = p.hidden_size
    yield "model.embed_tokens.weight", (p.vocab_size, h), ("normal", 0.5)
    for i, layer_type in enumerate(p.layer_types):
        yield from _qwen_layer(f"model.layers.{i}", p, layer_type)
    yield "model.norm.weight", (h,), ("norm0",)
    yield "lm_head.weight", (p.vocab_size, h), ("normal", 0.5)
    if p.mtp_num_hidden_layers:
        yield "mtp.pre_fc_norm_embedding.weight", (h,), ("norm0",)
        yield "mtp.pre_fc_norm_hidden.weight", (h,), ("norm0",)
        yield _proj("mtp.fc.weight", h, 2 * h)  # [H, 2H]: cat[norm_e(embed), norm_h(hidden)] -> H
        for j in range(p.mtp_num_hidden_layers):
            yield from _qwen_layer(f"mtp.layers.{j}", p, "full_attention")
        yield "mtp.norm.weight", (h,), ("norm0",)


def _dense_plan(p: DensePreset) -> _Plan:
    """Llama / Qwen2 (q/k/v biases) / Qwen3 (q/k norms) / Qwen3-MoE (q/k norms, sparse MoE, no shared expert), in
    transformers' parameter order; no ``lm_head`` when the head is tied."""
    h, hd = p.hidden_size, p.head_dim
    yield "model.embed_tokens.weight", (p.vocab_size, h), ("normal", 0.5)
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}"
        yield f"{pre}.input_layernorm.weight", (h,), ("norm1",)
        for proj, rows in (("q", p.num_attention_heads * hd), ("k", p.num_key_value_heads * hd),
                           ("v", p.num_key_value_heads * hd)):
            yield _proj(f"{pre}.self_attn.{proj}_proj.weight", rows, h)
            if p.qkv_bias:
                yield f"{pre}.self_attn.{proj}_proj.bias", (rows,), ("normal", 0.1)
        yield _proj(f"{pre}.self_attn.o_proj.weight", h, p.num_attention_heads * hd, _RESIDUAL_OUT)
        if p.qk_norm:
            yield f"{pre}.self_attn.q_norm.weight", (hd,), ("norm1",)
            yield f"{pre}.self_attn.k_norm.weight", (hd,), ("norm1",)
        yield f"{pre}.post_attention_layernorm.weight", (h,), ("norm1",)
        if p.num_experts:
            yield _proj(f"{pre}.mlp.gate.weight", p.num_experts, h, _ROUTER)
            for e in range(p.num_experts):
                yield from _swiglu(f"{pre}.mlp.experts.{e}", h, p.moe_intermediate_size)
        else:
            yield from _swiglu(f"{pre}.mlp", h, p.intermediate_size)
    yield "model.norm.weight", (h,), ("norm1",)
    if not p.tie_word_embeddings:
        yield "lm_head.weight", (p.vocab_size, h), ("normal", 0.5)


def _plan(p: Preset) -> _Plan:
    return _qwen_plan(p) if isinstance(p, QwenMoePreset) else _dense_plan(p)


def tensor_plan(p: Preset) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor the checkpoint of preset ``p`` holds, in generation order, with its shape."""
    return [(name, shape) for name, shape, _ in _plan(p)]


def _draw(shape: tuple[int, ...], init: _Init, g: torch.Generator) -> torch.Tensor:
    kind = init[0]  # in-place ops: the small presets draw hundreds of millions of numbers
    if kind == "proj":
        return torch.randn(shape, generator=g).mul_(init[2] / math.sqrt(init[1]))
    if kind == "normal":
        return torch.randn(shape, generator=g).mul_(init[1])
    if kind == "norm0":
        return torch.randn(shape, generator=g).mul_(0.1)
    if kind == "norm1":
        return torch.randn(shape, generator=g).mul_(0.1).add_(1.0)
    if kind == "alog":
        return torch.rand(shape, generator=g).mul_(15.0).add_(1.0).log_()  # log U(1, 16)
    raise ModelError(f"unknown init kind {kind!r}")  # pragma: no cover - plans only use the kinds above


def _weights(p: Preset, seed: int, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return {name: _draw(shape, init, g).to(dtype).contiguous() for name, shape, init in _plan(p)}


def _write_json(path: Path, data: dict) -> None:
    atomic_write(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_model(
    out_dir: str | Path,
    arch: str,
    preset: str = "tiny",
    seed: int = 0,
    dtype: torch.dtype | str = torch.float32,
    *,
    tie_word_embeddings: bool | None = None,
    rope_scaling: Mapping[str, Any] | None = None,
) -> Path:
    """Write a random ``arch``/``preset`` checkpoint with its tokenizer into ``out_dir``; return the directory.

    ``tie_word_embeddings`` (None: the preset's) and ``rope_scaling`` (e.g. ``{"rope_type": "linear", "factor": 4.0}``,
    see :func:`.presets.with_options`) change a dense preset; the weights drawn for the rest stay the same.
    """
    from safetensors.torch import save_file  # local: keeps importing this module cheap

    p = with_options(get_preset(arch, preset), tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling)
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise UnsupportedModelError(f"dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    dtype_name = next((k for k, v in DTYPES.items() if v == dtype), None)
    if dtype_name is None:
        raise UnsupportedModelError(f"dtype {dtype} is not supported; use one of {', '.join(DTYPES)}")
    if not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ModelError(f"seed must be an integer in [0, 2**63), got {seed!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)

    tok = train_bpe(p.vocab_size)
    eos, pad = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    cfg = hf_config(p, eos_token_id=eos, pad_token_id=pad, dtype=dtype_name)
    write_tokenizer_files(tok, out, model_max_length=p.max_position_embeddings)

    tensors = _weights(p, seed, dtype)
    tmp = out / f".model.safetensors.{os.getpid()}.tmp"  # renamed into place: readers never see half a file
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.chmod(tmp, 0o644)  # safetensors creates the file 0600; a checkpoint is meant to be shared
    os.replace(tmp, out / "model.safetensors")
    (out / "model.safetensors.index.json").unlink(missing_ok=True)  # a stale shard index would shadow the new file
    _write_json(out / "generation_config.json", generation_config(cfg))
    _write_json(out / "config.json", cfg)  # last: a directory with config.json is complete
    return out


def checkpoint_num_params(out_dir: str | Path) -> int:
    """Number of parameters in ``model.safetensors`` (read from the header only)."""
    from safetensors import safe_open

    path = Path(out_dir) / "model.safetensors"
    try:
        with safe_open(str(path), framework="pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except Exception as exc:  # safetensors raises its own error types
        raise translate(exc, CheckpointError, f"cannot read {path}")


def truncate_vocab(src: str | Path, dst: str | Path, vocab: int) -> Path:
    """A copy of checkpoint ``src`` that keeps only the first ``vocab`` rows of the embedding and the head.

    With a vocabulary of a dozen tokens, even a random model's MTP drafts match its own choices often enough to
    exercise accepted guesses; tests use it. The tokenizer is left out (its ids would not fit).
    """
    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    if vocab <= 0:
        raise ModelError(f"vocab must be positive, got {vocab}")
    dst.mkdir(parents=True)
    tensors = load_file(src / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:  # (a tied head has no lm_head)
            tensors[name] = tensors[name][:vocab].clone()
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(vocab_size=vocab, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    _write_json(dst / "config.json", cfg)
    return dst
