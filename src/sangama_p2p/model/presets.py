"""Shapes of the tiny and small models that the project makes itself (see :mod:`.make`).

A preset is a frozen dataclass of architecture numbers. :func:`hf_config` turns one into the exact ``config.json``
dict that transformers 5.24 writes for that config class (``save_pretrained`` of a model), so the checkpoint is
indistinguishable from one transformers made - without importing transformers here.

Sizes:
- ``qwen3_5_moe/tiny``: a decode step in milliseconds; the shape the runtime tests use.
- ``llama/tiny``: hidden 256, 6 layers, 4 heads, intermediate 512, vocab 1000 - the exact model Petals was measured
  on (the "Petals anchor"); keep it.
- ``qwen2/tiny`` (tied head, as Qwen2.5's small models), ``qwen3/tiny`` (head_dim 64 > hidden / heads, as Qwen3),
  ``qwen3_moe/tiny`` (8 experts, top-2, no shared expert): hidden 64-128, 6 layers, vocab 1024.
- ``qwen3_5_moe/mid``: hidden 2048, 48 layers, 128 experts top-8 (narrow experts): the GPU benchmark's model.
- ``*/small``: sized so one decode step costs roughly 20-50 ms on one CPU process (a realistic benchmark load;
  measured 2026-12-01, one thread, whole model, fp32: llama 34 ms, qwen2 33 ms, qwen3 39 ms, qwen3_moe 25 ms).
- ``<dense arch>/micro``: hidden 32, 4 layers, vocab 384 - the checkpoints behind the converter-made GGUF test files
  (``tests/data/gguf-arch``); every quantizable row is a multiple of 32, so Q8_0 applies to all of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Union

from ..errors import UnsupportedModelError

__all__ = [
    "PRESETS", "DensePreset", "LlamaPreset", "Preset", "QwenMoePreset", "get_preset", "hf_config", "with_options",
]

TRANSFORMERS_VERSION = "5.24.0"  # the version whose config.json layout we reproduce


@dataclasses.dataclass(frozen=True)
class QwenMoePreset:
    """A Qwen3.5-MoE text model (hybrid Gated DeltaNet + gated attention, MoE in every layer, one MTP layer)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    full_attention_interval: int = 4
    linear_conv_kernel_dim: int = 4
    partial_rotary_factor: float = 0.25
    rope_theta: float = 10000000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    mtp_num_hidden_layers: int = 1

    arch = "qwen3_5_moe"

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.num_hidden_layers)]


@dataclasses.dataclass(frozen=True)
class DensePreset:
    """Llama, Qwen2, Qwen3 (full attention, SwiGLU MLP) and Qwen3-MoE (the same with a sparse MoE in every layer)."""

    arch: str  # llama | qwen2 | qwen3 | qwen3_moe
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    # rope scaling as sorted (key, value) pairs of transformers' rope_parameters, e.g. (("factor", 4.0),
    # ("rope_type", "linear")); () = plain RoPE
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    # qwen3_moe only
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True

    @property
    def qk_norm(self) -> bool:
        return self.arch in ("qwen3", "qwen3_moe")

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"


LlamaPreset = DensePreset  # the name the first dense architecture had


Preset = Union[QwenMoePreset, DensePreset]

PRESETS: dict[str, dict[str, Preset]] = {
    "qwen3_5_moe": {
        "tiny": QwenMoePreset(
            vocab_size=1024,
            hidden_size=64,
            num_hidden_layers=8,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
        ),
        "small": QwenMoePreset(
            vocab_size=2048,
            hidden_size=512,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            num_experts=64,
            num_experts_per_tok=4,
            moe_intermediate_size=256,
            shared_expert_intermediate_size=512,
        ),
        # the routing shape of Qwen3.5-35B-A3B (hidden 2048, 48 layers, 128 experts, top-8) with narrow experts, so
        # that it makes in minutes: 4.07e9 parameters, 8.1 GB in bfloat16; for benchmarks/gpu_check.sh
        "mid": QwenMoePreset(
            vocab_size=8192,
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=2,
            head_dim=128,
            linear_num_key_heads=16,
            linear_num_value_heads=32,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=512,
        ),
    },
    "llama": {
        "tiny": DensePreset("llama", vocab_size=1000, hidden_size=256, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=4, intermediate_size=512, head_dim=64),
        "small": DensePreset("llama", vocab_size=2048, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                             num_key_value_heads=4, intermediate_size=1536, head_dim=64),
        "micro": DensePreset("llama", vocab_size=384, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, head_dim=8, rope_theta=5e5),
    },
    "qwen2": {  # Qwen2.5's small models tie the head to the embedding
        "tiny": DensePreset("qwen2", vocab_size=1024, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, head_dim=32, rope_theta=1e6,
                            max_position_embeddings=4096, tie_word_embeddings=True),
        "small": DensePreset("qwen2", vocab_size=2048, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                             num_key_value_heads=2, intermediate_size=1536, head_dim=64, rope_theta=1e6,
                             max_position_embeddings=4096, tie_word_embeddings=True),
        "micro": DensePreset("qwen2", vocab_size=384, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, head_dim=8, rope_theta=1e6,
                             tie_word_embeddings=True),
    },
    "qwen3": {  # head_dim larger than hidden / heads, as in Qwen3-0.6B (1024 / 16 heads, head_dim 128)
        "tiny": DensePreset("qwen3", vocab_size=1024, hidden_size=128, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=256, head_dim=64, rope_theta=1e6,
                            max_position_embeddings=4096),
        "small": DensePreset("qwen3", vocab_size=2048, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                             num_key_value_heads=4, intermediate_size=1536, head_dim=128, rope_theta=1e6,
                             max_position_embeddings=4096),
        "micro": DensePreset("qwen3", vocab_size=384, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, head_dim=16, rope_theta=1e6),
    },
    "qwen3_moe": {
        "tiny": DensePreset("qwen3_moe", vocab_size=1024, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                            num_key_value_heads=2, intermediate_size=128, head_dim=32, rope_theta=1e6,
                            max_position_embeddings=4096, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=64),
        "small": DensePreset("qwen3_moe", vocab_size=2048, hidden_size=512, num_hidden_layers=12,
                             num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024, head_dim=64,
                             rope_theta=1e6, max_position_embeddings=4096, num_experts=64, num_experts_per_tok=4,
                             moe_intermediate_size=256),
        "micro": DensePreset("qwen3_moe", vocab_size=384, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                             num_key_value_heads=2, intermediate_size=64, head_dim=8, rope_theta=1e6, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32),
    },
}


def get_preset(arch: str, preset: str) -> Preset:
    """The preset ``preset`` of ``arch``; a typed error names the known ones."""
    presets = PRESETS.get(arch)
    if presets is None:
        raise UnsupportedModelError(f"cannot make a model of architecture {arch!r}; known: {', '.join(PRESETS)}")
    found = presets.get(preset)
    if found is None:
        raise UnsupportedModelError(f"no preset {preset!r} for {arch}; known: {', '.join(presets)}")
    return found


def hf_config(p: Preset, *, eos_token_id: int, pad_token_id: int, dtype: str) -> dict[str, Any]:
    """The ``config.json`` dict transformers writes for this preset (same keys, same defaults)."""
    if isinstance(p, QwenMoePreset):
        cfg: dict[str, Any] = {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "attention_bias": False,
            "attention_dropout": 0.0,
            "bos_token_id": None,
            "dtype": dtype,
            "eos_token_id": eos_token_id,
            "head_dim": p.head_dim,
            "hidden_act": "silu",
            "hidden_size": p.hidden_size,
            "initializer_range": 0.02,
            "layer_types": p.layer_types,
            "linear_conv_kernel_dim": p.linear_conv_kernel_dim,
            "linear_key_head_dim": p.linear_key_head_dim,
            "linear_num_key_heads": p.linear_num_key_heads,
            "linear_num_value_heads": p.linear_num_value_heads,
            "linear_value_head_dim": p.linear_value_head_dim,
            "max_position_embeddings": p.max_position_embeddings,
            "model_type": "qwen3_5_moe_text",
            "moe_intermediate_size": p.moe_intermediate_size,
            "mtp_num_hidden_layers": p.mtp_num_hidden_layers,
            "mtp_use_dedicated_embeddings": False,
            "num_attention_heads": p.num_attention_heads,
            "num_experts": p.num_experts,
            "num_experts_per_tok": p.num_experts_per_tok,
            "num_hidden_layers": p.num_hidden_layers,
            "num_key_value_heads": p.num_key_value_heads,
            "output_router_logits": False,
            "pad_token_id": pad_token_id,
            "rms_norm_eps": p.rms_norm_eps,
            "rope_parameters": {
                "partial_rotary_factor": p.partial_rotary_factor,
                "rope_theta": p.rope_theta,
                "rope_type": "default",
            },
            "router_aux_loss_coef": 0.001,
            "shared_expert_intermediate_size": p.shared_expert_intermediate_size,
            "tie_word_embeddings": False,
            "transformers_version": TRANSFORMERS_VERSION,
            "use_cache": True,
            "vocab_size": p.vocab_size,
        }
        return cfg
    return _dense_config(p, eos_token_id=eos_token_id, pad_token_id=pad_token_id, dtype=dtype)


_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM"}


def _dense_config(p: DensePreset, *, eos_token_id: int, pad_token_id: int, dtype: str) -> dict[str, Any]:
    """Llama/Qwen2/Qwen3/Qwen3-MoE ``config.json`` as transformers 5.24's ``save_pretrained`` writes it."""
    rope: dict[str, Any] = {"rope_theta": p.rope_theta, "rope_type": "default"}
    rope.update(dict(p.rope_scaling))
    cfg: dict[str, Any] = {
        "architectures": [_CLASSES[p.arch]],
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "dtype": dtype,
        "eos_token_id": eos_token_id,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "hidden_size": p.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": p.intermediate_size,
        "max_position_embeddings": p.max_position_embeddings,
        "model_type": p.arch,
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "pad_token_id": pad_token_id,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_parameters": dict(sorted(rope.items())),
        "tie_word_embeddings": p.tie_word_embeddings,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": p.vocab_size,
    }
    if p.arch == "llama":
        cfg.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    else:  # the Qwen configs' sliding-window keys (off)
        cfg.update(max_window_layers=28, sliding_window=None, use_sliding_window=False)
        if p.arch != "qwen2":
            cfg["attention_bias"] = False
        if p.arch != "qwen3_moe":
            cfg["layer_types"] = ["full_attention"] * p.num_hidden_layers
    if p.arch == "qwen3_moe":
        del cfg["max_window_layers"]
        cfg.update(decoder_sparse_step=1, mlp_only_layers=[], moe_intermediate_size=p.moe_intermediate_size,
                   norm_topk_prob=p.norm_topk_prob, num_experts_per_tok=p.num_experts_per_tok,
                   num_local_experts=p.num_experts, output_router_logits=False, router_aux_loss_coef=0.001)
    return dict(sorted(cfg.items()))


def with_options(p: Preset, *, tie_word_embeddings: bool | None = None,
                 rope_scaling: Mapping[str, Any] | None = None) -> Preset:
    """``p`` with its head tied to the embedding or not, and with RoPE scaling (transformers' rope_parameters keys
    besides rope_theta, e.g. ``{"rope_type": "linear", "factor": 4.0}``); only for the dense presets."""
    if tie_word_embeddings is None and rope_scaling is None:
        return p
    if not isinstance(p, DensePreset):
        raise UnsupportedModelError(f"{p.arch} checkpoints are made with their preset's head and RoPE only")
    changes: dict[str, Any] = {}
    if tie_word_embeddings is not None:
        changes["tie_word_embeddings"] = bool(tie_word_embeddings)
    if rope_scaling is not None:
        kind = rope_scaling.get("rope_type")
        need = {"linear": {"factor"}, "llama3": {"factor", "low_freq_factor", "high_freq_factor",
                                                 "original_max_position_embeddings"}}.get(str(kind))
        if need is None or set(rope_scaling) != need | {"rope_type"}:
            raise UnsupportedModelError(
                f"RoPE scaling {dict(rope_scaling)!r} is not one the maker writes: rope_type linear (factor) or "
                "llama3 (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)"
            )
        changes["rope_scaling"] = tuple(sorted(rope_scaling.items()))
    return dataclasses.replace(p, **changes)


def generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` transformers derives from a model config."""
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    out.update(output_attentions=False, output_hidden_states=False, transformers_version=TRANSFORMERS_VERSION)
    out["use_cache"] = True
    return out
