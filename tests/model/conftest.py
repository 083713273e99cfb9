"""Checkpoints for runtime tests: written by transformers itself (random init, save_pretrained) and by make-model.

transformers is the oracle: its modeling classes compute the reference logits, never our runtime's.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Replace transformers' tiny init (std 0.02, zero norms) with one that makes logits differ visibly."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                fan_in = p.shape[-1] if not name.endswith("conv1d.weight") else p.shape[-1]
                std = 1.0 / math.sqrt(fan_in)
                if "embed_tokens" in name:
                    std = 0.5
                if "lm_head" in name:
                    std = 0.2  # logits of std ~1.5: fp32 noise stays far below the 1e-4 tolerance
                p.copy_(torch.randn(p.shape, generator=g) * std)
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(1.0, 16.0, generator=g).log())
            elif "linear_attn.norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            if "o_proj" in name or "out_proj" in name or "down_proj" in name:
                p.mul_(0.25)
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)


def qwen_config(**over):
    cfg = dict(
        vocab_size=384, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=48, max_position_embeddings=512,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    )
    cfg.update(over)
    return transformers.Qwen3_5MoeTextConfig(**cfg)


def llama_config(**over):
    cfg = dict(
        vocab_size=384, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, max_position_embeddings=512,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    cfg.update(over)
    return transformers.LlamaConfig(**cfg)


def _save_hf(path: Path, config, seed: int, **save_kw) -> Path:
    torch.manual_seed(seed)
    cls = transformers.Qwen3_5MoeForCausalLM if config.model_type.startswith("qwen") else transformers.LlamaForCausalLM
    model = cls(config).eval()
    _randomize(model, seed)
    model.save_pretrained(path, **save_kw)
    return path


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Named checkpoint directories, built once per test session."""
    from sangama_p2p.model.make import make_model, truncate_vocab

    root = tmp_path_factory.mktemp("ckpt")
    made_qwen = make_model(root / "made-qwen", "qwen3_5_moe", "tiny", seed=4)
    return {
        "hf-qwen": _save_hf(root / "hf-qwen", qwen_config(), 1),
        "hf-qwen-sharded": _save_hf(root / "hf-qwen-sharded", qwen_config(), 2, max_shard_size="200KB"),
        "hf-llama": _save_hf(root / "hf-llama", llama_config(), 3),
        "made-qwen": made_qwen,
        "made-qwen-v16": truncate_vocab(made_qwen, root / "made-qwen-v16", 16),
        "made-llama": make_model(root / "made-llama", "llama", "tiny", seed=5),
        "made-qwen2": make_model(root / "made-qwen2", "qwen2", "tiny", seed=6),
        "made-qwen3": make_model(root / "made-qwen3", "qwen3", "tiny", seed=7),
        "made-qwen3moe": make_model(root / "made-qwen3moe", "qwen3_moe", "tiny", seed=8),
    }


@pytest.fixture(scope="session")
def oracle():
    """transformers' own model for a checkpoint directory (cached per session)."""
    cache: dict[Path, torch.nn.Module] = {}

    def load(path: Path) -> torch.nn.Module:  # noqa: D401
        if path not in cache:
            cache[path] = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return load


@pytest.fixture(scope="session")
def reference_logits():
    """transformers' logits for a prefill of ``prefill`` tokens, then one cached decode step per remaining token."""

    def run(model: torch.nn.Module, ids: torch.Tensor, prefill: int) -> torch.Tensor:
        with torch.no_grad():
            out = model(ids[None, :prefill], use_cache=True)
            rows, cache = [out.logits[0]], out.cache
            for t in range(prefill, ids.shape[0]):
                out = model(ids[None, t:t + 1], cache=cache, use_cache=True)
                rows.append(out.logits[0])
                cache = out.cache
        return torch.cat(rows)

    return run

