"""net/ owns the network: nothing else in the package imports py-libp2p or multiaddr (type-only and in-function imports
included). Circles, in net/ and everywhere else, are tests/test_house.py's."""

from __future__ import annotations

import ast
from pathlib import Path

import sangama_p2p

PKG = Path(sangama_p2p.__file__).parent
NET = PKG / "net"
NETWORK_LIBRARIES = {"libp2p", "multiaddr"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every module ``path`` imports, anywhere in the file, as absolute names, with the line."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    return _imports_in(path.read_text(), package)


def _imports_in(source: str, package: str) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((a.name, node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            out.append((module, node.lineno))
            out.extend((f"{module}.{a.name}", node.lineno) for a in node.names)  # ``from . import dial``
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            out.append((str(node.args[0].value), node.lineno))
    return out


def test_nothing_outside_net_imports_libp2p_or_multiaddr() -> None:
    offenders = []
    files = [p for p in PKG.rglob("*.py") if NET not in p.parents]
    assert len(files) > 50  # the whole package was read
    for path in files:
        for module, line in _imports(path):
            if module.split(".")[0] in NETWORK_LIBRARIES:
                offenders.append(f"{path.relative_to(PKG)}:{line} imports {module}")
    assert not offenders, "network libraries are net/'s business (give net/ the function instead):\n" + "\n".join(
        offenders)


def test_the_check_sees_imports_in_functions_type_blocks_and_relative_ones() -> None:
    source = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .dial import race\n"
              "def f():\n    from libp2p.peer.id import ID\n    import multiaddr\n"
              "    importlib.import_module('libp2p.kad_dht')\n    from ..net import node\n")
    found = {m for m, _ in _imports_in(source, "sangama_p2p.net")}
    assert {"libp2p.peer.id", "multiaddr", "libp2p.kad_dht", "sangama_p2p.net.dial", "sangama_p2p.net.node"} <= found
