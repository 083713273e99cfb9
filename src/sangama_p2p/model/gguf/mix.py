"""Which ggml type each tensor gets under a llama-quantize preset: llama.cpp's ``llama_tensor_get_type``, as a pure
function of the tensor names, shapes and a few hyper-parameters.

Follows ``src/llama-quant.cpp`` (llama.cpp 0c1e570, the tree the fixtures were made with) for the presets in
:data:`PRESETS`: which tensors may be quantized at all (``tensor_allows_quantization``: 2-D and up, names ending in
``weight``, no norms, routers, conv1d, ...), the per-category rules (output / tied token embedding -> Q6_K or Q8_0;
for Q4_K_M: ``attn_v`` and ``ffn_down`` -> Q6_K on the layers ``use_more_bits`` picks, ...), and the fallback for rows
that are not a whole number of blocks (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16). Tensors are visited in
llama.cpp's order (layer number, then name), which is what its ``attn_v`` counter sees. Arch-specific rules for
Falcon and GLM5-next are not implemented (those files raise).
"""

from __future__ import annotations

import dataclasses
import re

from ...errors import UnsupportedModelError
from .quants import BLOCK_SIZES, QType

__all__ = ["PRESETS", "Preset", "TensorPlan", "plan_types"]


@dataclasses.dataclass(frozen=True)
class Preset:
    name: str
    file_type: int  # llama.cpp's LlamaFileType, stored as general.file_type
    default: int  # the ggml type most tensors get


PRESETS = {
    p.name: p
    for p in (
        Preset("F32", 0, QType.F32),
        Preset("F16", 1, QType.F16),
        Preset("BF16", 32, QType.BF16),
        Preset("Q4_0", 2, QType.Q4_0),
        Preset("Q4_1", 3, QType.Q4_1),
        Preset("Q8_0", 7, QType.Q8_0),
        Preset("Q5_0", 8, QType.Q5_0),
        Preset("Q5_1", 9, QType.Q5_1),
        Preset("Q6_K", 18, QType.Q6_K),
        Preset("Q4_K_M", 15, QType.Q4_K),
    )
}
_UNQUANTIZED = (QType.F32, QType.F16, QType.BF16)
# tensor_allows_quantization: name fragments that are never quantized (the arch-independent ones)
_KEEP = (
    "_norm.weight",
    "ffn_gate_inp.weight",
    "ffn_gate_tid2eid.weight",
    "altup",
    "laurel",
    "per_layer_model_proj",
    "ssm_conv1d",
    "shortconv.conv.weight",
    "indexer.k_proj.weight",
    "indexer.q_proj.weight",
    "time_mix_",
    "attn_rel_b.weight",
    ".position_embd",
    "sam.pos_embd",
    "sam.neck.",
    "sam.net_",
    ".rel_pos",
    ".patch_embd",
    ".patch_merger",
    "a.rvq.codebook",
    "mm.a.code_embd",
)
_TIME_MIX = re.compile(r"time_mix_(first|w0|w1|w2|v0|v1|v2|a0|a1|a2|g1|g2|decay_w1|decay_w2|lerp_fused)\.weight")
_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q5_K: QType.Q5_1, QType.Q6_K: QType.Q8_0}
_LAYER = re.compile(r"^blk\.(\d+)\.")


@dataclasses.dataclass(frozen=True)
class TensorPlan:
    name: str
    shape: tuple[int, ...]  # torch order (ggml ne reversed)
    src_type: int


def _n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims: dimensions up to the last ne > 1 (a [1, H] tensor is 1-D to ggml)."""
    ne = list(reversed(shape))
    while len(ne) > 1 and ne[-1] == 1:
        ne.pop()
    return len(ne)


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    if _n_dims(shape) < 2 or not name.endswith("weight"):
        return False
    for frag in _KEEP:
        if frag in name and (frag != "time_mix_" or _TIME_MIX.search(name)):
            return False
    return name not in ("position_embd.weight", "token_types.weight")


def _category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for frag, cat in (
        ("attn_qkv.weight", "attn_v"),  # attn_qkv and attn_kv_b share attn_v's rules
        ("attn_kv_b.weight", "attn_v"),
        ("attn_v.weight", "attn_v"),
        ("attn_k.weight", "attn_k"),
        ("attn_q.weight", "attn_q"),
        ("attn_output.weight", "attn_output"),
        ("ffn_up", "ffn_up"),
        ("ffn_gate", "ffn_gate"),
        ("ffn_down", "ffn_down"),
    ):
        if frag in name:
            return cat
    return "other"


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _order(name: str) -> tuple[int, str]:
    """llama.cpp's weight_name_comparer: layer number (-1 outside blocks), then name."""
    m = _LAYER.match(name)
    return (int(m.group(1)) if m else -1, name)


def _fallback(qtype: int, cols: int) -> int:
    bs = BLOCK_SIZES[qtype][0]
    if cols % bs == 0:
        return qtype
    out = _FALLBACK.get(qtype, qtype)  # 32-element types have nothing smaller to fall back to
    return out if cols % BLOCK_SIZES[out][0] == 0 else QType.F16


def plan_types(
    tensors: list[TensorPlan],
    preset: str,
    *,
    arch: str,
    n_layer: int,
    n_expert: int = 0,
    n_head: int = 0,
    n_head_kv: int = 0,
) -> dict[str, int]:
    """{tensor name: ggml type} for ``preset`` (a key of :data:`PRESETS`), as llama-quantize would choose."""
    if preset not in PRESETS:
        raise UnsupportedModelError(f"unknown quantization preset {preset!r}; supported: {', '.join(PRESETS)}")
    if arch in ("falcon", "glm5-next", "glm5_next"):
        raise UnsupportedModelError(f"llama.cpp's per-tensor rules for {arch} are not implemented")
    p = PRESETS[preset]
    n_expert = max(1, n_expert)
    ordered = sorted(tensors, key=lambda t: _order(t.name))
    n_attn_v = sum(1 for t in ordered if _category(t.name) == "attn_v")
    tied = not any(t.name == "output.weight" for t in ordered)
    # llama.cpp's LLM_TYPE_70B (80 layers with GQA): attn_v's Q4_K becomes Q5_K
    is_70b = arch == "llama" and n_layer == 80 and n_head != n_head_kv
    i_attn_v = i_ffn_down = 0
    out: dict[str, int] = {}
    for t in ordered:
        if not allows_quantization(t.name, t.shape):
            out[t.name] = t.src_type
            continue
        if p.default in _UNQUANTIZED:
            out[t.name] = p.default
            continue
        cat, cols, new = _category(t.name), t.shape[-1], p.default
        if cat == "output" or (tied and cat == "token_embd"):
            if cols % BLOCK_SIZES[new][0]:
                new = QType.Q8_0
            elif new != QType.Q8_0:
                new = QType.Q6_K
        elif cat == "attn_v":
            if preset == "Q4_K_M" and _use_more_bits(i_attn_v, n_attn_v):
                new = QType.Q6_K
            if is_70b and new == QType.Q4_K:
                new = QType.Q5_K
            if n_expert == 8:
                new = QType.Q8_0
            i_attn_v += 1
        elif cat == "attn_k" and n_expert == 8:
            new = QType.Q8_0
        elif cat == "ffn_down":
            i_layer = i_ffn_down
            if n_expert > 1:
                m = _LAYER.match(t.name)
                if m is None or not 0 <= int(m.group(1)) < n_layer:
                    raise UnsupportedModelError(f"cannot tell the layer of expert tensor {t.name}")
                i_layer = int(m.group(1))
            if preset == "Q4_K_M" and _use_more_bits(i_layer, n_layer):
                new = QType.Q6_K
            i_ffn_down += 1
        elif cat == "attn_output" and n_expert == 8 and preset == "Q4_K_M":
            new = QType.Q5_K
        out[t.name] = _fallback(new, cols)
    return out
