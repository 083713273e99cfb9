"""Write a Hugging Face checkpoint as GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` does.

Names, value transforms, metadata keys and forced-F32 tensors follow the converter (checked against the fixtures made
by it). Types: F32, F16, Q8_0 (gguf-py's bit-exact quantizer) and Q4_K, Q6_K (our reference quantizer). Like
llama-quantize, a row that is not a whole number of blocks falls back: K-quants to Q5_0 (Q4_K) or Q8_0 (Q6_K) when
rows are a multiple of 32, otherwise F16. The whole checkpoint is held in memory while writing: meant for the tiny
and small models the project makes, not for converting 400B checkpoints.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ...errors import CheckpointError, UnsupportedModelError, translate
from ..spec import FULL, ModelSpec
from ..weights import SafetensorsSource
from .quantizer import quantize
from .quants import BLOCK_SIZES, QType
from .tokenizer import gguf_tokenizer_fields
from .transforms import GGUF_ARCH_OF, forward_dense, gguf_name

__all__ = ["WRITE_TYPES", "write_gguf"]

WRITE_TYPES = {"F32": QType.F32, "F16": QType.F16, "Q8_0": QType.Q8_0, "Q4_K": QType.Q4_K, "Q6_K": QType.Q6_K}
_FILE_TYPES = {"F32": 0, "F16": 1, "Q8_0": 7, "Q4_K": 14, "Q6_K": 18}  # llama.cpp LlamaFileType
_FALLBACK = {QType.Q4_K: QType.Q5_0, QType.Q6_K: QType.Q8_0}
_FORCED_F32 = re.compile(r"(_norm\.weight|ffn_gate_inp\.weight|ffn_gate_inp_shexp\.weight|ssm_conv1d\.weight)$")
_EXPERT = re.compile(
    r"^(?P<pre>(?:model|mtp)\.layers\.\d+\.mlp\.experts)\.(?:\d+\.)?(?:gate_proj|up_proj|down_proj|gate_up_proj)"
)


def _tensor_type(gname: str, shape: tuple[int, ...], want: int) -> int:
    if len(shape) == 1 or _FORCED_F32.search(gname) or want == QType.F32:
        return QType.F32
    if want == QType.F16:
        return QType.F16
    cols = shape[-1]
    if cols % BLOCK_SIZES[want][0] == 0:
        return want
    fallback = _FALLBACK.get(want)
    if fallback is not None and cols % BLOCK_SIZES[fallback][0] == 0:
        return fallback
    return QType.F16


def _rope_freqs(spec: ModelSpec) -> torch.Tensor:
    """What ``LlamaModel.generate_extra_tensors`` writes for llama3 RoPE scaling: per-frequency divisors."""
    factor, low, high, old = spec.rope_llama3  # type: ignore[misc]
    dim = spec.head_dim
    freqs = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def _hf_tensors(spec: ModelSpec, source: SafetensorsSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(GGUF name, converter-transformed float32 tensor) in file order; experts stacked into ``ffn_*_exps``."""
    arch = GGUF_ARCH_OF[spec.arch]
    if spec.rope_llama3 is not None:
        yield "rope_freqs.weight", _rope_freqs(spec)
    names = list(source.names())
    expert_groups = sorted({m.group("pre") for n in names if (m := _EXPERT.match(n))})
    plain = [n for n in names if not _EXPERT.match(n)]
    for name in plain:
        gname = gguf_name(arch, name, spec.num_layers)
        if gname is None:
            raise UnsupportedModelError(f"no GGUF name for tensor {name}")
        yield gname, forward_dense(spec, name, source.get(name, torch.float32))
    for pre in expert_groups:
        for proj in ("gate_proj", "up_proj", "down_proj"):
            first = f"{pre}.0.{proj}.weight"
            gname = gguf_name(arch, first, spec.num_layers)
            if gname is None or not source.has(first):
                raise CheckpointError(f"checkpoint lacks {first}")
            experts = [source.get(f"{pre}.{e}.{proj}.weight", torch.float32) for e in range(spec.num_experts)]
            yield gname, torch.stack(experts)


def _metadata(w: Any, spec: ModelSpec, config: dict[str, Any], name: str, qname: str) -> None:
    arch = GGUF_ARCH_OF[spec.arch]
    dense = arch != "qwen35moe"
    a = arch + "."
    w.add_string("general.type", "model")
    w.add_string("general.name", name)
    w.add_uint32(a + "block_count", spec.num_layers + spec.mtp_num_layers)
    w.add_uint32(a + "context_length", spec.max_position_embeddings)
    w.add_uint32(a + "embedding_length", spec.hidden_size)
    if dense:
        w.add_uint32(a + "feed_forward_length", spec.intermediate_size)
    w.add_uint32(a + "attention.head_count", spec.num_heads)
    w.add_uint32(a + "attention.head_count_kv", spec.num_kv_heads)
    if spec.rope_linear is not None:
        w.add_string(a + "rope.scaling.type", "linear")
        w.add_float32(a + "rope.scaling.factor", spec.rope_linear)
    rope = dict(config.get("rope_parameters") or {})
    if not dense:  # llama.cpp requires the M-RoPE sections of qwen35moe; a text-only config may lack them. Text
        # positions are equal in every section, so any split of the rotary pairs is the same rotation: Qwen3.5's own
        # (11, 11, 10 of 32 pairs; 3, 3, 2 of 8 in llama.cpp's converter output) where the config has none
        half = spec.rotary_dim // 2
        third = -(-half // 3)
        sections = [int(s) for s in rope.get("mrope_section") or (third, third, half - 2 * third)]
        w.add_array(a + "rope.dimension_sections", (sections + [0, 0, 0, 0])[:4])
    w.add_float32(a + "rope.freq_base", spec.rope_theta)
    w.add_float32(a + "attention.layer_norm_rms_epsilon", spec.rms_norm_eps)
    if spec.is_moe:
        w.add_uint32(a + "expert_count", spec.num_experts)
        w.add_uint32(a + "expert_used_count", spec.num_experts_per_tok)
    w.add_uint32(a + "attention.key_length", spec.head_dim)
    w.add_uint32(a + "attention.value_length", spec.head_dim)
    w.add_uint32("general.file_type", _FILE_TYPES[qname])
    if arch == "llama":
        w.add_uint32(a + "vocab_size", spec.vocab_size)
        w.add_uint32(a + "rope.dimension_count", spec.rotary_dim)
    elif arch == "qwen3moe":
        w.add_uint32(a + "expert_feed_forward_length", spec.moe_intermediate_size)
    elif arch == "qwen35moe":
        w.add_uint32(a + "expert_feed_forward_length", spec.moe_intermediate_size)
        w.add_uint32(a + "expert_shared_feed_forward_length", spec.shared_expert_intermediate_size)
        w.add_uint32(a + "nextn_predict_layers", spec.mtp_num_layers)
        w.add_uint32(a + "ssm.conv_kernel", spec.linear_conv_kernel)
        w.add_uint32(a + "ssm.state_size", spec.linear_key_head_dim)
        w.add_uint32(a + "ssm.group_count", spec.linear_num_key_heads)
        w.add_uint32(a + "ssm.time_step_rank", spec.linear_num_value_heads)
        w.add_uint32(a + "ssm.inner_size", spec.linear_value_dim)
        recurrent = [t != FULL for t in spec.layer_types] + [False] * spec.mtp_num_layers
        w.add_array(a + "attention.recurrent_layers", recurrent)
        full = [i for i, t in enumerate(spec.layer_types) if t == FULL]
        w.add_uint32(a + "full_attention_interval", full[0] + 1 if full else 1)
        w.add_uint32(a + "rope.dimension_count", spec.rotary_dim)
    w.add_uint32("general.quantization_version", 2)


def _tokenizer(w: Any, hf_dir: Path, spec: ModelSpec) -> None:
    tj = hf_dir / "tokenizer.json"
    if not tj.is_file():
        return
    try:
        fields = gguf_tokenizer_fields(json.loads(tj.read_text(encoding="utf-8")))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise translate(exc, CheckpointError, f"cannot convert {tj}")
    if len(fields["tokens"]) < spec.vocab_size:  # llama.cpp pads the vocabulary to the embedding rows
        n = len(fields["tokens"])
        fields["tokens"] += [f"[PAD{i}]" for i in range(n, spec.vocab_size)]
        fields["types"] += [5] * (spec.vocab_size - n)
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", fields["pre"])
    w.add_array("tokenizer.ggml.tokens", fields["tokens"])
    w.add_array("tokenizer.ggml.token_type", fields["types"])
    w.add_array("tokenizer.ggml.merges", fields["merges"])
    if spec.bos_token_id is not None:
        w.add_uint32("tokenizer.ggml.bos_token_id", int(spec.bos_token_id))
    if spec.eos_token_ids:
        w.add_uint32("tokenizer.ggml.eos_token_id", spec.eos_token_ids[0])
    if spec.pad_token_id is not None:
        w.add_uint32("tokenizer.ggml.padding_token_id", int(spec.pad_token_id))
    tc: dict[str, Any] = {}
    if (hf_dir / "tokenizer_config.json").is_file():
        try:
            tc = json.loads((hf_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise translate(exc, CheckpointError, f"cannot read {hf_dir / 'tokenizer_config.json'}")
    add_bos = bool(tc.get("add_bos_token", spec.arch == "llama" and spec.bos_token_id is not None))
    w.add_bool("tokenizer.ggml.add_bos_token", add_bos)
    w.add_bool("tokenizer.ggml.add_eos_token", bool(tc.get("add_eos_token", False)))
    if isinstance(tc.get("chat_template"), str):
        w.add_string("tokenizer.chat_template", tc["chat_template"])


def write_gguf(
    hf_dir: str | Path, out_path: str | Path, qtype: str = "F16", *, split_max_tensors: int = 0
) -> list[Path]:
    """Convert ``hf_dir`` (config.json + safetensors [+ tokenizer.json]) to ``out_path``; returns the files written.

    ``split_max_tensors`` > 0 writes ``<stem>-0000K-of-0000N.gguf`` files of at most that many tensors each.
    """
    import gguf  # local: only the writer needs gguf-py

    if qtype not in WRITE_TYPES:
        raise UnsupportedModelError(f"cannot write GGUF type {qtype!r}; supported: {', '.join(WRITE_TYPES)}")
    hf_dir, out = Path(hf_dir), Path(out_path)
    spec = ModelSpec.from_dir(hf_dir)
    config = json.loads((hf_dir / "config.json").read_text(encoding="utf-8"))
    config = config.get("text_config", config)
    source = SafetensorsSource(hf_dir)
    has_mtp = source.has("mtp.fc.weight")
    if not has_mtp:
        spec = ModelSpec.from_hf_config({**config, "mtp_num_hidden_layers": 0})
    arch = GGUF_ARCH_OF[spec.arch]
    want = WRITE_TYPES[qtype]
    writer = gguf.GGUFWriter(out, arch, split_max_tensors=split_max_tensors)
    try:
        _metadata(writer, spec, config, hf_dir.name, qtype)
        _tokenizer(writer, hf_dir, spec)
        for gname, t in _hf_tensors(spec, source):
            arr = t.detach().to(torch.float32).contiguous().numpy()
            ttype = _tensor_type(gname, tuple(arr.shape), want)
            if ttype == QType.F32:
                writer.add_tensor(gname, arr)
            elif ttype == QType.F16:
                writer.add_tensor(gname, arr.astype(np.float16))
            else:
                writer.add_tensor(gname, quantize(arr, ttype), raw_dtype=gguf.GGMLQuantizationType(ttype))
        writer.write_header_to_file(path=out)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    except (OSError, ValueError) as exc:
        raise translate(exc, CheckpointError, f"cannot write GGUF {out}")
    finally:
        writer.close()
        source.close()
    if split_max_tensors > 0:
        return sorted(out.parent.glob(f"{out.stem}-*-of-*.gguf"))
    return [out]
