"""Open a GGUF checkpoint (one file or ``-00001-of-0000N.gguf`` splits) and index its tensors by name.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds a numpy view per array element and took
51 s to open the 248k-token Qwen vocabulary on this machine; the format is small (magic, version, typed key/values,
tensor infos, aligned data). Each file is memory-mapped; nothing is read until a tensor is asked for. Large arrays
(the vocabulary, its merges and token types) are only checked and skipped when the header is parsed, and turned into
Python lists the first time they are asked for (:class:`Metadata`): a stage builds no tokenizer and never pays for
them (SmolLM2's three 49k arrays are ~9 MB of Python objects; Qwen3.5's 248k vocabulary and merges about five times
that).
Tensors used as stored are handed out as zero-copy torch views of the map (copy-on-write mapping, so torch gets a
writable array and no data is copied). Tensors that must be transformed are read with ``pread`` into memory we own,
so touching them does not also leave mapped file pages resident in the process.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import CheckpointError, UnsupportedModelError, translate
from .quants import BLOCK_SIZES, QType, row_bytes, type_name, unsupported_type

__all__ = ["GGUFFile", "GGUFMetadata", "Metadata", "TensorInfo", "read_metadata", "split_paths"]

_DTYPES = {QType.F32: torch.float32, QType.F16: torch.float16, QType.BF16: torch.bfloat16}
_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: ``shape`` is the torch order (ggml ``ne`` reversed), in elements."""

    name: str
    qtype: int
    shape: tuple[int, ...]
    file: int
    offset: int  # absolute byte offset in its file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.qtype)

    @property
    def is_quantized(self) -> bool:
        return self.qtype not in (QType.F32, QType.F16, QType.BF16)


def split_paths(path: Path) -> list[Path]:
    """All files of a split checkpoint given any one of them (or just ``[path]`` for a single file)."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    if count < 1:
        raise CheckpointError(f"bad split file name {path.name}")
    paths = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise CheckpointError(f"split GGUF checkpoint {path} is missing {', '.join(missing)}")
    return paths


_HEAD = struct.Struct("<4sIQQ")
_U64 = struct.Struct("<Q")
# GGUF value type -> (struct format, size) for scalars
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 4
_LAZY_MIN = 4096  # arrays of at least this many numbers or strings are parsed when first asked for


class _LazyArray:
    """A checked, not yet parsed array of the header: element type, count and where its elements start."""

    __slots__ = ("cursor", "pos", "etype", "count")

    def __init__(self, cursor: "_Cursor", pos: int, etype: int, count: int) -> None:
        self.cursor, self.pos, self.etype, self.count = cursor, pos, etype, count

    def load(self) -> list[Any]:
        cur = _Cursor(self.cursor.buf, self.cursor.path)
        cur.pos = self.pos
        return cur.elements(self.etype, self.count)


class Metadata(dict):
    """A GGUF header's key/values; large arrays become lists on first access (``[key]`` or ``get``)."""

    def __getitem__(self, key: str) -> Any:
        value = super().__getitem__(key)
        if isinstance(value, _LazyArray):
            value = value.load()
            super().__setitem__(key, value)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def items(self):  # type: ignore[override]  (the values as lists, like every other way in)
        return [(k, self[k]) for k in self]

    def values(self):  # type: ignore[override]
        return [self[k] for k in self]

    def __eq__(self, other: object) -> bool:
        return dict(self.items()) == (dict(other.items()) if isinstance(other, dict) else other)

    __hash__ = None  # type: ignore[assignment]


class _Cursor:
    """Bounds-checked little-endian reads over the header bytes (a truncated file raises CheckpointError)."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > len(self.buf):
            raise CheckpointError(f"truncated GGUF header in {self.path} (at byte {self.pos}, need {n} more)")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def scalar(self, vtype: int) -> Any:
        fmt = _SCALARS[vtype]
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar(10)
        try:
            return bytes(self.take(n)).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"bad UTF-8 string in GGUF header of {self.path}") from exc

    def strings(self, count: int) -> list[str]:
        """A string array; a tight loop, since vocabularies hold hundreds of thousands of entries."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        out: list[str] = []
        try:
            for _ in range(count):
                (n,) = unpack(buf, pos)
                pos += 8
                if pos + n > end:
                    break
                out.append(str(buf[pos : pos + n], "utf-8"))
                pos += n
        except struct.error:  # a length prefix past the end: the count check below says where
            pass
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"bad UTF-8 string in GGUF header of {self.path}") from exc
        if len(out) != count:
            raise CheckpointError(f"truncated GGUF header in {self.path} (inside a string array at byte {pos})")
        self.pos = pos
        return out

    def skip_strings(self, count: int) -> None:
        """Step over a string array, checking its length prefixes against the end (not its UTF-8: see ``strings``)."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        unpack = _U64.unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            (n,) = unpack(buf, pos)
            pos += 8 + n
        else:
            if pos <= end:
                self.pos = pos
                return
        raise CheckpointError(f"truncated GGUF header in {self.path} (inside a string array at byte {min(pos, end)})")

    def elements(self, etype: int, count: int) -> list[Any]:
        if etype in _NP:
            size = np.dtype(_NP[etype]).itemsize
            return np.frombuffer(self.take(size * count), dtype=_NP[etype]).tolist()
        if etype == _STRING:
            return self.strings(count)
        if etype == _ARRAY:
            return [self.value(_ARRAY) for _ in range(count)]
        raise CheckpointError(f"unknown GGUF array element type {etype} in {self.path}")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(vtype)
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar(4), self.scalar(10)
            if count >= _LAZY_MIN and (etype in _NP or etype == _STRING):
                lazy = _LazyArray(self, self.pos, etype, count)
                if etype == _STRING:
                    self.skip_strings(count)
                else:
                    self.take(np.dtype(_NP[etype]).itemsize * count)
                return lazy
            return self.elements(etype, count)
        raise CheckpointError(f"unknown GGUF value type {vtype} in {self.path}")


def _parse(path: Path) -> tuple[Metadata, list[tuple[str, tuple[int, ...], int, int]], int, np.memmap, dict]:
    """Parse one GGUF file: (metadata, [(name, ne, ggml type, relative offset)], data start, memory map,
    {key: (start, end) byte span of its whole key/value entry})."""
    if not path.is_file():
        raise CheckpointError(f"no GGUF file at {path}")
    try:
        mm = np.memmap(path, mode="c")  # copy-on-write: torch gets writable views, the file is never written
    except (OSError, ValueError) as exc:
        raise translate(exc, CheckpointError, f"cannot map GGUF file {path}")
    cur = _Cursor(memoryview(mm), path)
    magic, version, n_tensors, n_kv = _HEAD.unpack(cur.take(_HEAD.size))
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (magic {bytes(magic)!r})")
    if version not in (2, 3):
        raise UnsupportedModelError(f"{path}: GGUF version {version} is not supported (2, 3; big-endian files neither)")
    meta = Metadata()
    spans: dict[str, tuple[int, int]] = {}
    for _ in range(n_kv):
        start = cur.pos
        key = cur.string()
        meta[key] = cur.value(cur.scalar(4))
        spans[key] = (start, cur.pos)
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        n_dims = cur.scalar(4)
        if not 1 <= n_dims <= _MAX_DIMS:
            raise CheckpointError(f"tensor {name} in {path} has {n_dims} dimensions")
        ne = tuple(cur.scalar(10) for _ in range(n_dims))
        infos.append((name, ne, cur.scalar(4), cur.scalar(10)))
    align = int(meta.get("general.alignment", 32))
    if align <= 0 or align & (align - 1):
        raise CheckpointError(f"{path}: bad general.alignment {align}")
    data_start = -(-cur.pos // align) * align
    return meta, infos, data_start, mm, spans


def _check_types(path: Path, infos: list[tuple[str, tuple[int, ...], int, int]]) -> None:
    """One error for the first tensor type we cannot read, naming a tensor and how many share that type."""
    bad = [(name, qtype) for name, _, qtype, _ in infos if qtype not in BLOCK_SIZES]
    if bad:
        name, qtype = bad[0]
        same = sum(1 for _, t in bad if t == qtype)
        others = f" and {same - 1} more" if same > 1 else ""
        raise unsupported_type(qtype, f"the GGML type of tensor {name}{others} in {path.name}")


class GGUFFile:
    """Metadata and tensor index of a (possibly split) GGUF checkpoint."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.paths = split_paths(self.path)
        self._fds: list[int] = []
        self._maps: list[np.memmap] = []
        self.metadata: Metadata = Metadata()
        self.tensors: dict[str, TensorInfo] = {}
        self.kv_spans: dict[str, tuple[int, int]] = {}  # the first file's raw key/value entries, for re-writing
        for i, p in enumerate(self.paths):
            meta, infos, data_start, mm, spans = _parse(p)
            self._maps.append(mm)
            if i == 0:
                self.metadata, self.kv_spans = meta, spans
            _check_types(p, infos)
            for name, ne, qtype, rel in infos:
                self._add(i, name, ne, qtype, data_start + rel, len(mm))
        count = int(self.metadata.get("split.count", 1))
        if count != len(self.paths):
            raise CheckpointError(f"{self.path} says split.count={count} but {len(self.paths)} file(s) were found")
        expected = self.metadata.get("split.tensors.count")
        if expected is not None and int(expected) != len(self.tensors):
            raise CheckpointError(f"{self.path}: split.tensors.count={expected} but the files hold {len(self.tensors)}")

    def _add(self, file: int, name: str, ne: tuple[int, ...], qtype: int, offset: int, file_size: int) -> None:
        shape = tuple(int(x) for x in reversed(ne))
        if name in self.tensors:
            raise CheckpointError(f"tensor {name} appears twice in {self.path}")
        nbytes = row_bytes(qtype, shape[-1]) * int(np.prod(shape[:-1], dtype=np.int64))
        if offset + nbytes > file_size:
            raise CheckpointError(
                f"truncated GGUF file {self.paths[file]}: tensor {name} ends at byte {offset + nbytes}, "
                f"the file has {file_size}"
            )
        self.tensors[name] = TensorInfo(name, qtype, shape, file, offset, nbytes)

    # ---- metadata ------------------------------------------------------------------------------------------
    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path} lacks general.architecture")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise CheckpointError(f"{self.path} lacks metadata key {key}")
        return self.metadata[key]

    def array_field(self, key: str) -> list[Any] | None:
        """An array field, e.g. ``tokenizer.ggml.tokens`` (None when absent)."""
        value = self.metadata.get(key)
        if value is not None and not isinstance(value, list):
            raise CheckpointError(f"{self.path}: metadata {key} is not an array")
        return value

    # ---- tensor data ---------------------------------------------------------------------------------------
    def view(self, name: str) -> torch.Tensor:
        """A zero-copy torch view of the stored tensor: uint8 ``[..., row_bytes]`` when quantized, else its dtype."""
        info = self.tensors[name]
        raw = torch.from_numpy(self._maps[info.file][info.offset : info.offset + info.nbytes])
        if info.is_quantized:
            return raw.reshape(*info.shape[:-1], -1)
        return raw.view(_DTYPES[info.qtype]).reshape(info.shape)

    def raw_kv(self, key: str) -> bytes:
        """The stored bytes of one key/value entry of the first file (key, value type and value), as in the file."""
        start, end = self.kv_spans[key]
        return bytes(self._maps[0][start:end])

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of a tensor, as a uint8 view of the map."""
        info = self.tensors[name]
        return self._maps[info.file][info.offset : info.offset + info.nbytes]

    def read(self, name: str) -> torch.Tensor:
        """Like :meth:`view` but read into memory we own (for tensors about to be transformed)."""
        info = self.tensors[name]
        buf = torch.empty(info.nbytes, dtype=torch.uint8)
        fd = self._fd(info.file)
        view = memoryview(buf.numpy())
        done = 0
        while done < info.nbytes:
            n = os.preadv(fd, [view[done:]], info.offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.paths[info.file]} ends inside tensor {name}")
            done += n
        if info.is_quantized:
            return buf.reshape(*info.shape[:-1], -1)
        return buf.view(_DTYPES[info.qtype]).reshape(info.shape)

    def release_pages(self) -> None:
        """Drop this process's copies of the mapped file pages (``MADV_DONTNEED``): after weights were repacked
        into memory of their own, the blocks they came from no longer count in the process's resident set. A view
        that is read again faults its pages back in from the page cache; nothing writes to the maps."""
        for mm in self._maps:
            raw = getattr(mm, "_mmap", None)  # numpy.memmap's mmap.mmap
            if raw is not None and hasattr(mmap, "MADV_DONTNEED"):
                raw.madvise(mmap.MADV_DONTNEED)

    def release_view(self, view: torch.Tensor) -> None:
        """Drop this process's copies of the mapped pages under ``view`` (the pages wholly inside it), when it is a
        view of one of the maps (:meth:`view`); memory of its own (:meth:`read`) is left alone. For weights
        repacked a chunk at a time: the chunk's blocks stop counting in the resident set as soon as it is packed."""
        if not hasattr(mmap, "MADV_DONTNEED") or view.device.type != "cpu" or not view.numel():
            return
        start = view.data_ptr()
        end = start + view.numel() * view.element_size()
        if not view.is_contiguous():
            return
        for mm in self._maps:
            raw = getattr(mm, "_mmap", None)
            base = mm.ctypes.data
            if raw is None or not (base <= start and end <= base + mm.nbytes):
                continue
            lo = -(-(start - base) // mmap.PAGESIZE) * mmap.PAGESIZE
            hi = (end - base) // mmap.PAGESIZE * mmap.PAGESIZE
            if hi > lo:
                raw.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
            return

    def _fd(self, file: int) -> int:
        if not self._fds:
            self._fds = [os.open(p, os.O_RDONLY) for p in self.paths]
        return self._fds[file]

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        self._maps = []


@dataclasses.dataclass(frozen=True)
class GGUFMetadata:
    """A GGUF file's key/value metadata alone (what a client needs for the tokenizer and the chat template).

    It has the metadata accessors of :class:`GGUFFile` (``path``, ``get``, ``array_field``), so code that reads only
    metadata takes either; the tensors are not indexed, so a file with tensor types this build cannot compute on
    still gives its tokenizer and chat template.
    """

    path: Path
    metadata: dict[str, Any]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def array_field(self, key: str) -> list[Any] | None:
        """An array field, e.g. ``tokenizer.ggml.tokens`` (None when absent)."""
        value = self.metadata.get(key)
        if value is not None and not isinstance(value, list):
            raise CheckpointError(f"{self.path}: metadata {key} is not an array")
        return value


def read_metadata(path: str | Path) -> GGUFMetadata:
    """The metadata of a GGUF file (the first file of a split holds it); no tensor is indexed or read."""
    p = Path(path)
    meta, _infos, _start, mm, _spans = _parse(p)
    del mm  # the map closes when collected: nothing else refers to it
    return GGUFMetadata(p, meta)
