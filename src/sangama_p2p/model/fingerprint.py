"""A checkpoint's identity: one model fingerprint that every stage of it agrees on, and per-part content hashes.

Two peers may announce the same model id yet serve different weights (another seed, another fine-tune, another
architecture, another quantization). Chaining them gives wrong tokens or a protocol error, so every stage computes,
when it loads, the :class:`ModelIdentity` of its checkpoint, and the serving record carries it:

* ``fingerprint`` (32 hex digits, blake2b-128): a hash of the file format, the architecture and every
  :class:`~sangama_p2p.model.spec.ModelSpec` field that changes numbers (sizes, heads, RoPE, norm eps, layer types,
  experts, tied embeddings...: all fields except the token ids and ``max_position_embeddings``), the whole tensor
  table (canonical name, shape, stored type and byte size of *every* tensor of the checkpoint, from the headers
  alone) and a *content sample* of every tensor (:data:`SAMPLE_WINDOWS` windows of :data:`SAMPLE_BYTES` bytes spread
  over its stored bytes, first and last included). Any stage of one checkpoint computes the same fingerprint, whatever
  layers it holds, reading a few pages per tensor. Checkpoints of other seeds, fine-tunes, dtypes or quantizations
  differ in all of these bytes, so they differ here; the identity is per file format (a GGUF and a safetensors copy
  of one model have other tensor types, and compute other numbers). A change confined to bytes between the samples
  (one flipped byte in the middle of a tensor) leaves the fingerprint as it is: the part hashes catch that.
* ``layer_hashes``: blake2b-128 of all stored bytes (plus name, type and shape) of each part the stage holds, so
  a stage hashes only what it loaded: ``"0"``, ``"1"``, ... for decoder layers, ``"embed"`` for the token
  embedding, ``"head"`` for everything else (final norm, output head, MTP layers). Two peers of one fingerprint that
  hold the same part must agree on its hash; ``status`` (and a verifier) tell which parts differ.
* ``num_layers``: the model's depth, from the fingerprinted config. Clients take the depth from here, never from the
  deepest range a peer announces.

Sharding does not change the identity (a single ``model.safetensors`` and the same tensors split over shards agree),
nor do the name prefixes that :mod:`~sangama_p2p.model.weights` normalises.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, translate
from .spec import ModelSpec
from .weights import layer_of

__all__ = [
    "SAMPLE_BYTES",
    "SAMPLE_WINDOWS",
    "ModelIdentity",
    "TensorEntry",
    "checkpoint_identity",
    "model_fingerprint",
    "part_hashes",
    "parts_of",
    "stage_identity",
    "tensor_table",
]

VERSION = 1  # bump when what the fingerprint covers changes: old and new peers then never agree
SAMPLE_WINDOWS = 8
SAMPLE_BYTES = 64
_NOT_NUMERICS = frozenset({"eos_token_ids", "bos_token_id", "pad_token_id", "max_position_embeddings"})
_MAX_SAFETENSORS_HEADER = 100 << 20
_BLK_RE = re.compile(r"^blk\.(\d+)\.")
_CHUNK = 16 << 20


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """One stored tensor: its canonical name, shape, stored type (``F32``, ``BF16``, ``Q4_K`` ...), the part it
    belongs to, and where its bytes are."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    part: str
    path: Path
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class ModelIdentity:
    """What a stage announces about its checkpoint (see the module docstring)."""

    fingerprint: str
    num_layers: int
    layer_hashes: tuple[tuple[str, str], ...] = ()  # (part, 32 hex digits), the parts this stage holds

    def hash_of(self, part: str) -> str | None:
        return dict(self.layer_hashes).get(part)


def _part(name: str) -> str:
    layer = layer_of(name)
    if layer is not None:
        return str(layer)
    return "embed" if name == "model.embed_tokens.weight" else "head"


def parts_of(names: Iterable[str]) -> frozenset[str]:
    """The parts that the canonical tensor ``names`` (e.g. ``StageModel.loaded_names``) belong to."""
    return frozenset(_part(n) for n in names)


# ---- the tensor table ----------------------------------------------------------------------------------------
def _safetensors_header(path: Path) -> tuple[dict[str, Any], int]:
    """(header map without ``__metadata__``, byte offset where the data starts) of one safetensors file."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise CheckpointError(f"{path} is too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_SAFETENSORS_HEADER:
                raise CheckpointError(f"{path}: safetensors header of {n} bytes")
            raw = f.read(n)
    except OSError as exc:
        raise translate(exc, CheckpointError, f"cannot read {path}")
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise translate(exc, CheckpointError, f"corrupt safetensors header in {path}")
    if not isinstance(header, dict):
        raise CheckpointError(f"corrupt safetensors header in {path}: not an object")
    header.pop("__metadata__", None)
    return header, 8 + n


def _safetensors_entries(source: Any) -> list[TensorEntry]:
    by_file: dict[str, dict[str, str]] = {}  # file -> raw name -> canonical
    for canonical, (fname, raw) in source.tensor_files().items():
        by_file.setdefault(fname, {})[raw] = canonical
    out = []
    for fname, names in sorted(by_file.items()):
        path = Path(source.path) / fname
        header, data_start = _safetensors_header(path)
        for raw, canonical in names.items():
            info = header.get(raw)
            try:
                begin, end = (int(x) for x in info["data_offsets"])
                shape = tuple(int(x) for x in info["shape"])
                dtype = str(info["dtype"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{path}: no valid header entry for tensor {raw}") from exc
            if not 0 <= begin <= end:
                raise CheckpointError(f"{path}: tensor {raw} has data offsets {begin}:{end}")
            out.append(TensorEntry(canonical, shape, dtype, _part(canonical), path, data_start + begin, end - begin))
    return out


def _gguf_entries(source: Any, spec: ModelSpec) -> list[TensorEntry]:
    file = source.file
    canonical = source.canonical_names()  # GGUF name -> a canonical name it answers for
    out = []
    for name, info in file.tensors.items():
        if name in canonical:
            part = _part(canonical[name])
        elif (m := _BLK_RE.match(name)) is not None:
            part = m.group(1) if int(m.group(1)) < spec.num_layers else "head"
        else:
            part = "embed" if name == "token_embd.weight" else "head"
        out.append(TensorEntry(name, tuple(info.shape), info.type_name, part, Path(file.paths[info.file]),
                               info.offset, info.nbytes))
    mtp = source.mtp_source
    if mtp is not None:  # the MTP layer taken from a safetensors checkpoint (open_checkpoint's mtp_from)
        out += [dataclasses.replace(e, name="mtp_from:" + e.name, part="head")
                for e in _safetensors_entries(mtp) if e.name.startswith("mtp.")]
    return out


def tensor_table(source: Any, spec: ModelSpec) -> tuple[str, tuple[TensorEntry, ...]]:
    """(file format, every stored tensor sorted by name) of a checkpoint's source; reads headers only."""
    from .weights import SafetensorsSource

    if isinstance(source, SafetensorsSource):
        fmt, entries = "safetensors", _safetensors_entries(source)
    elif hasattr(source, "canonical_names") and hasattr(source, "file"):
        fmt, entries = "gguf", _gguf_entries(source, spec)
    else:
        raise CheckpointError(f"cannot fingerprint a {type(source).__name__} (not a safetensors or GGUF source)")
    return fmt, tuple(sorted(entries, key=lambda e: e.name))


# ---- hashing -------------------------------------------------------------------------------------------------
class _Files:
    """The checkpoint's files, opened once each, read with positioned reads into one reusable buffer of
    :data:`_CHUNK` bytes. (Through a memory map, hashing a stage's share left every page it touched resident until the
    map closed, and the kernel maps pages around each one read: a peak of 93 MiB over the stage's own memory for
    SmolLM2 Q4_K_M, about its whole file; with reads the peak is the buffer.)"""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._buf = bytearray(_CHUNK)

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise translate(exc, CheckpointError, f"cannot open {path}")
        return self._fds[path]

    def read(self, e: TensorEntry, at: int, n: int) -> memoryview:
        """Bytes ``[at, at + n)`` of tensor ``e`` (n <= :data:`_CHUNK`), valid until the next read."""
        view = memoryview(self._buf)[:n]
        got = 0
        try:
            while got < n:
                k = os.preadv(self._fd(e.path), [view[got:]], e.offset + at + got)
                if k == 0:
                    raise CheckpointError(f"{e.path} ends inside tensor {e.name}")
                got += k
        except OSError as exc:
            raise translate(exc, CheckpointError, f"cannot read {e.path}")
        return view

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _describe(e: TensorEntry) -> bytes:
    return json.dumps([e.name, e.dtype, list(e.shape), e.nbytes]).encode()


def _numerics(spec: ModelSpec) -> dict[str, Any]:
    return {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec) if f.name not in _NOT_NUMERICS}


def _sample_digest(entries: tuple[TensorEntry, ...], files: _Files) -> str:
    h = hashlib.blake2b(digest_size=16)
    for e in entries:
        n = e.nbytes
        span = max(n - SAMPLE_BYTES, 0)
        for k in range(SAMPLE_WINDOWS):
            at = span * k // (SAMPLE_WINDOWS - 1)
            h.update(files.read(e, at, min(SAMPLE_BYTES, n - at)))
    return h.hexdigest()


def model_fingerprint(fmt: str, spec: ModelSpec, entries: tuple[TensorEntry, ...], sample: str) -> str:
    """The model-level fingerprint of a checkpoint from its format, spec, tensor table and content sample."""
    body = {"v": VERSION, "format": fmt, "spec": _numerics(spec), "tensors": [_describe(e).decode() for e in entries],
            "sample": sample}
    text = json.dumps(body, sort_keys=True, default=repr).encode()
    return hashlib.blake2b(text, digest_size=16, person=b"sangama-model").hexdigest()


def part_hashes(entries: tuple[TensorEntry, ...], parts: Iterable[str], files: _Files | None = None
                ) -> tuple[tuple[str, str], ...]:
    """blake2b-128 of every stored byte of each of ``parts`` (tensors in name order, each with its description)."""
    own = files is None
    files = files or _Files()
    want = set(parts)
    hashes = {p: hashlib.blake2b(digest_size=16, person=b"sangama-part") for p in want}
    try:
        for e in entries:
            if e.part not in want:
                continue
            h = hashes[e.part]
            h.update(_describe(e))
            for at in range(0, e.nbytes, _CHUNK):
                h.update(files.read(e, at, min(_CHUNK, e.nbytes - at)))
    finally:
        if own:
            files.close()
    missing = want - {e.part for e in entries}
    if missing:
        raise CheckpointError(f"the checkpoint has no tensors for part(s) {sorted(missing)}")
    return tuple(sorted(((p, h.hexdigest()) for p, h in hashes.items()), key=lambda x: _part_order(x[0])))


def _part_order(part: str) -> tuple[int, int]:
    if part == "embed":
        return (0, 0)
    return (1, int(part)) if part.isdigit() else (2, 0)


def stage_identity(spec: ModelSpec, source: Any, parts: Iterable[str] = ()) -> ModelIdentity:
    """The identity of the checkpoint behind ``source``, with the hashes of ``parts`` (what a stage holds)."""
    fmt, entries = tensor_table(source, spec)
    files = _Files()
    try:
        fingerprint = model_fingerprint(fmt, spec, entries, _sample_digest(entries, files))
        hashes = part_hashes(entries, parts, files)
    finally:
        files.close()
    return ModelIdentity(fingerprint, spec.num_layers, hashes)


def checkpoint_identity(path: str | Path, *, parts: Iterable[str] = (),
                        mtp_from: str | Path | None = None) -> ModelIdentity:
    """Open the checkpoint at ``path`` (no tensor is loaded) and return its identity (a client's local copy)."""
    from .checkpoint import open_checkpoint
    from .weights import SafetensorsSource

    p = Path(path)
    if p.is_dir():  # spec and tensor index only: the tokenizer is not needed here
        spec, source = ModelSpec.from_dir(p), SafetensorsSource(p)
    else:
        ckpt = open_checkpoint(p, mtp_from=mtp_from, tokenizer=False)
        spec, source = ckpt.spec, ckpt.source
    try:
        return stage_identity(spec, source, parts)
    finally:
        source.close()
