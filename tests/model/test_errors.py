"""Typed errors with clear messages for the runtime's bad inputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sangama_p2p.errors import (
    CapacityError,
    CheckpointError,
    LayerRangeError,
    SessionStateError,
    UnsupportedModelError,
)
from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.spec import LayerRange, parse_stages
from sangama_p2p.model.stage import StageModel, StepInput


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_missing_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        open_checkpoint(tmp_path / "empty")


def test_missing_weights(checkpoints, tmp_path):
    d = _copy(checkpoints["hf-llama"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        open_checkpoint(d)


def test_corrupt_config_and_weights(checkpoints, tmp_path):
    d = _copy(checkpoints["hf-llama"], tmp_path / "m")
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        open_checkpoint(d)
    d2 = _copy(checkpoints["hf-llama"], tmp_path / "m2")
    data = (d2 / "model.safetensors").read_bytes()
    (d2 / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(CheckpointError, match="corrupt|cannot read"):
        ck = open_checkpoint(d2)
        StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)


def test_missing_shard_and_missing_tensor(checkpoints, tmp_path):
    d = _copy(checkpoints["hf-qwen-sharded"], tmp_path / "m")
    next(d.glob("model-0000*-of-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="missing checkpoint shard"):
        open_checkpoint(d)
    d2 = _copy(checkpoints["hf-llama"], tmp_path / "m2")
    cfg = json.loads((d2 / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # config promises a layer the weights lack
    (d2 / "config.json").write_text(json.dumps(cfg))
    ck = open_checkpoint(d2)
    with pytest.raises(CheckpointError, match="lacks tensor 'model.layers.6"):
        StageModel.load(ck.spec, ck.source, 5, 7)


def test_unknown_architecture(checkpoints, tmp_path):
    d = _copy(checkpoints["hf-llama"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unknown architecture model_type='gpt2'; Sangama runs model "
                       "types llama, mistral, qwen2, qwen3, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe$"):
        open_checkpoint(d)


def test_unsupported_variants_of_supported_architectures():
    from sangama_p2p.model.spec import ModelSpec

    base = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=64)
    moe = dict(base, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    with pytest.raises(UnsupportedModelError, match="mlp_only_layers"):
        ModelSpec.from_hf_config(dict(moe, mlp_only_layers=[1]))
    with pytest.raises(UnsupportedModelError, match="RoPE type 'yarn' is not supported .supported: default, linear, "
                       "llama3."):
        ModelSpec.from_hf_config(dict(base, model_type="qwen2", rope_scaling={"type": "yarn", "factor": 4.0}))
    with pytest.raises(CheckpointError, match="lacks num_experts .or num_local_experts.$"):
        ModelSpec.from_hf_config({k: v for k, v in moe.items() if k != "num_experts"})
    # a sliding window changes nothing for sequences that fit it: it becomes the model's maximum length
    mistral = ModelSpec.from_hf_config(dict(base, model_type="mistral", sliding_window=4096,
                                            max_position_embeddings=32768))
    assert (mistral.arch, mistral.max_position_embeddings) == ("llama", 4096)
    qwen2 = ModelSpec.from_hf_config(dict(base, model_type="qwen2", sliding_window=4096, use_sliding_window=False,
                                          max_position_embeddings=32768))
    assert qwen2.max_position_embeddings == 32768 and qwen2.attention_bias and not qwen2.o_proj_bias


def test_layer_range_out_of_bounds(checkpoints):
    ck = open_checkpoint(checkpoints["hf-llama"])
    n = ck.spec.num_layers
    with pytest.raises(LayerRangeError, match="outside the model"):
        StageModel.load(ck.spec, ck.source, 2, n + 1)
    with pytest.raises(LayerRangeError):
        parse_stages("0:3,2:6", n)
    with pytest.raises(LayerRangeError, match="bad layer range"):
        parse_stages("3:1", n)
    with pytest.raises(LayerRangeError, match="has 6 layers"):
        parse_stages("0:3,3:5", n)


def test_prompt_longer_than_capacity(checkpoints):
    ck = open_checkpoint(checkpoints["hf-llama"])
    chain = LocalChain.load(ck, [LayerRange(0, ck.spec.num_layers)])
    with pytest.raises(CapacityError, match="exceeds the session capacity 8"):
        chain.generate(list(range(1, 7)), 4, capacity=8)
    stage = chain.stages[0]
    state = stage.new_session(4)
    with pytest.raises(CapacityError, match="capacity of 4"):
        stage.forward([StepInput(state, 0, tokens=torch.arange(5))])
    with pytest.raises(CapacityError, match="max_position_embeddings"):
        stage.new_session(10**7)


def test_start_position_ahead_of_session(checkpoints):
    ck = open_checkpoint(checkpoints["hf-qwen"])
    stage = StageModel.load(ck.spec, ck.source, 0, 2)
    state = stage.new_session(16)
    stage.forward([StepInput(state, 0, tokens=torch.arange(3))])
    with pytest.raises(SessionStateError, match="ahead of the session"):
        stage.forward([StepInput(state, 5, tokens=torch.arange(1))])
    with pytest.raises(SessionStateError, match="cannot roll back"):  # no rollback ring on this session
        stage.forward([StepInput(state, 1, tokens=torch.arange(1))])
    assert state.position == 3  # a refused step changes nothing


def test_unsupported_dtype(checkpoints, tmp_path):
    ck = open_checkpoint(checkpoints["hf-llama"])
    with pytest.raises(UnsupportedModelError, match="float64"):
        StageModel.load(ck.spec, ck.source, 0, 1, dtype="float64")
    from safetensors.torch import load_file, save_file

    d = _copy(checkpoints["hf-llama"], tmp_path / "m")
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(128, 64, dtype=torch.int8)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    ck2 = open_checkpoint(d)
    with pytest.raises(UnsupportedModelError, match="int8"):
        StageModel.load(ck2.spec, ck2.source, 0, 1)
