"""What a Hub server says that becomes a path here: file names (its listing, a shard index) and commit shas.

A server (a mirror through ``HF_ENDPOINT``, or one that lies) chooses these strings, and they are joined onto
directories of the cache. Each is checked before it is used (pure functions, no I/O but ``Path.resolve``): a file
name is a relative POSIX path of plain components, and the path it names must stay under its directory once
resolved; a commit is 40 hex digits. Anything else is a :class:`DownloadError` naming the string.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..errors import DownloadError

__all__ = ["check_commit", "check_name", "under"]

_COMMIT = re.compile(r"[0-9a-f]{40}")


def check_name(name: object, where: str) -> str:
    """``name`` if it is a relative ``/``-separated path of plain components (no ``..``, ``.`` or empty ones, no
    backslash, NUL or other control character, not absolute); else DownloadError naming it and ``where`` it came
    from."""
    if not isinstance(name, str):
        raise DownloadError(f"{where} refuses the file name {name!r}: not a string")
    why = None
    if not name:
        why = "empty"
    elif name.startswith("/"):
        why = "an absolute path"
    elif "\\" in name:
        why = "a backslash"
    elif any(ord(c) < 32 or ord(c) == 127 for c in name):
        why = "a NUL or control character"
    elif ".." in name.split("/"):
        why = "a '..' component"
    elif any(part in ("", ".") for part in name.split("/")):
        why = "an empty or '.' component"
    if why is not None:
        raise DownloadError(f"{where} refuses the file name {name!r}: {why} (a repo's file names stay inside it)")
    return name


def check_commit(sha: object, where: str) -> str:
    """``sha`` if it is a commit id (40 lowercase hex digits); else DownloadError naming it."""
    if not isinstance(sha, str) or _COMMIT.fullmatch(sha) is None:
        raise DownloadError(f"{where} gave {sha!r} as its commit, which is not a commit sha (40 lowercase hex digits)")
    return sha


def under(directory: Path, name: str, where: str) -> Path:
    """``directory / name``, checked: ``name`` passes :func:`check_name` and the path stays under ``directory``
    once the directories on the way are resolved (a link among them that leads out is refused). The last component
    is not resolved: it may be a link into the huggingface_hub cache that this path replaces or reads."""
    check_name(name, where)
    path = directory / name
    root = directory.resolve()
    if not path.parent.resolve().is_relative_to(root):
        raise DownloadError(f"{where} refuses the file name {name!r}: {path} leads out of {directory}")
    return path
