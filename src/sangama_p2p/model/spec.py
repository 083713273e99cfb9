"""A model's shape, normalised from a Hugging Face ``config.json`` (or GGUF metadata turned into one).

:class:`ModelSpec` is the one description of a model that the runtime, the loaders, the tiny-model maker and the
network records share. It is frozen and holds plain numbers only.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

from ..errors import CheckpointError, LayerRangeError, UnsupportedModelError, translate

__all__ = ["ARCHITECTURES", "ModelSpec", "LayerRange", "parse_auto_span", "parse_layer_range", "parse_stages"]

FULL = "full_attention"
LINEAR = "linear_attention"

# config.json model_type -> our architecture name
_MODEL_TYPES = {
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "llama": "llama",
    "mistral": "llama",  # MistralForCausalLM without a sliding window is a Llama
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3_moe", "qwen3_5_moe")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Normalised architecture parameters. Field names follow transformers' config where one exists."""

    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rotary_dim: int  # leading dims of each head that RoPE rotates (partial rotary)
    layer_types: tuple[str, ...]
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    # RoPE scaling (at most one is set; all None = plain RoPE). llama3: (factor, low_freq_factor, high_freq_factor,
    # original_max_position); linear: the factor positions are divided by; freq_factors: one divisor per rotary pair
    # (GGUF's ``rope_freqs`` tensor, which llama.cpp's converter writes for llama3 scaling)
    rope_llama3: tuple[float, float, float, int] | None = None
    rope_linear: float | None = None
    rope_freq_factors: tuple[float, ...] | None = None
    # dense MLP (llama, qwen2, qwen3)
    intermediate_size: int = 0
    attention_bias: bool = False  # q/k/v projections have biases
    o_proj_bias: bool = False  # the output projection has a bias (llama and qwen3 with attention_bias; not qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each q and k head before RoPE (qwen3, qwen3_moe, qwen3_5_moe)
    # qwen3.5: gated attention, zero-centred norms (weight applied as 1 + w)
    attn_output_gate: bool = False
    zero_centered_norm: bool = False
    # qwen3.5: Gated DeltaNet
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 0
    # qwen3.5: MoE with a gated shared expert
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router weights to sum to 1
    # qwen3.5: multi-token-prediction layers (full attention + MoE) stored under mtp.*
    mtp_num_layers: int = 0

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def attention_layers(self, start: int, end: int) -> list[int]:
        return [i for i in range(start, end) if self.layer_types[i] == FULL]

    def linear_layers(self, start: int, end: int) -> list[int]:
        return [i for i in range(start, end) if self.layer_types[i] == LINEAR]

    def check_range(self, start: int, end: int) -> None:
        if not (0 <= start < end <= self.num_layers):
            raise LayerRangeError(
                f"layer range {start}:{end} is outside the model's {self.num_layers} layers (need 0 <= start < end <= "
                f"{self.num_layers})"
            )

    # ---- constructors --------------------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelSpec":
        """Read ``config.json`` from a checkpoint directory."""
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"no config.json in {path}: not a Hugging Face checkpoint directory")
        try:
            config = json.loads(cfg_path.read_text())
        except (OSError, ValueError) as exc:
            raise translate(exc, CheckpointError, f"cannot read {cfg_path}")
        if not isinstance(config, dict):
            raise CheckpointError(f"{cfg_path} does not hold a JSON object")
        return cls.from_hf_config(config)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "ModelSpec":
        """Normalise a Hugging Face config dict (``text_config`` of a multimodal config is used when present)."""
        if "text_config" in config and isinstance(config["text_config"], Mapping):
            config = config["text_config"]
        model_type = config.get("model_type")
        arch = _MODEL_TYPES.get(str(model_type))
        if arch is None:
            raise UnsupportedModelError(
                f"unknown architecture model_type={model_type!r}; Sangama runs model types "
                f"{', '.join(sorted(_MODEL_TYPES))}"
            )
        try:
            return _BUILDERS[arch](config)
        except KeyError as exc:
            raise CheckpointError(f"config.json for {model_type} lacks required key {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise translate(exc, CheckpointError, f"config.json for {model_type} has a bad value")


def _eos(config: Mapping[str, Any]) -> tuple[int, ...]:
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, (list, tuple)):
        return tuple(int(e) for e in eos)
    return (int(eos),)


def _rope(config: Mapping[str, Any]) -> tuple[float, float, dict]:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)))
    return theta, partial, params


def _common(config: Mapping[str, Any], arch: str) -> dict[str, Any]:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    theta, partial, params = _rope(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    llama3, linear = None, None
    if rope_type == "llama3":
        llama3 = (
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params["original_max_position_embeddings"]),
        )
    elif rope_type == "linear":
        linear = float(params["factor"])
        if not linear > 0:
            raise CheckpointError(f"linear RoPE scaling factor must be positive, got {linear}")
    elif rope_type not in ("default", None):
        raise UnsupportedModelError(f"RoPE type {rope_type!r} is not supported (supported: default, linear, llama3)")
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2:
        raise UnsupportedModelError(f"rotary dimension {rotary_dim} is odd")
    n_layers = int(config["num_hidden_layers"])
    spec = dict(
        arch=arch,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rotary_dim=rotary_dim,
        rope_llama3=llama3,
        rope_linear=linear,
        max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        eos_token_ids=_eos(config),
        bos_token_id=config.get("bos_token_id"),
        pad_token_id=config.get("pad_token_id"),
    )
    if spec["num_heads"] % spec["num_kv_heads"]:
        raise CheckpointError("num_attention_heads must be a multiple of num_key_value_heads")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"activation {config.get('hidden_act')!r} is not supported (only silu)")
    return spec


def _window(config: Mapping[str, Any], spec: dict[str, Any]) -> None:
    """A sliding window (Mistral v0.1, Qwen2 with use_sliding_window) changes nothing for sequences that fit in it:
    the model is served exactly up to the window, which becomes its maximum length."""
    window = config.get("sliding_window")
    if config.get("model_type") in ("qwen2", "qwen3", "qwen3_moe") and not config.get("use_sliding_window", False):
        window = None
    if window is not None:
        spec["max_position_embeddings"] = min(spec["max_position_embeddings"], int(window))


def _dense(config: Mapping[str, Any], arch: str, **extra: Any) -> ModelSpec:
    """Llama, Qwen2, Qwen3 (full attention in every layer and a SwiGLU MLP) and Qwen3-MoE (``extra`` sets its
    experts)."""
    spec = _common(config, arch)
    _window(config, spec)
    bias = bool(config.get("attention_bias", False))
    fields: dict[str, Any] = dict(attention_bias=bias, o_proj_bias=bias, mlp_bias=bool(config.get("mlp_bias", False)))
    fields.update(extra)
    return ModelSpec(
        **spec,
        layer_types=(FULL,) * spec["num_layers"],
        # a MoE model's dense size is unused (qwen3_moe configs carry one anyway)
        intermediate_size=int(config["intermediate_size"] if "num_experts" not in extra else
                              config.get("intermediate_size") or 0),
        **fields,
    )


def _llama(config: Mapping[str, Any]) -> ModelSpec:
    return _dense(config, "llama")


def _qwen2(config: Mapping[str, Any]) -> ModelSpec:
    # Qwen2's q/k/v projections always have biases and its o_proj never has one (no attention_bias key)
    return _dense(config, "qwen2", attention_bias=True, o_proj_bias=False, mlp_bias=False)


def _qwen3(config: Mapping[str, Any]) -> ModelSpec:
    return _dense(config, "qwen3", qk_norm=True, mlp_bias=False)


def _qwen3_moe(config: Mapping[str, Any]) -> ModelSpec:
    if list(config.get("mlp_only_layers") or []) or int(config.get("decoder_sparse_step", 1)) != 1:
        raise UnsupportedModelError("qwen3_moe with dense layers (mlp_only_layers, decoder_sparse_step != 1) is not "
                                    "supported: every layer must be sparse")
    if "num_experts" not in config and "num_local_experts" not in config:
        raise CheckpointError("config.json for qwen3_moe lacks num_experts (or num_local_experts)")
    out = _dense(
        config, "qwen3_moe", qk_norm=True, mlp_bias=False,
        # published checkpoints say num_experts; transformers 5 writes num_local_experts
        num_experts=int(config["num_experts"] if "num_experts" in config else config["num_local_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
    )
    if not 0 < out.num_experts_per_tok <= out.num_experts:
        raise CheckpointError("num_experts_per_tok must be in 1..num_experts")
    return out


def _qwen3_5_moe(config: Mapping[str, Any]) -> ModelSpec:
    spec = _common(config, "qwen3_5_moe")
    n = spec["num_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:
        interval = int(config.get("full_attention_interval", 4))
        layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(n)]
    layer_types = tuple(str(t) for t in layer_types)
    if len(layer_types) != n or any(t not in (FULL, LINEAR) for t in layer_types):
        raise CheckpointError(f"layer_types must list {n} entries of {FULL!r}/{LINEAR!r}")
    out = ModelSpec(
        **spec,
        layer_types=layer_types,
        attention_bias=bool(config.get("attention_bias", False)),
        qk_norm=True,
        attn_output_gate=True,
        zero_centered_norm=True,
        linear_num_key_heads=int(config["linear_num_key_heads"]),
        linear_num_value_heads=int(config["linear_num_value_heads"]),
        linear_key_head_dim=int(config["linear_key_head_dim"]),
        linear_value_head_dim=int(config["linear_value_head_dim"]),
        linear_conv_kernel=int(config.get("linear_conv_kernel_dim", 4)),
        num_experts=int(config["num_experts"]),
        num_experts_per_tok=int(config["num_experts_per_tok"]),
        moe_intermediate_size=int(config["moe_intermediate_size"]),
        shared_expert_intermediate_size=int(config.get("shared_expert_intermediate_size", 0)),
        mtp_num_layers=int(config.get("mtp_num_hidden_layers", 0)),
    )
    if out.linear_num_value_heads % out.linear_num_key_heads:
        raise CheckpointError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if not 0 < out.num_experts_per_tok <= out.num_experts:
        raise CheckpointError("num_experts_per_tok must be in 1..num_experts")
    return out


_BUILDERS = {"llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "qwen3_moe": _qwen3_moe, "qwen3_5_moe": _qwen3_5_moe}


@dataclasses.dataclass(frozen=True)
class LayerRange:
    """A contiguous range of layers [start, end)."""

    start: int
    end: int

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"

    def __len__(self) -> int:
        return self.end - self.start


def parse_layer_range(text: str) -> LayerRange:
    """Parse ``"A:B"`` into a :class:`LayerRange` (bounds are checked against a spec later)."""
    try:
        a, b = text.split(":")
        start, end = int(a), int(b)
    except ValueError as exc:
        raise LayerRangeError(f"bad layer range {text!r}: expected START:END, e.g. 0:4") from exc
    if start < 0 or end <= start:
        raise LayerRangeError(f"bad layer range {text!r}: need 0 <= START < END")
    return LayerRange(start, end)


def parse_auto_span(text: str, num_layers: int) -> int | None:
    """The span N of ``"auto:N"`` (checked against the model's ``num_layers``); None for a bare ``"auto"``."""
    if text == "auto":
        return None
    try:
        span = int(text.split(":", 1)[1])
    except (IndexError, ValueError) as exc:
        raise LayerRangeError(f"bad layers {text!r}: use A:B, auto or auto:N") from exc
    if not 0 < span <= num_layers:
        raise LayerRangeError(f"bad layers {text!r}: N in auto:N must be in 1..{num_layers} (the model's layers)")
    return span


def parse_stages(text: str, num_layers: int | None = None) -> list[LayerRange]:
    """Parse ``"0:3,3:8"``; the ranges must be contiguous and, given ``num_layers``, cover the model."""
    ranges = [parse_layer_range(part.strip()) for part in text.split(",") if part.strip()]
    if not ranges:
        raise LayerRangeError("no stages given")
    if ranges[0].start != 0:
        raise LayerRangeError(f"the first stage must start at layer 0, not {ranges[0].start}")
    for prev, nxt in zip(ranges, ranges[1:]):
        if prev.end != nxt.start:
            raise LayerRangeError(f"stages {prev} and {nxt} are not contiguous")
    if num_layers is not None and ranges[-1].end != num_layers:
        raise LayerRangeError(f"stages end at layer {ranges[-1].end} but the model has {num_layers} layers")
    return ranges

