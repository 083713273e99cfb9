"""Stage tests share the in-process fleet of tests/client/fleet.py (loaded by path: test folders are no packages)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest


def _load_fleet():
    name = "sangama_pipeline_fleet"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent.parent / "client" / "fleet.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


fleet_module = _load_fleet()


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory) -> Path:
    return fleet_module.make_checkpoint(tmp_path_factory.mktemp("stage"))


@pytest.fixture(scope="session")
def fl():
    return fleet_module
