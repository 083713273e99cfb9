"""make_model: checkpoints transformers loads exactly, with MTP tensors, deterministic bytes, non-degenerate weights."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from sangama_p2p.cli.main import main as cli_main
from sangama_p2p.errors import CheckpointError, ModelError, UnsupportedModelError
from sangama_p2p.model.make import checkpoint_num_params, make_model, tensor_plan
from sangama_p2p.model.presets import PRESETS, get_preset
from sangama_p2p.model.spec import ModelSpec

transformers = pytest.importorskip("transformers")

ARCHS = ("qwen3_5_moe", "llama", "qwen2", "qwen3", "qwen3_moe")


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("made")
    return {arch: make_model(root / arch, arch, "tiny", seed=0) for arch in ARCHS}


@pytest.fixture(scope="module")
def loaded(made: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """transformers' model, its loading info, and the checkpoint transformers itself writes back."""
    out = {}
    for arch, path in made.items():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        model.eval()
        resaved = tmp_path_factory.mktemp(f"resaved-{arch}")
        model.save_pretrained(resaved)
        out[arch] = (model, info, resaved)
    return out


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_loads_with_no_missing_or_unexpected_keys(arch, loaded) -> None:
    _, info, _ = loaded[arch]
    assert info["missing_keys"] == set()
    assert {k for k in info["unexpected_keys"] if not k.startswith("mtp.")} == set()
    assert info["mismatched_keys"] == set()
    assert not info["error_msgs"]


@pytest.mark.parametrize("arch", ARCHS)
def test_tensors_round_trip_bit_identical_through_transformers(arch, made, loaded) -> None:
    ours = load_file(str(made[arch] / "model.safetensors"))
    theirs = load_file(str(loaded[arch][2] / "model.safetensors"))
    assert set(theirs) == {k for k in ours if not k.startswith("mtp.")}
    for name, t in theirs.items():
        assert t.dtype == ours[name].dtype and t.shape == ours[name].shape, name
        assert torch.equal(t, ours[name]), name


@pytest.mark.parametrize("arch", ARCHS)
def test_config_json_is_what_transformers_writes(arch, made, loaded) -> None:
    ours = json.loads((made[arch] / "config.json").read_text())
    theirs = json.loads((loaded[arch][2] / "config.json").read_text())
    # the writer's version is metadata, not layout: transformers writes its own (5.25.0 came out after 5.24.0)
    assert ours.pop("transformers_version").startswith("5.") and theirs.pop("transformers_version").startswith("5.")
    assert ours == theirs
    if arch == "qwen3_5_moe":
        assert ours["mtp_num_hidden_layers"] == 1
        # the class's own defaults: everything but our preset numbers and the mtp extras matches a fresh config
        fresh = transformers.Qwen3_5MoeTextConfig().to_dict()
        assert set(ours) - {"architectures", "dtype", "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"} <= set(
            fresh
        )


def test_mtp_tensors_have_a_full_attention_layer_shape(made, loaded) -> None:
    p = get_preset("qwen3_5_moe", "tiny")
    h = p.hidden_size
    with safe_open(str(made["qwen3_5_moe"] / "model.safetensors"), "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes["mtp.fc.weight"] == (h, 2 * h)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert shapes[f"mtp.{norm}.weight"] == (h,)
    # cross-check against the full-attention decoder layer transformers writes for this config
    full = p.layer_types.index("full_attention")
    with safe_open(str(loaded["qwen3_5_moe"][2] / "model.safetensors"), "pt") as f:
        ref = {
            k[len(f"model.layers.{full}.") :]: tuple(f.get_slice(k).get_shape())
            for k in f.keys()
            if k.startswith(f"model.layers.{full}.")
        }
    mtp_layer = {k[len("mtp.layers.0.") :]: s for k, s in shapes.items() if k.startswith("mtp.layers.0.")}
    assert mtp_layer == ref
    assert "self_attn.q_proj.weight" in ref and "mlp.experts.7.down_proj.weight" in ref
    assert sum(k.startswith("mtp.") for k in shapes) == 4 + len(ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_gives_finite_non_degenerate_logits(arch, loaded) -> None:
    model = loaded[arch][0]
    ids = torch.arange(5, 5 + 24).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 24, model.config.vocab_size)
    assert torch.isfinite(logits).all()
    assert len(set(logits[0].argmax(-1).tolist())) >= 6  # argmax is not constant over positions


def test_moe_routing_is_not_degenerate(loaded) -> None:
    """The router x4 scaling spreads tokens over the experts instead of sending them all to one."""
    model = loaded["qwen3_5_moe"][0]
    picks: list[torch.Tensor] = []
    gate = model.model.layers[0].mlp.gate
    handle = gate.register_forward_hook(lambda mod, inp, out: picks.append(inp[0].reshape(-1, inp[0].shape[-1])))
    try:
        with torch.no_grad():
            model(torch.arange(3, 3 + 32).unsqueeze(0))
    finally:
        handle.remove()
    scores = picks[0] @ gate.weight.T  # [T, E]
    top = scores.topk(2, dim=-1).indices
    assert len(set(top[:, 0].tolist())) >= 4


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path, made) -> None:
    a = make_model(tmp_path / "a", "qwen3_5_moe", "tiny", seed=0)
    b = make_model(tmp_path / "b", "qwen3_5_moe", "tiny", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (made["qwen3_5_moe"] / name).read_bytes(), name
    assert (b / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    assert (b / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


def test_deterministic_across_processes(tmp_path: Path, made) -> None:
    """A fresh interpreter (other hash seed) writes the same bytes: nothing depends on process state."""
    code = "import sys; from sangama_p2p.model.make import make_model; make_model(sys.argv[1], 'llama', 'tiny', seed=0)"
    env = {"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "p")], check=True, env=env, timeout=120)
    assert (tmp_path / "p" / "model.safetensors").read_bytes() == (made["llama"] / "model.safetensors").read_bytes()


def test_bfloat16_is_the_float32_draw_cast(tmp_path: Path, made) -> None:
    d = make_model(tmp_path / "bf", "llama", "tiny", seed=0, dtype="bfloat16")
    assert json.loads((d / "config.json").read_text())["dtype"] == "bfloat16"
    bf, f32 = load_file(str(d / "model.safetensors")), load_file(str(made["llama"] / "model.safetensors"))
    assert set(bf) == set(f32)
    for name in bf:
        assert bf[name].dtype == torch.bfloat16
        assert torch.equal(bf[name], f32[name].to(torch.bfloat16)), name


@pytest.mark.parametrize("arch", ARCHS)
def test_spec_and_tokenizer_ids_agree(arch, made) -> None:
    spec = ModelSpec.from_dir(made[arch])
    p = get_preset(arch, "tiny")
    assert spec.arch == arch and spec.num_layers == p.num_hidden_layers and spec.vocab_size == p.vocab_size
    tok = json.loads((made[arch] / "tokenizer.json").read_text())
    specials = {t["content"]: t["id"] for t in tok["added_tokens"]}
    assert spec.eos_token_ids == (specials["<|endoftext|>"],)
    assert spec.pad_token_id == specials["<|pad|>"]
    if arch == "qwen3_5_moe":
        assert spec.mtp_num_layers == 1 and spec.layer_types == tuple(p.layer_types)
        assert spec.rotary_dim == p.head_dim // 4


def test_llama_tiny_is_the_petals_anchor_shape() -> None:
    p = get_preset("llama", "tiny")
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.intermediate_size, p.vocab_size) == (
        256,
        6,
        4,
        512,
        1000,
    )


@pytest.mark.parametrize("arch", ARCHS)
def test_param_count_matches_plan(arch, made) -> None:
    p = get_preset(arch, "tiny")
    expected = sum(torch.Size(s).numel() for _, s in tensor_plan(p))
    assert checkpoint_num_params(made[arch]) == expected


def test_bad_inputs_raise_typed_errors(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match="architecture"):
        make_model(tmp_path / "x", "gpt2")
    with pytest.raises(UnsupportedModelError, match="preset"):
        make_model(tmp_path / "x", "llama", preset="huge")
    with pytest.raises(UnsupportedModelError, match="dtype"):
        make_model(tmp_path / "x", "llama", dtype="int8")
    with pytest.raises(UnsupportedModelError, match="dtype"):
        make_model(tmp_path / "x", "llama", dtype=torch.int8)
    for seed in (-1, 2**63, 1.5, "0"):
        with pytest.raises(ModelError, match="seed"):
            make_model(tmp_path / "x", "llama", seed=seed)
    (tmp_path / "file").write_text("not a dir")
    with pytest.raises(CheckpointError, match="not a directory"):
        make_model(tmp_path / "file", "llama")
    with pytest.raises(CheckpointError):
        checkpoint_num_params(tmp_path)
    assert not (tmp_path / "x").exists()


def test_cli_make_model(tmp_path: Path, capsys: pytest.CaptureFixture[str], made) -> None:
    rc = cli_main(["make-model", str(tmp_path / "m"), "--arch", "llama", "--seed", "0"])
    assert rc == 0
    out = capsys.readouterr().out
    assert str(tmp_path / "m") in out
    assert f"{checkpoint_num_params(made['llama']):,} parameters" in out
    assert (tmp_path / "m" / "model.safetensors").read_bytes() == (made["llama"] / "model.safetensors").read_bytes()
    with pytest.raises(SystemExit):
        cli_main(["make-model", str(tmp_path / "n"), "--arch", "gpt2"])


def test_package_does_not_import_transformers(tmp_path: Path) -> None:
    code = (
        "import sys; from sangama_p2p.model.make import make_model; from sangama_p2p.model.tokenizer import Tokenizer;"
        "d = make_model(sys.argv[1], 'qwen3_5_moe'); Tokenizer.from_dir(d).encode('hi');"
        "assert 'transformers' not in sys.modules, 'transformers was imported'"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "q")], check=True, timeout=120)


def test_presets_cover_every_arch_and_size() -> None:
    dense = ["micro", "small", "tiny"]
    assert {a: sorted(p) for a, p in PRESETS.items()} == {
        "qwen3_5_moe": ["mid", "small", "tiny"], "llama": dense, "qwen2": dense, "qwen3": dense, "qwen3_moe": dense}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_small_presets_load_in_transformers(arch, tmp_path: Path) -> None:
    d = make_model(tmp_path / arch, arch, "small", seed=0, dtype="bfloat16")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
    assert info["missing_keys"] == set() and not {k for k in info["unexpected_keys"] if not k.startswith("mtp.")}
    with torch.no_grad():
        logits = model(torch.arange(1, 9).unsqueeze(0)).logits
    assert torch.isfinite(logits).all()


GOLDEN_SHA256 = {  # seed 0, float32, torch 2.13 CPU generator: changing the draw order or init changes these
    "qwen3_5_moe": "1d0e22a4eacd5f991b5403ef732498552147ad6da56b236a0936d89f33cb6794",
    "llama": "6d13a8b210e3894434738232943518a72a797c2689d89258be8da36fbcaccf68",
    "qwen2": "ebfa1c526d0f01c0eb16aed8226b4de3f2c0ec2be382acab94974b2f2abee577",
    "qwen3": "62c769178a00c8f7fee26209bf92f58deb157a9cfdfcea27e5fda97d542d13f9",
    "qwen3_moe": "97176828c81d22352f1fcd53125342f950f4d2bd11894fad546c64308b064abf",
}


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_checkpoints_keep_their_golden_bytes(arch, made) -> None:
    import hashlib

    assert hashlib.sha256((made[arch] / "model.safetensors").read_bytes()).hexdigest() == GOLDEN_SHA256[arch]


def test_files_are_complete_and_readable_by_others(made) -> None:
    names = sorted(p.name for p in made["llama"].iterdir())
    assert names == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]  # no temporary files left behind
    assert (made["llama"] / "model.safetensors").stat().st_mode & 0o044 == 0o044
    gen = transformers.GenerationConfig.from_pretrained(made["llama"])
    cfg = json.loads((made["llama"] / "config.json").read_text())
    assert gen.eos_token_id == cfg["eos_token_id"] and gen.pad_token_id == cfg["pad_token_id"]


def test_remaking_over_an_old_checkpoint_replaces_it(tmp_path: Path, made) -> None:
    d = tmp_path / "m"
    make_model(d, "qwen3_5_moe", "tiny", seed=5)
    (d / "model.safetensors.index.json").write_text('{"weight_map": {}}')  # e.g. left by a sharded checkpoint
    make_model(d, "llama", "tiny", seed=0)
    assert not (d / "model.safetensors.index.json").exists()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (d / name).read_bytes() == (made["llama"] / name).read_bytes(), name


@pytest.mark.parametrize("arch", ARCHS)
def test_safetensors_source_serves_every_planned_tensor(arch, made) -> None:
    """The project's own loader finds every canonical name (experts one at a time, MTP included)."""
    from sangama_p2p.model.weights import SafetensorsSource

    src = SafetensorsSource(made[arch])
    try:
        plan = tensor_plan(get_preset(arch, "tiny"))
        assert set(src.names()) == {name for name, _ in plan}
        for name, shape in plan:
            assert src.has(name)
            assert tuple(src.get(name, torch.float32).shape) == shape, name
    finally:
        src.close()


def test_cli_tie_and_rope_scaling_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["make-model", str(tmp_path / "t"), "--arch", "qwen3", "--preset", "micro", "--tie-embeddings",
                   "--rope-scaling", "llama3:8"])
    assert rc == 0
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is True and cfg["architectures"] == ["Qwen3ForCausalLM"]
    assert cfg["rope_parameters"] == {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 64, "rope_theta": 1e6, "rope_type": "llama3"}
    with safe_open(str(tmp_path / "t" / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert cli_main(["make-model", str(tmp_path / "u"), "--arch", "qwen2", "--preset", "micro", "--untie-embeddings",
                     "--rope-scaling", "linear:2.5"]) == 0
    cfg = json.loads((tmp_path / "u" / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["rope_parameters"]["factor"] == 2.5
    # the untied file holds the tied one's draws plus an lm_head (drawn last): the option changes nothing else
    tied = load_file(str(make_model(tmp_path / "v", "qwen2", "micro") / "model.safetensors"))
    untied = load_file(str(tmp_path / "u" / "model.safetensors"))
    assert set(untied) - set(tied) == {"lm_head.weight"}
    assert all(torch.equal(t, untied[n]) for n, t in tied.items())
    for bad in ("cubic:2", "linear", "llama3:1:2"):
        with pytest.raises(SystemExit):
            cli_main(["make-model", str(tmp_path / "w"), "--arch", "llama", "--rope-scaling", bad])
    with pytest.raises(UnsupportedModelError, match="qwen3_5_moe checkpoints are made with their preset"):
        make_model(tmp_path / "x", "qwen3_5_moe", "tiny", tie_word_embeddings=True)
    with pytest.raises(UnsupportedModelError, match="RoPE scaling"):
        make_model(tmp_path / "x", "llama", "micro", rope_scaling={"rope_type": "yarn", "factor": 2.0})
