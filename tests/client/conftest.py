from __future__ import annotations

from pathlib import Path

import pytest

from .fleet import make_checkpoint


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("pipeline"))
