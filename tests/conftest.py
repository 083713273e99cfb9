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
