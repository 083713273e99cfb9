"""``hf:ORG/REPO[@REVISION][:FILE.gguf]``: a model named on the Hugging Face Hub (pure parsing, no I/O)."""

from __future__ import annotations

import dataclasses
import re

from ..errors import CheckpointError

__all__ = ["HubSpec", "is_hub_spec", "parse_hub_spec"]

PREFIX = "hf:"
_PART = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_RE = re.compile(rf"^(?P<repo>{_PART}/{_PART})(?:@(?P<rev>[^:@\s]+))?(?::(?P<file>[^\s]+))?$")


@dataclasses.dataclass(frozen=True)
class HubSpec:
    """A repo, an optional revision (branch, tag or commit; None: ``main``) and an optional file in it."""

    repo: str
    revision: str | None = None
    filename: str | None = None

    def __str__(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        file = f":{self.filename}" if self.filename else ""
        return f"{PREFIX}{self.repo}{rev}{file}"


def is_hub_spec(value: object) -> bool:
    return isinstance(value, str) and value.startswith(PREFIX)


def parse_hub_spec(value: str) -> HubSpec:
    """Parse ``hf:ORG/REPO[@REVISION][:FILE]``; a file must be a ``.gguf`` (safetensors repos are taken whole)."""
    if not is_hub_spec(value):
        raise CheckpointError(f"{value!r} is not a Hub model (expected hf:ORG/REPO[@REVISION][:FILE.gguf])")
    m = _RE.match(value[len(PREFIX):])
    if m is None:
        raise CheckpointError(f"{value!r} is not a valid Hub model (expected hf:ORG/REPO[@REVISION][:FILE.gguf])")
    file = m.group("file")
    if file is not None and (not file.endswith(".gguf") or file.startswith("/") or ".." in file.split("/")):
        raise CheckpointError(f"{value!r}: the file after ':' must be a .gguf path inside the repo, got {file!r}")
    return HubSpec(m.group("repo"), m.group("rev"), file)
