"""The error tree is one tree: every error class Sangama defines lives in ``errors.py``, the tree drawn in its
docstring is the class hierarchy, and docs/architecture.md names every class of it."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path

import pytest

import sangama_p2p
from sangama_p2p import errors

ROOT = Path(__file__).resolve().parents[1]
_SKIP = ("sangama_p2p.cli.main",)  # nothing to skip today; kept explicit for modules with import side effects


def _all_modules() -> list[str]:
    names = []
    for info in pkgutil.walk_packages(sangama_p2p.__path__, "sangama_p2p."):
        if info.name.startswith(_SKIP):
            continue
        names.append(info.name)
    return names


def _subclasses(cls: type) -> set[type]:
    out = set()
    for sub in cls.__subclasses__():
        out |= {sub} | _subclasses(sub)
    return out


def _drawn_tree() -> dict[str, str]:
    """child -> parent, read from the tree drawn in errors.py's docstring."""
    doc = errors.__doc__ or ""
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        m = re.match(r"^\s*(?:[| ]*\+-- )?([A-Z][A-Za-z]+)\b", line)
        if not m or not line.strip().startswith(("SangamaError", "+--", "|")):
            continue
        name = m.group(1)
        depth = line.index(name)
        while stack and stack[-1][0] >= depth:
            stack.pop()
        if stack:
            parents[name] = stack[-1][1]
        stack.append((depth, name))
    return parents


def test_every_error_class_is_defined_in_errors_py():
    for name in _all_modules():
        importlib.import_module(name)
    outside = sorted(f"{c.__module__}.{c.__qualname__}" for c in _subclasses(errors.SangamaError)
                     if c.__module__.startswith("sangama_p2p") and c.__module__ != "sangama_p2p.errors")
    assert outside == [], f"error classes defined outside errors.py: {outside}"


def test_the_drawn_tree_is_the_class_hierarchy():
    drawn = _drawn_tree()
    real = {c.__name__: c.__bases__[0].__name__ for c in _subclasses(errors.SangamaError)
            if c.__module__ == "sangama_p2p.errors"}
    assert drawn == real


def test_every_error_is_exported_and_the_architecture_doc_draws_the_same_tree():
    names = {c.__name__ for c in _subclasses(errors.SangamaError) if c.__module__ == "sangama_p2p.errors"}
    assert names <= set(errors.__all__), sorted(names - set(errors.__all__))
    doc = errors.__doc__ or ""
    drawn = [line[4:] for line in doc[doc.index("    SangamaError\n"):doc.index("\nForeign errors")].splitlines() if line]
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text[text.index("```\nSangamaError\n") + 4:]
    assert block[:block.index("```")].splitlines() == drawn, "docs/architecture.md's error tree differs from errors.py's"


def test_translate_keeps_ours_and_wraps_foreign_ones():
    ours = errors.CapacityError("full")
    assert errors.translate(ours, errors.NetworkError, "dial") is ours  # the class and wire code survive
    out = errors.translate(ConnectionRefusedError(111, "Connection refused"), errors.NetworkError, "dial 1.2.3.4")
    assert type(out) is errors.NetworkError and out.__cause__ is not None
    assert str(out) == "dial 1.2.3.4: ConnectionRefusedError: [Errno 111] Connection refused"
    stage = errors.translate(TimeoutError(), errors.StageError, "next hop", errors.ErrorCode.OVERLOADED)
    assert str(stage) == "next hop: TimeoutError" and stage.code == errors.ErrorCode.OVERLOADED
    group = BaseExceptionGroup("x", [ValueError("a"), ExceptionGroup("y", [KeyError("k")])])
    assert errors.describe(group) == "ValueError: a; KeyError: 'k'"


def test_raising_a_translation_keeps_the_cause_of_ours_and_sets_the_foreign_one():
    def reraise(exc: Exception) -> None:
        try:
            raise exc
        except Exception as caught:
            raise errors.translate(caught, errors.NetworkError, "dial")  # noqa: B904 - translate sets the cause

    key = KeyError("k")
    ours = errors.StreamClosed("gone")
    ours.__cause__ = key
    with pytest.raises(errors.StreamClosed) as info:
        reraise(ours)
    assert info.value is ours and info.value.__cause__ is key  # not its own cause
    refused = ConnectionRefusedError(111, "refused")
    with pytest.raises(errors.NetworkError) as info:
        reraise(refused)
    assert info.value.__cause__ is refused and info.value.__suppress_context__
