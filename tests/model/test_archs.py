"""Llama (tied/untied, llama3 and linear RoPE scaling, biases), Mistral, Qwen2, Qwen3 and Qwen3-MoE against
transformers' own classes.

Each checkpoint is made by make-model (or written by transformers itself: random init, ``save_pretrained``, which fuses
the MoE experts) and run over a 3-stage chain. Tolerances: logits within 1e-4 (absolute, fp32; logits have std 2-6)
for a 16-token prefill and 16 cached one-token steps; greedy tokens equal transformers' ``generate`` exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from sangama_p2p.cli.main import main as cli_main
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.model.stage import StageModel, StepInput

transformers = pytest.importorskip("transformers")

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
LINEAR = {"rope_type": "linear", "factor": 4.0}
# name -> (arch, preset, make_model options)
MADE = {
    "llama-tied-llama3": ("llama", "micro", dict(tie_word_embeddings=True, rope_scaling=LLAMA3)),
    "llama-linear": ("llama", "micro", dict(rope_scaling=LINEAR)),
    "llama-plain": ("llama", "micro", {}),
    "qwen2-tied": ("qwen2", "tiny", {}),
    "qwen2-untied": ("qwen2", "micro", dict(tie_word_embeddings=False)),
    "qwen3": ("qwen3", "tiny", {}),
    "qwen3-tied": ("qwen3", "micro", dict(tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", "tiny", {}),
}
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
           "qwen3_moe": "Qwen3MoeForCausalLM", "mistral": "MistralForCausalLM"}
PREFILL, DECODE = 16, 16


def _hf_saved(path: Path, seed: int, **cfg) -> Path:
    """A checkpoint written by transformers: random weights of a visible scale, then ``save_pretrained``."""
    config = transformers.AutoConfig.for_model(**cfg)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if "embed" in name else p.shape[-1] ** -0.5))
                if name.endswith("mlp.gate.weight"):
                    p.mul_(4.0)
            else:
                p.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(p.shape, generator=g))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    out = {name: make_model(root / name, arch, preset, seed=11, **kw) for name, (arch, preset, kw) in MADE.items()}
    small = dict(vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=96, max_position_embeddings=256)
    # transformers' own files: fused experts [E, 2I, H] / [E, H, I], router weights not renormalised
    out["hf-qwen3_moe"] = _hf_saved(root / "hf-qwen3_moe", 3, model_type="qwen3_moe", num_experts=8,
                                    num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False, **small)
    out["hf-qwen2"] = _hf_saved(root / "hf-qwen2", 4, model_type="qwen2", tie_word_embeddings=True, **small)
    out["hf-llama-bias"] = _hf_saved(root / "hf-llama-bias", 5, model_type="llama", attention_bias=True,
                                     mlp_bias=True, **small)
    out["hf-mistral"] = _hf_saved(root / "hf-mistral", 6, model_type="mistral", sliding_window=None, **small)
    return out


def _chain(path: Path, ids: torch.Tensor) -> torch.Tensor:
    ck = open_checkpoint(path)
    n = ck.spec.num_layers
    cuts = [0, n // 3, 2 * n // 3, n]
    stages = [StageModel.load(ck.spec, ck.source, a, b) for a, b in zip(cuts, cuts[1:])]
    sessions = [s.new_session(len(ids)) for s in stages]
    rows = []
    for start, x in [(0, ids[:PREFILL])] + [(p, ids[p:p + 1]) for p in range(PREFILL, len(ids))]:
        for st, se in zip(stages, sessions):
            x = st.forward([StepInput(se, start, tokens=x) if st.is_first else StepInput(se, start, hidden=x)])
        rows.append(stages[-1].logits(x))
    return torch.cat(rows)


def _ids(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (PREFILL + DECODE,), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", [*MADE, "hf-qwen3_moe", "hf-qwen2", "hf-llama-bias", "hf-mistral"])
def test_three_stage_logits_match_transformers(ckpts, oracle, reference_logits, name) -> None:
    path = ckpts[name]
    model = oracle(path)
    cfg = json.loads((path / "config.json").read_text())
    assert type(model).__name__ == CLASSES[cfg["model_type"]]
    ids = _ids(cfg["vocab_size"])
    ref = reference_logits(model, ids, PREFILL)
    assert ref.std() > 0.5, "reference logits are degenerate; the test would prove nothing"
    diff = (_chain(path, ids) - ref).abs().max().item()
    assert diff <= 1e-4, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("name", [*MADE, "hf-qwen3_moe"])
def test_three_stage_greedy_equals_transformers_generate(ckpts, oracle, name, capsys) -> None:
    path = ckpts[name]
    model = oracle(path)
    prompt = [5, 17, 42, 99, 3, 250, 7, 11]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
    # random models with a tied head tend to repeat one token (its own embedding dominates the last hidden state);
    # their logits are checked above, row by row
    if not json.loads((path / "config.json").read_text())["tie_word_embeddings"]:
        assert len(set(ref)) >= 4, "the greedy continuation is degenerate"
    n = open_checkpoint(path).spec.num_layers
    stages = f"0:{n // 3},{n // 3}:{2 * n // 3},{2 * n // 3}:{n}"
    rc = cli_main(["generate", "--local", str(path), "--stages", stages, "--prompt-ids", ",".join(map(str, prompt)),
                   "--max-new-tokens", "24", "--ignore-eos", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == ref
    assert len(out["stages"]) == 3


def test_tied_head_is_the_embedding_and_scaling_changes_the_logits(ckpts) -> None:
    from safetensors import safe_open

    for name in ("llama-tied-llama3", "qwen2-tied", "qwen3-tied", "hf-qwen2"):
        with safe_open(str(ckpts[name] / "model.safetensors"), "pt") as f:
            assert "lm_head.weight" not in set(f.keys()), name
        ck = open_checkpoint(ckpts[name])
        assert ck.spec.tie_word_embeddings
        last = StageModel.load(ck.spec, ck.source, ck.spec.num_layers - 1, ck.spec.num_layers)
        assert last.head is last.embed and "lm_head.weight" not in ck.source.reads
    specs = {n: open_checkpoint(ckpts[n]).spec for n in ("llama-tied-llama3", "llama-linear", "llama-plain")}
    assert specs["llama-tied-llama3"].rope_llama3 == (8.0, 1.0, 4.0, 64)
    assert specs["llama-linear"].rope_linear == 4.0 and specs["llama-plain"].rope_linear is None
    # same weights (same seed and preset) with and without scaling: the scaling really reaches the logits
    ids = _ids(384)
    plain, linear = _chain(ckpts["llama-plain"], ids), _chain(ckpts["llama-linear"], ids)
    assert torch.equal(plain[0], linear[0])  # position 0 is not rotated
    assert (plain - linear).abs().max() > 0.1


def test_spec_fields_per_architecture(ckpts) -> None:
    s = {n: open_checkpoint(p).spec for n, p in ckpts.items()}
    q2 = s["qwen2-tied"]
    assert (q2.attention_bias, q2.o_proj_bias, q2.qk_norm) == (True, False, False)
    assert (s["qwen3"].attention_bias, s["qwen3"].qk_norm, s["qwen3"].head_dim) == (False, True, 64)
    moe = s["qwen3_moe"]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.shared_expert_intermediate_size, moe.norm_topk_prob) == (
        8, 2, 0, True)
    assert s["hf-qwen3_moe"].norm_topk_prob is False
    assert (s["hf-llama-bias"].attention_bias, s["hf-llama-bias"].o_proj_bias, s["hf-llama-bias"].mlp_bias) == (
        True, True, True)
    assert all(not sp.attn_output_gate and not sp.zero_centered_norm for sp in s.values())
    assert s["hf-mistral"].arch == "llama" and s["hf-mistral"].max_position_embeddings == 256


# the keys that matter of published config.json files (older layouts: rope_theta at the top, rope_scaling, no head_dim)
PUBLISHED = {
    "Llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008, rope_theta=10000.0,
                       rope_scaling=None, max_position_embeddings=4096, tie_word_embeddings=False),
    "Llama-3.2-1B": dict(model_type="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=True,
                         rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                       "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "SmolLM2-135M": dict(model_type="llama", vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "Mistral-7B-v0.1": dict(model_type="mistral", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
                            max_position_embeddings=32768, sliding_window=4096, rope_theta=10000.0),
    "Qwen2.5-0.5B": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864, rope_theta=1e6,
                         max_position_embeddings=32768, sliding_window=32768, use_sliding_window=False,
                         max_window_layers=24, tie_word_embeddings=True),
    "Qwen3-0.6B": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                       rope_theta=1e6, max_position_embeddings=40960, attention_bias=False, tie_word_embeddings=True,
                       use_sliding_window=False, sliding_window=None),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, intermediate_size=6144,
                          moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], rope_theta=1e6, max_position_embeddings=40960,
                          tie_word_embeddings=False),
}


def test_specs_of_published_config_layouts() -> None:
    from sangama_p2p.model.spec import ModelSpec

    s = {name: ModelSpec.from_hf_config(cfg) for name, cfg in PUBLISHED.items()}
    assert s["Llama-2-7b"].head_dim == 128 and s["Llama-2-7b"].rope_llama3 is None
    assert s["Llama-3.2-1B"].rope_llama3 == (32.0, 1.0, 4.0, 8192) and s["Llama-3.2-1B"].tie_word_embeddings
    assert s["Llama-3.2-1B"].rope_theta == 500000.0
    assert (s["SmolLM2-135M"].head_dim, s["SmolLM2-135M"].num_kv_heads, s["SmolLM2-135M"].rope_theta) == (
        64, 3, 100000.0)
    assert s["Mistral-7B-v0.1"].arch == "llama" and s["Mistral-7B-v0.1"].max_position_embeddings == 4096
    q2 = s["Qwen2.5-0.5B"]
    assert q2.attention_bias and not q2.o_proj_bias and q2.tie_word_embeddings and q2.max_position_embeddings == 32768
    assert s["Qwen3-0.6B"].head_dim == 128 and s["Qwen3-0.6B"].qk_norm and not s["Qwen3-0.6B"].attention_bias
    moe = s["Qwen3-30B-A3B"]
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size, moe.norm_topk_prob) == (
        128, 8, 768, True)
    assert moe.shared_expert_intermediate_size == 0 and moe.qk_norm
