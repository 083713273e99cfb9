"""benchmarks/train_tiny.py: its MTP head computes what the runtime's MTP layer computes, training lowers the loss,
and the saved checkpoint has exactly the made checkpoint's tensors and loads in our runtime."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from sangama_p2p.model.checkpoint import open_checkpoint  # noqa: E402
from sangama_p2p.model.make import make_model  # noqa: E402
from sangama_p2p.model.stage import StageModel, StepInput  # noqa: E402
from sangama_p2p.model.state import Segment  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_tiny.py"


@pytest.fixture(scope="module")
def tt():
    spec = importlib.util.spec_from_file_location("train_tiny_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("tt") / "m", "qwen3_5_moe", "tiny", seed=3)


def test_recurrent_delta_rule_matches_transformers_chunked(tt) -> None:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 37, 2, 16, generator=g), torch.randn(2, 37, 2, 16, generator=g)
    v = torch.randn(2, 37, 4, 16, generator=g)
    decay, beta = -torch.rand(2, 37, 4, generator=g), torch.rand(2, 37, 4, generator=g)
    ref, _ = hf.torch_recurrent_gated_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    ours, _ = tt.recurrent_delta_rule(q, k, v, g=decay, beta=beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_mtp_head_and_main_hidden_match_the_runtime(tt, made: Path) -> None:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    reference = hf.torch_chunk_gated_delta_rule
    tr = tt.Trainer(made, 1e-3, chain=1)
    tr.model.eval(), tr.mtp.eval()
    ids = torch.randint(0, 1000, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        main, mtp, _ = tr.losses(ids)  # runs the main model with the swapped-in delta rule
        h = tr.model.model(input_ids=ids, use_cache=False).last_hidden_state
        cos, sin = tr._pos_emb
        u = tr.mtp(h[:, :-1], tr.model.model.embed_tokens(ids[:, 1:]), (cos[:, :-1], sin[:, :-1]))
    assert hf.torch_chunk_gated_delta_rule is reference  # the swap does not leak into other tests' oracle
    assert torch.isfinite(main) and torch.isfinite(mtp[0])
    ck = open_checkpoint(made)
    stage = StageModel.load(ck.spec, ck.source, 0, ck.spec.num_layers)
    sess = stage.new_session(16)
    normed = stage.final_normed(stage.forward([StepInput(sess, 0, tokens=ids[0])]))
    torch.testing.assert_close(normed, h[0], atol=1e-4, rtol=1e-4)  # h_t: final-normed in both
    theirs = stage.mtp_forward(normed[:-1], ids[0, 1:], [Segment(sess, 0, 11)])
    torch.testing.assert_close(theirs, u[0], atol=1e-4, rtol=1e-4)


def test_training_lowers_loss_and_saves_the_made_layout(tt, made: Path, tmp_path: Path) -> None:
    import shutil

    out = tmp_path / "trained"
    shutil.copytree(made, out)
    torch.manual_seed(0)
    tr = tt.Trainer(out, 3e-3, chain=2)
    batch = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(2))  # one batch, memorised
    first = None
    for _ in range(8):
        main, mtp, _acc = tr.losses(batch)
        loss = main + mtp[0] + 0.5 * mtp[1]
        first = first if first is not None else [main.item(), mtp[0].item(), mtp[1].item()]
        tr.opt.zero_grad()
        loss.backward()
        tr.opt.step()
    main, mtp, _ = tr.losses(batch)
    last = [main.item(), mtp[0].item(), mtp[1].item()]
    assert all(b < a - 0.5 for a, b in zip(first, last)), (first, last)
    tt.save_checkpoint(tr, out)
    with safe_open(str(made / "model.safetensors"), framework="pt") as a, \
            safe_open(str(out / "model.safetensors"), framework="pt") as b:
        assert set(a.keys()) == set(b.keys())
        for key in a.keys():
            assert a.get_slice(key).get_shape() == b.get_slice(key).get_shape(), key
        changed = [k for k in ("mtp.fc.weight", "lm_head.weight", "mtp.layers.0.mlp.experts.0.up_proj.weight")
                   if not torch.equal(a.get_tensor(k), b.get_tensor(k))]
        assert len(changed) >= 2
    check = tt.check_runtime(out, "def f(x):\n    ", 8)
    assert check["same_tokens_with_guesses"] is True
