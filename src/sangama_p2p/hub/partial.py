"""Partial copies of Hub files: a sparse file of the full size holding only some byte ranges, read in place.

A stage that needs a few tensors of a big file keeps the file at its real size with holes where nothing was
fetched (no disk is used there) and a manifest ``.sangama/<name>.json`` beside it listing the spans it holds. The
project's readers (GGUFFile, safe_open) and the fingerprint then work unchanged: offsets, sizes and the tensor table
are the full file's, and the fingerprint's sample windows of every tensor are among the spans fetched, so the model
fingerprint equals the full file's. The manifest is written (atomically) only after its spans arrived, so bytes of
a cut transfer are never counted as held; a later call with other layers fetches only what is missing. The name (the
Hub's) must stay inside the directory, and its manifest inside ``.sangama/`` (:func:`.names.under`).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, DownloadError, translate
from ..model.gguf.quants import row_bytes
from ..model.gguf.reader import _parse
from .fetch import HubSettings, Progress, fetch_spans
from .names import under
from .plan import Span, covers, merge_spans

__all__ = ["PartialFile", "gguf_header", "safetensors_header"]

_SPLIT = 16 << 20  # big spans are cut into requests of this size, so they run in parallel
_FIRST_PROBE = 256 << 10


class PartialFile:
    """One sparse file ``dir/name`` of ``size`` bytes and the spans it holds; ``name`` is the file's in the repo."""

    def __init__(self, directory: Path, name: str, size: int) -> None:
        where = f"the stage copy {directory}"
        self.name = name
        self.path = under(directory, name, where)
        self.manifest = under(directory / ".sangama", name + ".json", where)
        self.size = size

    def held(self) -> list[Span]:
        try:
            data = json.loads(self.manifest.read_text())
            if int(data["size"]) != self.size or self.path.stat().st_size != self.size:
                return []
            return [(int(a), int(b)) for a, b in data["spans"]]
        except (OSError, ValueError, KeyError, TypeError):  # no manifest, or a torn one: hold nothing, fetch again
            return []

    def ensure(self, spans: list[Span], ctx: "Fetcher") -> int:
        """Fetch the spans not yet held; return the bytes fetched."""
        held = self.held()
        missing = [s for s in merge_spans(spans) if not covers(held, [s])]
        if not missing:
            return 0
        for a, b in missing:
            if not 0 <= a < b <= self.size:
                raise CheckpointError(f"{self.path.name}: span {a}:{b} outside the file's {self.size} bytes")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.manifest.parent.mkdir(parents=True, exist_ok=True)
        if self.path.is_symlink():
            self.path.unlink()
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            if os.fstat(fd).st_size != self.size:
                os.ftruncate(fd, self.size)
            pieces = [(x, min(x + _SPLIT, b)) for a, b in missing for x in range(a, b, _SPLIT)]
            got = ctx.spans(self.name, pieces, fd)
            os.fsync(fd)
        finally:
            os.close(fd)
        tmp = self.manifest.with_suffix(".tmp")
        tmp.write_text(json.dumps({"size": self.size, "spans": merge_spans(held + missing)}))
        os.replace(tmp, self.manifest)
        return got

    def read(self, start: int, end: int) -> bytes:
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def remove(self) -> None:
        for p in (self.path, self.manifest):
            try:
                p.unlink()
            except FileNotFoundError:  # already gone
                pass


class Fetcher:
    """What a partial file needs to fetch: the repo at a commit, the settings, the progress and the pool."""

    def __init__(self, settings: HubSettings, repo: str, commit: str, progress: Progress, pool: Any) -> None:
        self.settings, self.repo, self.commit, self.progress, self.pool = settings, repo, commit, progress, pool
        self.fetched = 0

    def spans(self, name: str, spans: list[Span], fd: int) -> int:
        n = fetch_spans(self.settings, self.repo, self.commit, name, spans, fd, self.progress, self.pool)
        self.fetched += n
        return n


def safetensors_header(part: PartialFile, ctx: Fetcher) -> tuple[dict[str, Any], int]:
    """(header without ``__metadata__``, data start) of a safetensors file, fetching its first bytes."""
    part.ensure([(0, min(8, part.size))], ctx)
    (n,) = struct.unpack("<Q", part.read(0, 8).ljust(8, b"\0"))
    if n > min(part.size - 8, 100 << 20):
        raise CheckpointError(f"{part.path.name}: safetensors header of {n} bytes in a {part.size}-byte file")
    part.ensure([(8, 8 + n)], ctx)
    try:
        header = json.loads(part.read(8, 8 + n))
    except ValueError as exc:
        raise translate(exc, DownloadError, f"{part.path.name}: corrupt safetensors header from the Hub")
    if not isinstance(header, dict):
        raise DownloadError(f"{part.path.name}: corrupt safetensors header from the Hub")
    header.pop("__metadata__", None)
    return header, 8 + n


def gguf_header(part: PartialFile, ctx: Fetcher) -> tuple[dict[str, Any], list[tuple[str, int, int]], int]:
    """(metadata, [(tensor name, absolute offset, nbytes)], data start) of a GGUF file, fetching its header: the
    first 256 KiB, doubled until the header parses (the reader raises on a header cut short)."""
    n = min(_FIRST_PROBE, part.size)
    while True:
        part.ensure([(0, n)], ctx)
        with tempfile.NamedTemporaryFile(suffix=".gguf") as tmp:
            tmp.write(part.read(0, n))
            tmp.flush()
            try:
                meta, infos, data_start, mm, _spans = _parse(Path(tmp.name))
                del mm
                break
            except CheckpointError:
                if n >= part.size:
                    raise
        n = min(2 * n, part.size)
    tensors = []
    for name, ne, qtype, rel in infos:
        rows = 1
        for x in ne[1:]:
            rows *= int(x)
        tensors.append((name, data_start + rel, row_bytes(qtype, int(ne[0])) * rows))
    return meta, tensors, data_start
