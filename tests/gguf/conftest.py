from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers module


import pytest  # noqa: E402


@pytest.fixture
def torch_kernels(monkeypatch):
    """Quantized weights repacked for torch's int4 kernels (packed.py), as without ggml (SANGAMA_KERNELS=torch)."""
    from sangama_p2p.model.gguf import ggml_kernels

    monkeypatch.setattr(ggml_kernels, "binding", lambda: None)
