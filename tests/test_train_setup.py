"""``benchmarks/train_tiny.py`` and ``train_drafter.py`` run from the README's set-up: every module they import is
the standard library's, the package's own, or a distribution of its dependencies and of the ``train`` extra, which
the README names."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ("train_tiny.py", "train_drafter.py")
IMPORT_NAMES = {"huggingface_hub": "huggingface_hub", "multiaddr": "multiaddr"}  # import name -> distribution


def _distributions(extra: str) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *project["optional-dependencies"][extra]]
    return {re.split(r"[<>=!~\[ ;]", r, maxsplit=1)[0].lower().replace("-", "_") for r in reqs}


def _imported(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            out.add(node.module.split(".")[0])
    return out


def test_the_training_scripts_need_only_the_train_extra() -> None:
    have = _distributions("train")
    assert "transformers" in have
    local = {p.stem for p in (ROOT / "benchmarks").glob("*.py")}
    for script in SCRIPTS:
        missing = {m for m in _imported(ROOT / "benchmarks" / script)
                   if m not in sys.stdlib_module_names and m != "sangama_p2p" and m not in local
                   and IMPORT_NAMES.get(m, m) not in have}
        assert not missing, (script, missing)


def test_the_readme_names_the_extra_and_the_scripts() -> None:
    readme = (ROOT / "README.md").read_text()
    assert 'pip install -e ".[train]"' in readme
    assert all(f"benchmarks/{s}" in readme for s in SCRIPTS)
