"""GGUF metadata -> a Hugging Face style config dict -> :class:`ModelSpec`, and back for the writer.

Going through the HF config keeps one normalisation path (``ModelSpec.from_hf_config``) for every checkpoint format.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from ...errors import CheckpointError, UnsupportedModelError, translate
from ..spec import FULL, LINEAR, ModelSpec
from .reader import GGUFFile
from .transforms import GGUF_ARCHES

__all__ = ["decoder_depth", "hf_config_from_gguf", "spec_from_gguf"]


def _f32(value: Any) -> float:
    """GGUF stores floats as float32; give back the shortest decimal (9.99999997e-07 -> 1e-06)."""
    return float(repr(np.float32(value)).removeprefix("np.float32(").removesuffix(")"))


def _ids(f: GGUFFile, cfg: dict[str, Any]) -> None:
    keys = (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"), ("padding_token_id", "pad_token_id"))
    for key, hf in keys:
        v = f.get(f"tokenizer.ggml.{key}")
        if v is not None:
            cfg[hf] = int(v)


def decoder_depth(metadata: Mapping[str, Any]) -> int:
    """The model's decoder layers from a GGUF's metadata alone: ``block_count`` less the MTP (nextn) blocks that
    llama.cpp counts among them. KeyError/TypeError/ValueError where the metadata does not say."""
    arch = metadata["general.architecture"]
    return int(metadata[f"{arch}.block_count"]) - int(metadata.get(f"{arch}.nextn_predict_layers", 0))


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
        f.require(a + "block_count")
        nextn = int(f.get(a + "nextn_predict_layers", 0))
        n_layers = decoder_depth(f.metadata)
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
        if arch != "qwen35moe":
            if rope_dims != head_dim:
                rope["partial_rotary_factor"] = rope_dims / head_dim
            _dense(f, arch, cfg, rope)
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
        raise translate(exc, CheckpointError, f"bad metadata value in {f.path}")


def _dense(f: GGUFFile, arch: str, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    """llama, qwen2, qwen3, qwen3moe: the keys beyond the common ones."""
    a = arch + "."
    kind = f.get(a + "rope.scaling.type")
    if kind == "linear":
        rope.update(rope_type="linear", factor=_f32(f.require(a + "rope.scaling.factor")))
    elif kind not in (None, "none"):
        raise UnsupportedModelError(f"{f.path}: RoPE scaling {kind!r} is not supported (supported: none, linear, "
                                    "and llama3 as a rope_freqs tensor)")
    blk0 = {n.removeprefix("blk.0.") for n in f.tensors if n.startswith("blk.0.")}
    cfg.update(model_type=GGUF_ARCHES[arch], intermediate_size=int(f.require(a + "feed_forward_length")),
               rope_parameters=rope, attention_bias="attn_q.bias" in blk0)
    if arch == "llama":
        cfg["mlp_bias"] = "ffn_gate.bias" in blk0
    if arch == "qwen3moe":
        # llama.cpp always renormalises qwen3moe's top-k router weights (build_moe_ffn with norm_w = true)
        cfg.update(num_experts=int(f.require(a + "expert_count")),
                   num_experts_per_tok=int(f.require(a + "expert_used_count")),
                   moe_intermediate_size=int(f.require(a + "expert_feed_forward_length")), norm_topk_prob=True)


def spec_from_gguf(f: GGUFFile) -> ModelSpec:
    """The spec of a GGUF file, with llama.cpp's ``rope_freqs`` tensor (the per-frequency divisors its converter
    writes for llama3 RoPE scaling) as ``rope_freq_factors``."""
    spec = ModelSpec.from_hf_config(hf_config_from_gguf(f))
    info = f.tensors.get("rope_freqs.weight")
    if info is None:
        return spec
    if spec.arch == "qwen3_5_moe" or spec.rope_linear is not None:
        raise UnsupportedModelError(f"{f.path}: a rope_freqs tensor with {spec.arch} / linear RoPE scaling is not "
                                    "supported")
    if info.is_quantized or info.shape != (spec.rotary_dim // 2,):
        raise CheckpointError(f"{f.path}: rope_freqs has shape {list(info.shape)} ({info.type_name}); expected "
                              f"[{spec.rotary_dim // 2}] floats")
    factors = tuple(float(x) for x in f.read("rope_freqs.weight").float().tolist())
    if not all(x > 0 for x in factors):
        raise CheckpointError(f"{f.path}: rope_freqs holds a factor <= 0")
    return dataclasses.replace(spec, rope_freq_factors=factors)
