"""client/ and stage/ never import each other; the client side needs no torch (a thin client loads no model)."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import sangama_p2p

PKG = Path(sangama_p2p.__file__).parent


def _imports(folder: str) -> set[str]:
    names: set[str] = set()
    for path in (PKG / folder).rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = "." * node.level + (node.module or "")
                names.add(base)
                names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_client_and_stage_never_import_each_other():
    client, stage = _imports("client"), _imports("stage")
    assert client and stage
    assert not [n for n in client if "stage" in n.split(".") and "model" not in n], sorted(client)
    assert not [n for n in stage if "client" in n.split(".")], sorted(stage)


def test_importing_the_client_loads_no_torch():
    import sangama_p2p.client as client

    modules = [f"sangama_p2p.client.{m.name}" for m in pkgutil.iter_modules(client.__path__)]
    script = (
        "import importlib, sys\n"
        f"for name in {modules!r}: importlib.import_module(name)\n"
        "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'sangama_p2p.stage'}"
        " or m.startswith('sangama_p2p.stage'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == ""
