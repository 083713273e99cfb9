"""``--device``: the forms it takes, the one-line error without CUDA, and (on a GPU) a chain on CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sangama_p2p.errors import DeviceError, ModelError
from sangama_p2p.model.device import default_dtype, resolve_device

NO_CUDA = "no CUDA device here (torch.cuda.is_available() is False)"


def test_cpu_and_its_dtype() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    assert default_dtype(torch.device("cpu"), None) == "float32"
    assert default_dtype(torch.device("cuda", 0), None) == "bfloat16"
    assert default_dtype(torch.device("cuda", 0), "float32") == "float32"


@pytest.mark.parametrize("name", ["gpu", "cuda:", "cuda:x", "cpu:0", "cuda:-1", "", "mps"])
def test_malformed_devices(name: str) -> None:
    with pytest.raises(DeviceError, match="must be cpu, cuda or cuda:N"):
        resolve_device(name)
    assert issubclass(DeviceError, ModelError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("name", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_cuda_is_a_clear_error(name: str) -> None:
    with pytest.raises(DeviceError, match="use --device cpu") as info:
        resolve_device(name)
    assert "\n" not in str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present")
@pytest.mark.parametrize("argv", [
    ["generate", "--local", "/nonexistent/model.gguf", "--prompt-ids", "1,2", "--device", "cuda"],
    ["join", "--model", "/nonexistent/model", "--device", "cuda:1"],
    ["demo", "--device", "cuda"],
])
def test_cli_device_cuda_without_cuda_exits_with_one_line(argv: list[str], tmp_path: Path) -> None:
    """Checked before the checkpoint is read or a fleet starts: exit 2, one line on stderr."""
    out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", *argv, *(
        ["--workdir", str(tmp_path)] if argv[0] == "demo" else [])], capture_output=True, text=True, timeout=120,
        cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("sangama-peer: error: --device cuda"), out.stderr
    assert "use --device cpu" in lines[0]


def test_generate_local_on_cpu_with_the_flag(checkpoints: dict[str, Path]) -> None:
    out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "generate", "--local",
                          str(checkpoints["made-llama"]), "--prompt-ids", "1,2,3", "--max-new-tokens", "3",
                          "--device", "cpu", "--threads", "1", "--json"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"tokens"' in out.stdout


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("name", ["made-llama", "made-qwen"])
def test_chain_on_cuda_equals_cpu_greedy(checkpoints: dict[str, Path], name: str) -> None:
    """Three stages on cuda:0 in fp32 give the CPU's greedy tokens; caches and ring live on the device."""
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import parse_stages

    ckpt = open_checkpoint(checkpoints[name], need_tokenizer=False)
    n = ckpt.spec.num_layers
    ranges = parse_stages(f"0:{n // 3},{n // 3}:{2 * n // 3},{2 * n // 3}:{n}", n)
    cpu = LocalChain.load(ckpt, ranges).generate([1, 2, 3, 4], 8)
    gpu_chain = LocalChain.load(ckpt, ranges, device=resolve_device("cuda:0"))
    assert all(s.device.type == "cuda" for s in gpu_chain.stages)
    for stage in gpu_chain.stages:
        state = stage.new_session(16, ring=2)
        held = [t for st in state.layers.values() for t in vars(st).values() if isinstance(t, torch.Tensor)]
        assert held and all(t.device.type == "cuda" for t in held)
    assert gpu_chain.generate([1, 2, 3, 4], 8).tokens == cpu.tokens


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("guesses", [0, 2])
def test_sampled_generation_on_cuda_draws_and_repeats_with_its_seed(checkpoints: dict[str, Path],
                                                                     guesses: int) -> None:
    """Issue 30, item 3: the draws used a CPU generator on CUDA tensors (a sampled CUDA last stage failed). They are
    made on the CPU now: a seeded sampled generation on cuda runs, with guesses too, and repeats itself."""
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.sampling import SamplingParams
    from sangama_p2p.model.spec import parse_stages

    ckpt = open_checkpoint(checkpoints["made-qwen"], need_tokenizer=False)
    n = ckpt.spec.num_layers
    chain = LocalChain.load(ckpt, parse_stages(f"0:{n // 2},{n // 2}:{n}", n), device=resolve_device("cuda:0"))
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    first = chain.generate([1, 2, 3, 4], 12, sampling, guesses=guesses).tokens
    assert len(first) == 12
    assert chain.generate([1, 2, 3, 4], 12, sampling, guesses=guesses).tokens == first


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
def test_a_cuda_stage_budgets_its_caches_from_the_device_free_memory() -> None:
    from sangama_p2p.stage.config import CPU_MEMORY_BUDGET, GPU_BUDGET_SHARE, default_memory_budget

    free, _ = torch.cuda.mem_get_info(0)
    budget = default_memory_budget(resolve_device("cuda:0"))
    assert budget > CPU_MEMORY_BUDGET and abs(budget - GPU_BUDGET_SHARE * free) < 0.05 * free


def test_only_a_cpu_stage_runs_short_steps_on_its_event_loop() -> None:
    """Issue 30, item 3: a CUDA step ends in a device synchronisation, which blocked the trio thread."""
    from types import SimpleNamespace

    from sangama_p2p.stage.config import StageConfig
    from sangama_p2p.stage.server import _inline_max_s

    config = StageConfig("m", 0, 4, inline_step_s=0.01)
    assert _inline_max_s(SimpleNamespace(device=torch.device("cpu")), config) == 0.01
    assert _inline_max_s(SimpleNamespace(device=torch.device("cuda", 0)), config) == 0.0
    assert _inline_max_s(SimpleNamespace(), config) == 0.01
