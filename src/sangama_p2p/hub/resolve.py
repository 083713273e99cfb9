"""``resolve_model``: an ``hf:`` model name -> a local checkpoint path that ``open_checkpoint`` opens.

Without ``layers`` every weight file is fetched whole into huggingface_hub's cache and the snapshot path is returned.
With ``layers=(A, B)`` only what the stage needs is fetched:

* safetensors: config/tokenizer/template files, the shards of ``model.safetensors.index.json`` holding the stage's
  tensors (whole, checked), and of every other shard only its header and the fingerprint's sample windows (a sparse
  partial file, see :mod:`.partial`);
* GGUF split files: the first part (metadata) and the parts holding the stage's tensors whole, the others partial;
* one big GGUF file: a partial file holding the header, the stage's tensors and the sample windows of the others.

Stage copies live in ``<cache>/models--ORG--REPO/sangama/<commit>/layers-A-B/`` (or ``dest``): whole files are
links into the huggingface_hub cache, partial files are real sparse files. The model fingerprint of such a copy equals
the full file's; its bytes outside the stage are holes (zeros), so it serves only its layers.

Every name that comes from the Hub (its listing, the shard index) and its commit sha are checked before they become
paths (:mod:`.names`): each stays under the stage copy (or the cache) once resolved, else DownloadError.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, DownloadError, LayerRangeError, translate
from ..model.gguf.config import decoder_depth
from ..model.spec import ModelSpec
from .fetch import HubSettings, Progress, Sibling, download_file, repo_files
from .names import check_commit, check_name, under
from .partial import Fetcher, PartialFile, gguf_header, safetensors_header
from .plan import gguf_stage_tensors, merge_spans, safetensors_stage_tensors, sample_spans
from .spec import HubSpec, parse_hub_spec

__all__ = ["resolve_model"]

_SMALL = re.compile(r"^(config\.json|generation_config\.json|tokenizer(_config)?\.json|tokenizer\.model|"
                    r"special_tokens_map\.json|added_tokens\.json|vocab\.json|merges\.txt|chat_template\.(jinja|json)|"
                    r"model\.safetensors\.index\.json)$")
_SPLIT = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_GAP = 4 << 10  # sample windows closer than this are fetched as one range


def resolve_model(spec: str, *, layers: tuple[int, int] | None = None, dest: str | Path | None = None,
                  settings: HubSettings | None = None, progress: bool | None = None,
                  metadata_only: bool = False) -> Path:
    """The local checkpoint (directory or ``.gguf`` path) for ``hf:ORG/REPO[@REV][:FILE.gguf]``, holding at least
    ``layers`` [A, B) (None: the whole model). ``progress``: rich bars on stderr (None: when it is a terminal).
    ``metadata_only``: no weights, just what a client needs for text (config, tokenizer and template files; of a
    GGUF its header, in a sparse file that ``read_metadata`` reads)."""
    if metadata_only:
        layers = (-1, -1)
    hs = parse_hub_spec(spec)
    settings = settings or HubSettings.from_env()
    if settings.offline:
        return _offline(hs, None if layers == (-1, -1) else layers, dest, settings)
    commit, files = repo_files(settings, hs.repo, hs.revision)
    _remember(settings, hs, commit)
    with Progress(progress) as bar, ThreadPoolExecutor(max(1, settings.max_workers)) as pool:
        job = _Job(settings, hs, commit, files, bar, pool)
        if layers == (-1, -1):
            return job.metadata(dest)
        out = job.gguf(layers, dest) if hs.filename else job.safetensors(layers, dest)
    return out


class _Job:
    def __init__(self, settings: HubSettings, hs: HubSpec, commit: str, files: dict[str, Sibling], bar: Progress,
                 pool: ThreadPoolExecutor) -> None:
        self.settings, self.hs, self.commit, self.files, self.bar, self.pool = settings, hs, commit, files, bar, pool
        self.fetch = Fetcher(settings, hs.repo, commit, bar, pool)

    def whole(self, names: list[str]) -> dict[str, Path]:
        for n in names:
            if n not in self.files:
                raise DownloadError(f"{self.hs}: the repo has no file {n!r}")
        futures = {n: self.pool.submit(download_file, self.settings, self.hs.repo, self.commit, self.files[n], self.bar)
                   for n in names}
        return {n: f.result() for n, f in futures.items()}

    def stage_dir(self, layers: tuple[int, int], dest: str | Path | None) -> Path:
        if dest is not None:
            return Path(dest)
        return _repo_dir(self.settings, self.hs) / "sangama" / self.commit / f"layers-{layers[0]}-{layers[1]}"

    def sibling(self, name: str) -> Sibling:
        sib = self.files.get(name)
        if sib is None:
            raise DownloadError(f"{self.hs}: the repo has no file {name}")
        if sib.size is None:
            raise DownloadError(f"{self.hs}: the Hub lists no size for {name}")
        return sib

    def metadata(self, dest: str | Path | None) -> Path:
        stage = Path(dest) if dest is not None else (
            _repo_dir(self.settings, self.hs) / "sangama" / self.commit / "metadata")
        if not self.hs.filename:
            return self._safetensors_metadata(stage)
        # every part's header and the fingerprint's sample windows (a few KiB a tensor, no weights): the client's
        # sparse copy gives the checkpoint's fingerprint, so it chains only peers of this very file (cli/pin.py)
        for p in self._gguf_parts():
            part, _meta, tensors, data_start = self._gguf_probe(stage, p)
            spans = [(0, data_start)] + [s for _, at, nbytes in tensors for s in sample_spans(at, nbytes)]
            part.ensure(merge_spans(spans, _GAP), self.fetch)
        return stage / self.hs.filename

    def _safetensors_metadata(self, stage: Path) -> Path:
        """Config, tokenizer and template files, and of every shard a sparse copy holding its header and the
        fingerprint's sample windows (a few KiB a tensor): the copy fingerprints as the whole checkpoint does, so
        a client of ``hf:ORG/REPO`` chains only peers of that very checkpoint (cli/pin.py). A repo with no
        ``.safetensors`` file gives the small files alone (the depth, from its config)."""
        small = [n for n in self.files if _SMALL.match(n)]
        if "config.json" not in small:
            raise DownloadError(f"{self.hs}: no config.json in the repo (name a .gguf file with :FILE.gguf)")
        got = self.whole(small)
        snapshot = got["config.json"].parent
        weight_map = _index_map(snapshot)
        shards = sorted(set(weight_map.values())) if weight_map else (
            ["model.safetensors"] if "model.safetensors" in self.files else [])
        if not shards:
            return snapshot
        stage.mkdir(parents=True, exist_ok=True)
        for n, p in got.items():
            _link(stage, n, p)
        for name in shards:
            self._sparse_shard(stage, name, lambda header: set())
        return stage

    # ---- safetensors -----------------------------------------------------------------------------------------
    def safetensors(self, layers: tuple[int, int] | None, dest: str | Path | None) -> Path:
        small = [n for n in self.files if _SMALL.match(n)]
        if "config.json" not in small:
            raise DownloadError(f"{self.hs}: no config.json in the repo (name a .gguf file with :FILE.gguf)")
        got = self.whole(small)
        snapshot = got["config.json"].parent
        shards = sorted(n for n in self.files if n.endswith(".safetensors"))
        if not shards:
            raise DownloadError(f"{self.hs}: the repo holds no .safetensors file")
        mspec = ModelSpec.from_dir(snapshot)
        if layers is None or tuple(layers) == (0, mspec.num_layers):
            used = _index_files(snapshot) or shards
            self.whole(used)
            return snapshot
        start, end = _check_layers(layers, mspec.num_layers)
        weight_map = _index_map(snapshot)
        if weight_map is None:
            weight_map = {}  # a single model.safetensors: its header says what it holds
        stage = self.stage_dir((start, end), dest)
        stage.mkdir(parents=True, exist_ok=True)
        for n, p in got.items():
            _link(stage, n, p)
        shard_names = sorted(set(weight_map.values())) or ["model.safetensors"]
        need = safetensors_stage_tensors(weight_map, mspec.num_layers, start, end, mspec.tie_word_embeddings)
        whole = sorted({weight_map[n] for n in need}) if weight_map else []
        for n, p in self.whole(whole).items():
            PartialFile(stage, n, 0).remove()
            _link(stage, n, p)
        for name in shard_names:
            if name in whole:
                continue
            def own(header: dict[str, Any], name: str = name) -> set[str]:
                raw = list(header) if not weight_map else [n for n in header if weight_map.get(n) == name]
                return safetensors_stage_tensors(raw, mspec.num_layers, start, end, mspec.tie_word_embeddings)

            self._sparse_shard(stage, name, own)
        _complete(stage, self.hs, self.commit, (start, end))
        return stage

    def _sparse_shard(self, stage: Path, name: str, own: Callable[[dict[str, Any]], set[str]]) -> None:
        """``stage/name`` as a sparse copy of the shard: its header, the tensors ``own(header)`` names whole, and
        the fingerprint's sample windows of the others."""
        part = PartialFile(stage, name, self.sibling(name).size)  # type: ignore[arg-type]
        header, data_start = safetensors_header(part, self.fetch)
        whole = own(header)
        spans = [(0, data_start)]
        for n, (a, b) in _tensor_spans(header, data_start, f"{self.hs}: {name}").items():
            spans += [(a, b)] if n in whole else sample_spans(a, b - a)
        part.ensure(merge_spans(spans, _GAP), self.fetch)

    # ---- GGUF ------------------------------------------------------------------------------------------------
    def gguf(self, layers: tuple[int, int] | None, dest: str | Path | None) -> Path:
        m = _SPLIT.match(self.hs.filename or "")
        parts = self._gguf_parts()
        if layers is None:
            return self.whole(parts)[parts[0]]
        stage = self.stage_dir(tuple(layers), dest)  # type: ignore[arg-type]
        stage.mkdir(parents=True, exist_ok=True)
        heads = {p: self._gguf_probe(stage, p) for p in parts}
        meta = heads[parts[0]][1]
        arch = meta.get("general.architecture")
        try:
            num_layers = decoder_depth(meta)
        except (KeyError, TypeError, ValueError) as exc:
            raise DownloadError(f"{self.hs}: the GGUF metadata has no {arch}.block_count") from exc
        start, end = _check_layers(layers, num_layers)
        if (start, end) == (0, num_layers):  # the whole model: whole files, checked against their sha256
            for p in parts:
                heads[p][0].remove()
            return self.whole(parts)[parts[0]]
        names = [t[0] for _, _, tensors, _ in heads.values() for t in tensors]
        need = gguf_stage_tensors(names, num_layers, start, end)
        if m is not None:  # splits: the first part and the parts holding stage tensors come whole
            whole = [p for p in parts if p == parts[0] or any(t[0] in need for t in heads[p][2])]
            for p, path in self.whole(whole).items():
                heads[p][0].remove()
                _link(stage, p, path)
        else:
            whole = []
        for p in parts:
            if p in whole:
                continue
            part, _meta, tensors, data_start = heads[p]
            spans = [(0, data_start)]
            for t, at, nbytes in tensors:
                spans += [(at, at + nbytes)] if t in need else sample_spans(at, nbytes)
            part.ensure(merge_spans(spans, _GAP), self.fetch)
        _complete(stage, self.hs, self.commit, (start, end))
        return stage / parts[0]

    def _gguf_parts(self) -> list[str]:
        """The file's name, or every part of a split (``X-00001-of-00003.gguf``), each checked to be in the repo."""
        name = self.hs.filename or ""
        m = _SPLIT.match(name)
        parts = [name] if m is None else [f"{m.group('stem')}-{i:05d}-of-{m.group('count')}.gguf"
                                          for i in range(1, int(m.group("count")) + 1)]
        for p in parts:
            self.sibling(p)
        return parts

    def _gguf_probe(self, stage: Path, name: str) -> tuple[PartialFile, dict, list, int]:
        part = PartialFile(stage, name, self.sibling(name).size)  # type: ignore[arg-type]
        if (stage / name).is_symlink():  # a whole copy from an earlier call: read its header locally
            part = PartialFile(stage / ".sangama" / "probe", name, part.size)
        meta, tensors, data_start = gguf_header(part, self.fetch)
        return part, meta, tensors, data_start


# ---- helpers -------------------------------------------------------------------------------------------------
def _check_layers(layers: tuple[int, int], num_layers: int) -> tuple[int, int]:
    start, end = (int(x) for x in layers)
    if not 0 <= start < end <= num_layers:
        raise LayerRangeError(f"layers {start}:{end} lie outside the model's {num_layers} layers")
    return start, end


def _tensor_spans(header: dict[str, Any], data_start: int, where: str) -> dict[str, tuple[int, int]]:
    """Each tensor of a safetensors header -> its [start, end) bytes in the file."""
    spans = {}
    for n, info in header.items():
        if n == "__metadata__":
            continue
        try:
            spans[n] = tuple(data_start + int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DownloadError(f"{where} has a bad header entry for {n}") from exc
        if len(spans[n]) != 2:
            raise DownloadError(f"{where} has a bad header entry for {n}")
    return spans  # type: ignore[return-value]


def _index_map(snapshot: Path) -> dict[str, str] | None:
    index = snapshot / "model.safetensors.index.json"
    if not index.is_file():
        return None
    try:
        weight_map = {str(k): v for k, v in json.loads(index.read_text())["weight_map"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise translate(exc, CheckpointError, f"corrupt shard index {index}")
    for shard in set(weight_map.values()):
        check_name(shard, f"the shard index {index}")
    return weight_map


def _index_files(snapshot: Path) -> list[str]:
    m = _index_map(snapshot)
    return sorted(set(m.values())) if m else []


def _link(stage: Path, name: str, target: Path) -> None:
    """``stage/name`` a link to ``target`` (a file in the huggingface_hub cache); ``name`` stays under ``stage``."""
    at = under(stage, name, f"the stage copy {stage}")
    at.parent.mkdir(parents=True, exist_ok=True)
    if at.is_symlink() or at.exists():
        if at.resolve() == target.resolve():
            return
        at.unlink()
    os.symlink(target.resolve(), at)


def _repo_dir(settings: HubSettings, hs: HubSpec) -> Path:
    return settings.resolved_cache() / ("models--" + hs.repo.replace("/", "--"))


def _remember(settings: HubSettings, hs: HubSpec, commit: str) -> None:
    """Record which commit ``revision`` named, for offline mode (our files pass commits to huggingface_hub)."""
    refs = _repo_dir(settings, hs) / "sangama" / "refs"
    ref = under(refs, hs.revision or "main", f"{hs}: the revision")
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit)


def _complete(stage: Path, hs: HubSpec, commit: str, layers: tuple[int, int]) -> None:
    (stage / ".sangama").mkdir(parents=True, exist_ok=True)
    (stage / ".sangama" / "complete.json").write_text(
        json.dumps({"model": str(hs), "commit": commit, "layers": list(layers)}))


def _offline(hs: HubSpec, layers: tuple[int, int] | None, dest: str | Path | None, settings: HubSettings) -> Path:
    """HF_HUB_OFFLINE: what an earlier call left in the cache, or DownloadError."""
    rev = hs.revision or "main"
    repo = _repo_dir(settings, hs)
    commit = rev if re.fullmatch(r"[0-9a-f]{40}", rev) else None
    for refs in (repo / "sangama" / "refs", repo / "refs"):
        ref = under(refs, rev, f"{hs}: the revision")
        if commit is None and ref.is_file():
            commit = check_commit(ref.read_text().strip(), f"the cached ref {ref}")
    if commit is None:
        raise DownloadError(f"{hs}: offline mode is on (HF_HUB_OFFLINE) and the cache {repo} has no copy of it")
    snapshot = repo / "snapshots" / commit
    if layers is not None:
        stage = Path(dest) if dest is not None else repo / "sangama" / commit / f"layers-{layers[0]}-{layers[1]}"
        if (stage / ".sangama" / "complete.json").is_file():
            return stage / hs.filename if hs.filename else stage
    if hs.filename:
        if (snapshot / hs.filename).is_file():
            return snapshot / hs.filename
    elif (snapshot / "config.json").is_file():
        weights = _index_files(snapshot) or ["model.safetensors"]
        if all((snapshot / w).is_file() for w in weights):
            return snapshot
    raise DownloadError(f"{hs}: offline mode is on (HF_HUB_OFFLINE) and the cache holds no copy of it"
                        + (f" for layers {layers[0]}:{layers[1]}" if layers else ""))
