from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .fleet import make_checkpoint


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    """Tiny matrices on 2 shared cores: one intra-op thread is several times faster than the default."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("pipeline"))
