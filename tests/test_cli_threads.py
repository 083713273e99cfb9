"""``--threads N`` (default: half the cores the process may run on, at least 1) is set at the CLI edge for join,
generate --local and demo's stage processes; importing the package sets nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sangama_p2p.cli import threads
from sangama_p2p.cli.main import main


def test_available_cores_follows_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 3, 5})
    assert threads.available_cores() == 3


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (3, 1), (4, 2), (16, 8)])
def test_the_default_leaves_half_the_cores_to_other_processes(cores: int, expected: int) -> None:
    """On a busy 2-core machine every core stalled torch's threads (3-5 tokens/s instead of 10-13 with one):
    the default keeps half the cores free, and never goes below one thread."""
    assert threads.default_threads(cores) == expected


def test_the_default_follows_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(6)))
    assert threads.default_threads() == 3


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
@pytest.mark.parametrize("cpus, expected", [("0", "1"), ("0,1", "1")])
def test_default_is_half_the_cores_this_process_was_given(cpus: str, expected: str) -> None:
    """Under ``taskset`` the default follows the cores given; importing the package leaves torch's own default
    alone."""
    if not {int(c) for c in cpus.split(",")} <= os.sched_getaffinity(0):
        pytest.skip(f"cores {cpus} are not all ours here")
    code = ("import torch, sangama_p2p, sangama_p2p.cli.main; before = torch.get_num_threads(); "
            "from sangama_p2p.cli.threads import set_threads; "
            "print(before, set_threads(None), torch.get_num_threads())")
    out = subprocess.run(["taskset", "-c", cpus, sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, env=dict(os.environ, OMP_NUM_THREADS="2")).stdout.split()
    assert out == ["2", expected, expected]


@pytest.mark.parametrize("given, expected", [(["--threads", "3"], 3), ([], None)])
def test_generate_local_sets_the_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given, expected) -> None:
    from sangama_p2p.model.make import make_model

    model = make_model(tmp_path / "m", "llama", "tiny")
    calls: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    assert main(["generate", "--local", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "1", *given]) == 0
    assert calls == [expected if expected is not None else threads.default_threads()]


def test_demo_refuses_zero_threads(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--threads", "0"])
    assert exc.value.code == 2 and "argument --threads" in capsys.readouterr().err


@pytest.mark.parametrize("given, fused", [(["--dequantize-per-use"], False), ([], True)])
def test_generate_local_dequantize_per_use_switch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given,
                                                  fused) -> None:
    from sangama_p2p.model.make import make_model
    from sangama_p2p.model.stage import StageModel

    model = make_model(tmp_path / "m", "llama", "tiny")
    seen: list[bool] = []
    real = StageModel.load.__func__  # type: ignore[attr-defined]

    def load(cls, *a, **kw):
        seen.append(kw["fused"])
        return real(cls, *a, **kw)

    monkeypatch.setattr(StageModel, "load", classmethod(load))
    argv = ["generate", "--local", str(model), "--prompt-ids", "1,2", "--max-new-tokens", "1", "--threads", "1"]
    assert main([*argv, *given]) == 0
    assert seen == [fused]
