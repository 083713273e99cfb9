"""Shapes of the tiny and small models that the project makes itself (see :mod:`.make`).

A preset is a frozen dataclass of architecture numbers. :func:`hf_config` turns one into the exact ``config.json``
dict that transformers 5.24 writes for that config class (``save_pretrained`` of a model), so the checkpoint is
indistinguishable from one transformers made - without importing transformers here.

Sizes:
- ``qwen3_5_moe/tiny``: a decode step in milliseconds; the shape the runtime tests use.
- ``llama/tiny``: hidden 256, 6 layers, 4 heads, intermediate 512, vocab 1000 - the exact model Petals was measured
  on (the "Petals anchor"); keep it.
- ``*/small``: sized so one decode step costs roughly 20-50 ms on one CPU process (a realistic benchmark load).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Union

from ..errors import UnsupportedModelError

__all__ = ["PRESETS", "LlamaPreset", "Preset", "QwenMoePreset", "get_preset", "hf_config"]

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
class LlamaPreset:
    """A Llama model (plain RoPE, untied head)."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048

    arch = "llama"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


Preset = Union[QwenMoePreset, LlamaPreset]

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
    },
    "llama": {
        "tiny": LlamaPreset(
            vocab_size=1000,
            hidden_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=512,
        ),
        "small": LlamaPreset(
            vocab_size=2048,
            hidden_size=512,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1536,
        ),
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
    return {
        "architectures": ["LlamaForCausalLM"],
        "attention_bias": False,
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
        "mlp_bias": False,
        "model_type": "llama",
        "num_attention_heads": p.num_attention_heads,
        "num_hidden_layers": p.num_hidden_layers,
        "num_key_value_heads": p.num_key_value_heads,
        "pad_token_id": pad_token_id,
        "pretraining_tp": 1,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_parameters": {"rope_theta": p.rope_theta, "rope_type": "default"},
        "tie_word_embeddings": False,
        "transformers_version": TRANSFORMERS_VERSION,
        "use_cache": True,
        "vocab_size": p.vocab_size,
    }


def generation_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The ``generation_config.json`` transformers derives from a model config."""
    out: dict[str, Any] = {"_from_model_config": True}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    out.update(output_attentions=False, output_hidden_states=False, transformers_version=TRANSFORMERS_VERSION)
    out["use_cache"] = True
    return out
