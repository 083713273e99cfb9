"""GGUF metadata -> a Hugging Face style config dict -> :class:`ModelSpec`, and back for the writer.

Going through the HF config keeps one normalisation path (``ModelSpec.from_hf_config``) for every checkpoint format.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...errors import CheckpointError, UnsupportedModelError
from ..spec import FULL, LINEAR, ModelSpec
from .reader import GGUFFile
from .transforms import GGUF_ARCHES

__all__ = ["hf_config_from_gguf", "spec_from_gguf"]


def _f32(value: Any) -> float:
    """GGUF stores floats as float32; give back the shortest decimal (9.99999997e-07 -> 1e-06)."""
    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


def _ids(f: GGUFFile, cfg: dict[str, Any]) -> None:
    keys = (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("padding_token_id", "pad_token_id"))
    for key, hf in keys:
        v = f.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)


def hf_config_from_gguf(f: GGUFFile) -> dict[str, Any]:
    """Build the HF ``config.json`` dict the GGUF was converted from (as far as the metadata tells)."""
    arch = f.architecture
    if arch not in GGUF_ARCHES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(sorted(GGUF_ARCHES))})"
        )
    a = arch + "."
    try:
        hidden = int(f.require(a + "embedding_length"))
        heads = int(f.require(a + "attention.head_count"))
        kv = int(f.get(a + "attention.head_count_kv", heads))
        head_dim = int(f.get(a + "attention.key_length", hidden // heads))
        blocks = int(f.require(a + "block_count"))
        nextn = int(f.get(a + "nextn_predict_layers", 0))
        n_layers = blocks - nextn
        emb = f.tensors.get("token_embd.weight")
        if emb is None:
            raise CheckpointError(f"{f.path} lacks token_embd.weight")
        vocab = int(f.get(a + "vocab_size", emb.shape[0]))
        rope_dims = int(f.get(a + "rope.dimension_count", head_dim))
        cfg: dict[str, Any] = {
            "vocab_size": vocab,
            "hidden_size": hidden,
            "num_hidden_layers": n_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "head_dim": head_dim,
            "rms_norm_eps": _f32(f.require(a + "attention.layer_norm_rms_epsilon")),
            "max_position_embeddings": int(f.get(a + "context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in f.tensors,
            "hidden_act": "silu",
        }
        rope = {"rope_theta": _f32(f.get(a + "rope.freq_base", 10000.0)), "rope_type": "default"}
        _ids(f, cfg)
        if arch == "llama":
            if "rope_freqs.weight" in f.tensors or f.get(a + "rope.scaling.type") not in (None, "none"):
                raise UnsupportedModelError("GGUF llama with RoPE scaling (rope_freqs) is not supported yet")
            cfg.update(model_type="llama", intermediate_size=int(f.require(a + "feed_forward_length")),
                       rope_parameters=rope, attention_bias="blk.0.attn_q.bias" in f.tensors)
            return cfg
        nv = int(f.require(a + "ssm.time_step_rank"))
        recurrent = f.get(a + "attention.recurrent_layers")
        if recurrent is not None:
            layer_types = [LINEAR if r else FULL for r in list(recurrent)[:n_layers]]
        else:
            interval = int(f.get(a + "full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n_layers)]
        rope["partial_rotary_factor"] = rope_dims / head_dim
        cfg.update(
            model_type="qwen3_5_moe_text",
            layer_types=layer_types,
            rope_parameters=rope,
            linear_conv_kernel_dim=int(f.require(a + "ssm.conv_kernel")),
            linear_key_head_dim=int(f.require(a + "ssm.state_size")),
            linear_num_key_heads=int(f.require(a + "ssm.group_count")),
            linear_num_value_heads=nv,
            linear_value_head_dim=int(f.require(a + "ssm.inner_size")) // nv,
            num_experts=int(f.require(a + "expert_count")),
            num_experts_per_tok=int(f.require(a + "expert_used_count")),
            moe_intermediate_size=int(f.require(a + "expert_feed_forward_length")),
            shared_expert_intermediate_size=int(f.get(a + "expert_shared_feed_forward_length", 0)),
            mtp_num_hidden_layers=nextn,
        )
        return cfg
    except (TypeError, ValueError, ZeroDivisionError) as exc:
        raise CheckpointError(f"bad metadata value in {f.path}: {exc}") from exc


def spec_from_gguf(f: GGUFFile) -> ModelSpec:
    return ModelSpec.from_hf_config(hf_config_from_gguf(f))
