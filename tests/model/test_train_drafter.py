"""benchmarks/train_drafter.py: the teacher's tokens are our runtime's greedy tokens, training on them raises the
MTP layer's agreement with the main model, and the saved checkpoint changes only the ``mtp.*`` tensors."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from sangama_p2p.model.chain import LocalChain  # noqa: E402
from sangama_p2p.model.checkpoint import open_checkpoint  # noqa: E402
from sangama_p2p.model.make import make_model  # noqa: E402
from sangama_p2p.model.spec import LayerRange  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "train_drafter.py"


@pytest.fixture(scope="module")
def td():
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports train_tiny beside it
    try:
        spec = importlib.util.spec_from_file_location("train_drafter_under_test", SCRIPT)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return mod


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("td") / "m", "qwen3_5_moe", "tiny", seed=5)


def test_teacher_tokens_are_the_runtimes_greedy_tokens(td, made: Path) -> None:
    ids = torch.randint(2, 1000, (400,), generator=torch.Generator().manual_seed(0))
    seqs = td.self_generated(made, ids, 3, 8, 10, seed=1)
    assert seqs.shape == (3, 18)
    teacher = td.Teacher(made)
    hidden, targets = teacher.run(seqs)
    assert hidden.shape == (3, 18, 64) and targets.shape == (3, 18)
    # after the prompt every token was the runtime's greedy choice: the teacher predicted exactly it
    assert torch.equal(targets[:, 7:-1], seqs[:, 8:])
    ck = open_checkpoint(made)
    chain = LocalChain.load(ck, [LayerRange(0, ck.spec.num_layers)])
    again = chain.generate(seqs[0, :8].tolist(), 10, stop_at_eos=False)
    assert again.tokens == seqs[0, 8:].tolist()


def test_training_raises_agreement_and_saves_only_the_mtp_layer(td, made: Path, tmp_path: Path) -> None:
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

    torch.manual_seed(0)
    ids = torch.randint(2, 1000, (400,), generator=torch.Generator().manual_seed(2))
    seqs = td.self_generated(made, ids, 8, 6, 18, seed=3)
    teacher = td.Teacher(made)
    hidden, targets = teacher.run(seqs)
    cfg = teacher.model.config
    mtp = td.MTPHead(cfg, hf.Qwen3_5MoeDecoderLayer, hf.Qwen3_5MoeRMSNorm, cfg.layer_types.index("full_attention"))
    mtp.load_checkpoint(load_file(str(made / "model.safetensors")))
    for p in teacher.model.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(mtp.parameters(), lr=3e-3)
    with torch.no_grad():
        before, _ = td.depth_losses(mtp, teacher, hidden, seqs, targets, 2)
    for _ in range(30):
        losses, _ = td.depth_losses(mtp, teacher, hidden, seqs, targets, 2)
        opt.zero_grad()
        sum(losses).backward()
        opt.step()
    with torch.no_grad():
        after, _ = td.depth_losses(mtp, teacher, hidden, seqs, targets, 2)
    assert all(float(a) < 0.8 * float(b) for a, b in zip(after, before))
    assert not any(p.grad is not None for p in teacher.model.parameters())  # the main model stays frozen

    out = tmp_path / "drafter"
    td.save_mtp(made, out, mtp)
    old, new = load_file(str(made / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(old) == set(new)
    changed = {k for k in old if not torch.equal(old[k], new[k])}
    assert changed and all(k.startswith("mtp.") for k in changed)
    assert (out / "config.json").read_bytes() == (made / "config.json").read_bytes()
    ck = open_checkpoint(out)
    chain = LocalChain.load(ck, [LayerRange(0, ck.spec.num_layers)])
    prompt = seqs[0, :6].tolist()
    assert chain.generate(prompt, 12, guesses=2, stop_at_eos=False).tokens == \
        chain.generate(prompt, 12, stop_at_eos=False).tokens
