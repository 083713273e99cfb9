"""The house: the package's import graph has no circle (counting imports inside functions and TYPE_CHECKING blocks,
which hide them), each part imports only the parts below it (the table below is the layering of
docs/architecture.md), no source file is over 450 lines, and the CLI's parser loads nothing heavy (torch, trio,
libp2p: seconds of start-up that ``--help`` must not pay)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PACKAGE = SRC / "sangama_p2p"
MAX_LINES = 450

# what each part of the package may import from the rest of it ("__init__" is the package face)
MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "_version": set(),
    "wire": {"errors"},
    "guesses": {"errors", "wire"},
    "tensors": {"errors", "wire"},
    "positions": {"errors"},
    "clock": set(),  # the network code's time: trio's clock (a MockClock in a simulation), the wall
    "generation": {"errors", "positions", "clock"},
    "placement": set(),  # pure: peers, speeds, links, depth -> ranges; imports nothing of ours
    "model": {"errors", "guesses", "wire", "positions", "generation"},
    "net": {"errors", "wire", "_version", "clock"},
    "hub": {"errors", "model"},
    "dashboard": {"errors", "net"},  # the swarm's web page and /metrics: a survey and its view, no torch
    "api": {"errors", "guesses", "model"},
    "client": {"errors", "guesses", "net", "wire", "_version", "positions", "generation", "clock"},
    "stage": {"errors", "guesses", "model", "net", "tensors", "wire", "_version", "positions", "placement", "clock"},
    "config": {"errors", "guesses", "model", "net", "wire", "api", "client", "stage"},
    "peer": {"errors", "guesses", "model", "net", "wire", "api", "client", "stage", "config", "_version", "placement",
             "dashboard"},
    "aio": {"errors", "model", "net", "api", "config", "peer"},
    "cli": {"errors", "guesses", "positions", "generation", "model", "net", "hub", "api", "client", "stage", "config",
            "dashboard",
            "peer", "aio", "__init__", "_version"},
    "__init__": {"errors", "_version", "peer", "config"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Project modules that ``path`` imports anywhere in it (top level, functions, TYPE_CHECKING blocks alike)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {m: _imports(p, modules) for m, p in files.items()}
    for m in modules:
        # importing a.b.c runs a/__init__.py and a/b/__init__.py first; a module's own packages are running already
        # when it runs (a package's face that re-exports its modules is no circle)
        own = {m.rsplit(".", k)[0] for k in range(1, m.count(".") + 1)}
        for dep in list(graph[m]):
            parent = dep.rpartition(".")[0]
            while parent:
                if parent in modules and parent != m:
                    graph[m].add(parent)
                parent = parent.rpartition(".")[0]
        graph[m] -= own
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_in_the_package() -> None:
    graph = _graph()
    # cli/main.py imports its command modules with importlib: draw those arrows too
    from sangama_p2p.cli.main import _COMMAND_MODULES

    graph["sangama_p2p.cli.main"] |= {f"sangama_p2p.cli.{m}" for m in _COMMAND_MODULES}
    assert len(graph) > 100 and graph["sangama_p2p.net.dial"]  # the whole package was read, relative imports too
    assert _circles(graph) == []


def _part(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_each_part_imports_only_what_lies_below_it() -> None:
    graph = _graph()
    parts = {_part(m) for m in graph}
    assert parts == set(MAY_IMPORT), f"parts without a row in MAY_IMPORT (or rows for none): {parts ^ set(MAY_IMPORT)}"
    wrong = sorted(f"{m} imports {d}" for m, deps in graph.items() for d in deps
                   if _part(d) != _part(m) and _part(d) not in MAY_IMPORT[_part(m)])
    assert wrong == [], "imports against the layering:\n" + "\n".join(wrong)


def test_no_source_file_is_over_450_lines() -> None:
    long = sorted(f"{p.relative_to(SRC)}: {n}" for p in PACKAGE.rglob("*.py")
                  if (n := len(p.read_text().splitlines())) > MAX_LINES)
    assert long == []


def test_the_circle_finder_finds_a_circle() -> None:
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_parser_loads_nothing_heavy() -> None:
    code = ("import sys; from sangama_p2p.cli.main import build_parser; build_parser()\n"
            "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
            "{'torch', 'trio', 'libp2p', 'multiaddr', 'transformers', 'huggingface_hub', 'starlette', 'numpy'})))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == ""
