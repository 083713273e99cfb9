"""llama.cpp's tensor names and weight transforms, both ways.

``convert_hf_to_gguf.py`` renames tensors and changes some values (the converter-made files in
``tests/data/gguf-arch/`` and their ``regenerate.py`` pin each of these against transformers):

* qwen35moe: the value heads of the Gated DeltaNet are reordered from grouped-by-key-head to tiled order (rows of
  ``attn_qkv`` after the Q and K rows, rows of ``attn_gate``/``ssm_alpha``/``ssm_beta``, ``ssm_a``/``ssm_dt``, the V
  channels of ``ssm_conv1d`` and the *columns* of ``ssm_out``); ``ssm_a = -exp(A_log)``; every zero-centred norm is
  stored as ``1 + w``; ``conv1d`` [C, 1, K] is squeezed to [C, K]; experts are stacked into ``ffn_*_exps`` [E, out, in].
* llama (``LlamaModel``: also SmolLM and Mistral-style checkpoints): the rows of ``attn_q``/``attn_k`` are permuted
  from rotate-half to interleaved RoPE order; llama3 RoPE scaling becomes a ``rope_freqs`` tensor (read by
  :mod:`.config`).
* qwen2, qwen3, qwen3moe (``Qwen2Model``, ``Qwen3Model``, ``Qwen3MoeModel``): names only, no value changes - no q/k
  permutation (llama.cpp runs these with NEOX-style rotate-half RoPE), plain norms; experts stacked as above.

The loader applies the inverse so that every tensor equals the Hugging Face one; the writer applies the forward
direction. Both are expressed as permutation indices, which work equally on dense rows and on rows of raw blocks.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from ..spec import ModelSpec

__all__ = [
    "GGUF_ARCHES",
    "GGUF_ARCH_OF",
    "Mapping",
    "forward_dense",
    "gguf_name",
    "hf_name",
    "inverse_col_perm",
    "inverse_dense",
    "inverse_row_perm",
]

# GGUF general.architecture -> our spec arch
GGUF_ARCHES = {
    "llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3moe": "qwen3_moe", "qwen35moe": "qwen3_5_moe",
}
GGUF_ARCH_OF = {v: k for k, v in GGUF_ARCHES.items()}  # our spec arch -> GGUF general.architecture

# per-block tensors: GGUF stem -> HF suffix under model.layers.N.
_BLOCK_QWEN = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "attn_qkv": "linear_attn.in_proj_qkv",
    "attn_gate": "linear_attn.in_proj_z",
    "ssm_alpha": "linear_attn.in_proj_a",
    "ssm_beta": "linear_attn.in_proj_b",
    "ssm_conv1d": "linear_attn.conv1d",
    "ssm_norm": "linear_attn.norm",
    "ssm_out": "linear_attn.out_proj",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# tensors without a ".weight"/".bias" suffix in GGUF
_BARE_QWEN = {"ssm_a": "linear_attn.A_log", "ssm_dt.bias": "linear_attn.dt_bias", "ssm_dt": "linear_attn.dt_bias"}
_BLOCK_LLAMA = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_q_norm": "self_attn.q_norm",  # qwen3, qwen3moe
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # qwen3moe's router
}
_NEXTN = {
    "nextn.eh_proj": "mtp.fc",
    "nextn.enorm": "mtp.pre_fc_norm_embedding",
    "nextn.hnorm": "mtp.pre_fc_norm_hidden",
    "nextn.shared_head_norm": "mtp.norm",
}
_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output": "lm_head", "output_norm": "model.norm"}
_BLK_RE = re.compile(r"^blk\.(\d+)\.(.+)$")


@dataclasses.dataclass(frozen=True)
class Mapping:
    """One HF tensor as found in a GGUF file: ``expert`` selects a slice of a stacked ``ffn_*_exps`` tensor,
    ``fused_half`` (0 gate, 1 up) a half of a fused ``ffn_gate_up_exps``."""

    gguf: str
    expert: int | None = None
    fused_half: int | None = None


def hf_name(arch: str, name: str, n_layers: int, n_experts: int) -> list[tuple[str, Mapping]]:
    """The HF name(s) one GGUF tensor stands for (several for stacked experts; none for tensors we do not use)."""
    stem, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        stem, suffix = name, ""
    if stem in _GLOBAL and suffix:
        return [(f"{_GLOBAL[stem]}.{suffix}", Mapping(name))]
    m = _BLK_RE.match(stem if suffix else name)
    if not m:
        return []
    block, rest = int(m.group(1)), m.group(2)
    if block >= n_layers:  # MTP ("nextn") blocks follow the decoder layers
        prefix = f"mtp.layers.{block - n_layers}."
        if f"{rest}" in _NEXTN and suffix:
            return [(f"{_NEXTN[rest]}.{suffix}", Mapping(name))]
    else:
        prefix = f"model.layers.{block}."
    if arch != "qwen35moe":  # llama, qwen2, qwen3, qwen3moe share llama.cpp's dense-model names
        table, bare = _BLOCK_LLAMA, {}
    else:
        table, bare = _BLOCK_QWEN, _BARE_QWEN
    if not suffix or (rest + "." + suffix) in bare:
        key = rest if not suffix else rest + "." + suffix
        return [(prefix + bare[key], Mapping(name))] if key in bare else []
    if rest in table:
        return [(f"{prefix}{table[rest]}.{suffix}", Mapping(name))]
    if rest in _EXPERTS and suffix == "weight":
        return [(f"{prefix}mlp.experts.{e}.{_EXPERTS[rest]}.weight", Mapping(name, e)) for e in range(n_experts)]
    if rest == "ffn_gate_up_exps" and suffix == "weight":
        return [
            (f"{prefix}mlp.experts.{e}.{proj}.weight", Mapping(name, e, half))
            for e in range(n_experts)
            for half, proj in enumerate(("gate_proj", "up_proj"))
        ]
    return []


def gguf_name(arch: str, hf: str, n_layers: int) -> str | None:
    """The GGUF name llama.cpp gives an HF tensor (experts: the stacked tensor), or None if it has none."""
    inv_global = {v: k for k, v in _GLOBAL.items()}
    stem, _, suffix = hf.rpartition(".")
    if stem in inv_global:
        return f"{inv_global[stem]}.{suffix}"
    for hf_stem, g in ((v, k) for k, v in _NEXTN.items()):
        if stem == hf_stem:
            return f"blk.{n_layers}.{g}.{suffix}"
    m = re.match(r"^(?:model\.layers|mtp\.layers)\.(\d+)\.(.+)$", hf)
    if not m:
        return None
    block = int(m.group(1)) + (n_layers if hf.startswith("mtp.") else 0)
    rest = m.group(2)
    table = _BLOCK_QWEN if arch == "qwen35moe" else _BLOCK_LLAMA
    for g, h in (_BARE_QWEN if arch == "qwen35moe" else {}).items():
        if rest == h:
            return f"blk.{block}.{'ssm_dt.bias' if g.startswith('ssm_dt') else g}"
    em = re.match(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", rest)
    if em:
        return f"blk.{block}.ffn_{em.group(1).split('_')[0]}_exps.weight"
    rstem, _, suffix = rest.rpartition(".")
    for g, h in table.items():
        if rstem == h:
            return f"blk.{block}.{g}.{suffix}"
    return None


# ---- value transforms --------------------------------------------------------------------------------------------
def _vhead_perm(nk: int, nv: int, hd: int, to_hf: bool) -> torch.Tensor:
    """Index p with ``x_out = x_in[p]`` over the V-head axis: tiled [r, NK, hd] <-> grouped [NK, r, hd]."""
    r = nv // nk
    if to_hf:
        return torch.arange(nv * hd).view(r, nk, hd).transpose(0, 1).reshape(-1)
    return torch.arange(nv * hd).view(nk, r, hd).transpose(0, 1).reshape(-1)


def _rope_perm(n_head: int, rows: int, to_hf: bool) -> torch.Tensor:
    """Index over q/k rows between HF rotate-half order and llama.cpp's interleaved order."""
    d = rows // n_head
    if to_hf:
        return torch.arange(rows).view(n_head, d // 2, 2).transpose(1, 2).reshape(-1)
    return torch.arange(rows).view(n_head, 2, d // 2).transpose(1, 2).reshape(-1)


def _with_prefix(keep: int, perm: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.arange(keep), perm + keep])


def _row_perm(spec: ModelSpec, hf: str, to_hf: bool) -> torch.Tensor | None:
    if spec.arch == "llama":  # LlamaModel.permute, on the weights and on biases (attention_bias) alike
        if hf.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            return _rope_perm(spec.num_heads, spec.num_heads * spec.head_dim, to_hf)
        if hf.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            return _rope_perm(spec.num_kv_heads, spec.num_kv_heads * spec.head_dim, to_hf)
        return None
    if spec.arch != "qwen3_5_moe" or ".linear_attn." not in hf:
        return None
    if spec.linear_num_key_heads == spec.linear_num_value_heads:
        return None
    nk, nv, hv = spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_value_head_dim
    tail = hf.rsplit("linear_attn.", 1)[1]
    if tail in ("in_proj_qkv.weight", "conv1d.weight"):
        return _with_prefix(2 * spec.linear_key_dim, _vhead_perm(nk, nv, hv, to_hf))
    if tail == "in_proj_z.weight":
        return _vhead_perm(nk, nv, hv, to_hf)
    if tail in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return _vhead_perm(nk, nv, 1, to_hf)
    return None


def inverse_row_perm(spec: ModelSpec, hf: str) -> torch.Tensor | None:
    """Rows to gather from the GGUF tensor to get the HF tensor's rows (None: rows unchanged)."""
    return _row_perm(spec, hf, to_hf=True)


def inverse_col_perm(spec: ModelSpec, hf: str) -> torch.Tensor | None:
    """Columns to gather after dequantizing (only qwen3.5's ``linear_attn.out_proj``)."""
    if spec.arch == "qwen3_5_moe" and hf.endswith("linear_attn.out_proj.weight"):
        if spec.linear_num_key_heads != spec.linear_num_value_heads:
            nk, nv, hv = spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_value_head_dim
            return _vhead_perm(nk, nv, hv, to_hf=True)
    return None


def _col_perm_fwd(spec: ModelSpec, hf: str) -> torch.Tensor | None:
    if spec.arch == "qwen3_5_moe" and hf.endswith("linear_attn.out_proj.weight"):
        if spec.linear_num_key_heads != spec.linear_num_value_heads:
            nk, nv, hv = spec.linear_num_key_heads, spec.linear_num_value_heads, spec.linear_value_head_dim
            return _vhead_perm(nk, nv, hv, to_hf=False)
    return None


def folds_norm(spec: ModelSpec, hf: str) -> bool:
    """Whether llama.cpp stores this tensor as ``1 + w`` (qwen's zero-centred norms, not ``linear_attn.norm``)."""
    if not spec.zero_centered_norm or ".linear_attn." in hf:
        return False
    return hf.endswith("norm.weight") or hf.endswith("layernorm.weight") or ".pre_fc_norm_" in hf


def inverse_dense(spec: ModelSpec, hf: str, t: torch.Tensor) -> torch.Tensor:
    """Turn a dense GGUF tensor (torch order) into the HF tensor. Row permutations included."""
    perm = inverse_row_perm(spec, hf)
    if perm is not None:
        t = t.index_select(0, perm)
    cperm = inverse_col_perm(spec, hf)
    if cperm is not None:
        t = t.index_select(1, cperm)
    if folds_norm(spec, hf):
        t = t.float() - 1.0
    if hf.endswith("linear_attn.A_log"):
        t = torch.log(-t.float())
    if hf.endswith("linear_attn.conv1d.weight") and t.dim() == 2:
        t = t.unsqueeze(1)  # [C, K] -> [C, 1, K]
    if hf.endswith("mlp.shared_expert_gate.weight") and t.dim() == 1:
        t = t.unsqueeze(0)  # [H] -> [1, H]
    return t


def forward_dense(spec: ModelSpec, hf: str, t: torch.Tensor) -> torch.Tensor:
    """What llama.cpp's converter stores for the HF tensor ``t`` (before type conversion), in torch order."""
    if hf.endswith("linear_attn.conv1d.weight") and t.dim() == 3:
        t = t.squeeze(1)
    if hf.endswith("linear_attn.A_log"):
        t = -torch.exp(t.float())
    if folds_norm(spec, hf):
        t = t.float() + 1.0
    perm = _row_perm(spec, hf, to_hf=False)
    if perm is not None:
        t = t.index_select(0, perm)
    cperm = _col_perm_fwd(spec, hf)
    if cperm is not None:
        t = t.index_select(1, cperm)
    return t
