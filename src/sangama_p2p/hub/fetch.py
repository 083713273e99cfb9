"""Transfers from the Hub through ``huggingface_hub``: whole files into its cache, byte ranges into sparse files.

Whole files go through :func:`huggingface_hub.hf_hub_download` (its cache layout under ``HF_HUB_CACHE``, its resume
of a cut transfer with an HTTP ``Range`` continue and of an ``.incomplete`` file left by an earlier run) and are then
checked here: an LFS file's sha256 against the Hub's (``siblings[].lfs.sha256`` of ``/api/models/{repo}/revision/
{rev}``, the same value the ``X-Linked-Etag`` header carries), a small file's git blob id (``sha1("blob N\\0" +
bytes)``) against ``siblings[].blobId``. A file that fails is deleted from the cache and raises DownloadError.

Byte ranges (the parts of a file a stage needs) use huggingface_hub's HTTP session (``get_session``, so
``HF_ENDPOINT``, the token and proxies apply): each range is asked for with ``Range``, must come back ``206`` with the
matching ``Content-Range``, and a cut is continued from the last byte received (5 tries without progress). A range
that receives no byte for ``HubSettings.stall_timeout`` seconds (reconnects included) fails: the progress deadline.

The names and the commit in the Hub's listing are checked (:mod:`.names`) before anything is fetched, and a Hub that
cannot be reached is said in one line (:func:`unreachable`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ..errors import DownloadError, describe, translate
from .names import check_commit, check_name
from .plan import Span

__all__ = ["HubSettings", "Progress", "Sibling", "download_file", "fetch_spans", "repo_files", "unreachable"]

_RETRIES = 5
_CHUNK = 1 << 20


def _truthy(v: str | None) -> bool:
    return (v or "").strip().lower() in ("1", "on", "yes", "true")


def _seconds(v: str | None, default: float) -> float:
    if v is None or not v.strip():
        return default
    try:
        out = float(v)
    except ValueError:
        out = -1.0
    if not 0 < out < float("inf"):
        raise DownloadError(f"SANGAMA_HUB_STALL_TIMEOUT takes a number of seconds above 0, got {v!r}")
    return out


def unreachable(settings: "HubSettings", exc: BaseException) -> DownloadError:
    """The one-line error for a Hub that did not answer at all (refused, unresolvable, timed out); raise it
    ``from exc``."""
    return DownloadError(f"cannot reach the Hub at {settings.endpoint}: {describe(exc)}; set HF_HUB_OFFLINE=1 to "
                         f"use the cache only")


@dataclasses.dataclass(frozen=True)
class HubSettings:
    """Where and how to reach the Hub; :meth:`from_env` reads huggingface_hub's own variables at call time."""

    endpoint: str = "https://huggingface.co"
    token: str | None = None
    cache_dir: Path | None = None  # None: huggingface_hub's default (HF_HUB_CACHE, else HF_HOME/hub)
    offline: bool = False
    max_workers: int = 6
    stall_timeout: float = 60.0  # seconds a byte range may receive nothing before it fails (SANGAMA_HUB_STALL_TIMEOUT)

    @classmethod
    def from_env(cls, *, max_workers: int = 6, cache_dir: str | Path | None = None) -> "HubSettings":
        env = os.environ
        cache = cache_dir or env.get("HF_HUB_CACHE") or (Path(env["HF_HOME"]) / "hub" if env.get("HF_HOME") else None)
        return cls(
            endpoint=env.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/"),
            token=env.get("HF_TOKEN") or None,
            cache_dir=Path(cache).expanduser() if cache else None,
            offline=_truthy(env.get("HF_HUB_OFFLINE")) or _truthy(env.get("TRANSFORMERS_OFFLINE")),
            max_workers=max_workers,
            stall_timeout=_seconds(env.get("SANGAMA_HUB_STALL_TIMEOUT"), cls.stall_timeout),
        )

    def resolved_cache(self) -> Path:
        if self.cache_dir is not None:
            return self.cache_dir
        from huggingface_hub import constants

        return Path(constants.HF_HUB_CACHE)


@dataclasses.dataclass(frozen=True)
class Sibling:
    """One file of a repo revision as the Hub lists it."""

    name: str
    size: int | None
    sha256: str | None  # LFS files
    blob_id: str | None  # git blob id (small files)


def repo_files(settings: HubSettings, repo: str, revision: str | None) -> tuple[str, dict[str, Sibling]]:
    """(commit sha, file name -> Sibling) of ``repo`` at ``revision`` from ``HfApi.model_info(files_metadata=True)``;
    a commit that is not 40 hex digits, or any file name that would lead out of a directory, is refused."""
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    where = f"{settings.endpoint} for hf:{repo}@{revision or 'main'}"
    try:
        info = HfApi(endpoint=settings.endpoint, token=settings.token).model_info(
            repo, revision=revision, files_metadata=True, timeout=settings.stall_timeout)
    except httpx2.TransportError as exc:  # no answer at all: one line, and what to do without network
        raise unreachable(settings, exc) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise translate(exc, DownloadError, f"cannot list hf:{repo}@{revision or 'main'} on {settings.endpoint}")
    if not info.sha:
        raise DownloadError(f"{settings.endpoint} gave no commit for hf:{repo}@{revision or 'main'}")
    check_commit(info.sha, where)
    files = {}
    for s in info.siblings or []:
        check_name(s.rfilename, where)
        lfs = s.lfs
        files[s.rfilename] = Sibling(s.rfilename, s.size if s.size is not None else (lfs.size if lfs else None),
                                     lfs.sha256 if lfs else None, s.blob_id)
    return info.sha, files


# ---- progress ------------------------------------------------------------------------------------------------
class Progress:
    """Rich progress bars on stderr (bytes, rate, ETA) when stderr is a terminal; silent otherwise."""

    def __init__(self, enabled: bool | None = None) -> None:
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._bar: Any = None
        self._lock = threading.Lock()

    def __enter__(self) -> "Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, DownloadColumn, Progress as RichProgress, TextColumn,
                                       TimeRemainingColumn, TransferSpeedColumn)

            self._bar = RichProgress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                     TransferSpeedColumn(), TimeRemainingColumn(), console=Console(stderr=True))
            self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def add(self, name: str, total: int | None) -> int | None:
        if self._bar is None:
            return None
        with self._lock:
            return self._bar.add_task(name if len(name) <= 48 else "…" + name[-47:], total=total)

    def advance(self, task: int | None, n: int) -> None:
        if self._bar is not None and task is not None:
            self._bar.advance(task, n)

    def tqdm_class(self, name: str) -> type:
        """A class huggingface_hub's ``http_get`` instantiates as its progress bar; it feeds this one."""
        progress = self

        class _Bar:
            def __init__(self, *, total: int | None = None, initial: int = 0, **_: Any) -> None:
                self.task = progress.add(name, total)
                progress.advance(self.task, initial)

            def __enter__(self) -> "_Bar":
                return self

            def __exit__(self, *exc: object) -> None:
                return None

            def update(self, n: int = 1) -> None:
                progress.advance(self.task, n)

            def close(self) -> None:
                return None

        return _Bar


# ---- whole files ---------------------------------------------------------------------------------------------
def _digest(path: Path, sib: Sibling) -> tuple[str, str, str] | None:
    """(kind, expected, actual) for the check the Hub allows on this file, or None when it lists no hash."""
    if sib.sha256:
        h = hashlib.sha256()
        want, kind = sib.sha256, "sha256"
    elif sib.blob_id:
        h = hashlib.sha1()
        h.update(b"blob %d\0" % path.stat().st_size)
        want, kind = sib.blob_id, "git blob id"
    else:
        return None
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK * 8):
            h.update(chunk)
    return kind, want.lower(), h.hexdigest()


def download_file(settings: HubSettings, repo: str, commit: str, sib: Sibling, progress: Progress) -> Path:
    """``sib`` of ``repo`` at ``commit`` in the huggingface_hub cache, checked against the Hub's hash (see above)."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = str(settings.resolved_cache())
    cached = try_to_load_from_cache(repo, sib.name, cache_dir=cache, revision=commit)
    try:
        path = Path(hf_hub_download(repo, sib.name, revision=commit, cache_dir=cache, endpoint=settings.endpoint,
                                    token=settings.token, local_files_only=settings.offline,
                                    tqdm_class=progress.tqdm_class(sib.name)))
    except LocalEntryNotFoundError as exc:
        if not settings.offline:
            raise translate(exc, DownloadError, f"hf:{repo}: cannot fetch {sib.name}")
        raise DownloadError(f"hf:{repo}: {sib.name} is not in the cache {cache} and offline mode is on "
                            f"(HF_HUB_OFFLINE)") from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise translate(exc, DownloadError, f"hf:{repo}: cannot fetch {sib.name}")
    if isinstance(cached, str) and Path(cached) == path:
        return path  # checked when it was fetched (or by whoever put it in the cache)
    if sib.sha256 and path.resolve().name != sib.sha256:  # the blob is named by the X-Linked-Etag it came with
        _discard(path)
        raise DownloadError(f"hf:{repo}: {sib.name} came with etag {path.resolve().name}, the Hub lists sha256 "
                            f"{sib.sha256}")
    if sib.size is not None and path.stat().st_size != sib.size:
        _discard(path)
        raise DownloadError(f"hf:{repo}: {sib.name} has {path.stat().st_size} bytes, the Hub lists {sib.size}")
    check = _digest(path, sib)
    if check is not None and check[1] != check[2]:
        _discard(path)
        raise DownloadError(f"hf:{repo}: {sib.name} fails its {check[0]} check (Hub {check[1]}, got {check[2]}); "
                            f"the file was removed from the cache")
    return path


def _discard(path: Path) -> None:
    """Remove a cached file that failed its check: the blob and the snapshot's link to it."""
    blob = path.resolve()
    for p in (blob, path):
        try:
            p.unlink()
        except FileNotFoundError:
            pass


# ---- byte ranges ---------------------------------------------------------------------------------------------
def fetch_spans(settings: HubSettings, repo: str, commit: str, name: str, spans: list[Span], fd: int,
                progress: Progress, pool: Any) -> int:
    """Write the bytes of ``spans`` of ``name`` into ``fd`` at their own offsets (``pool`` runs them, up to
    ``max_workers`` at once); return the bytes fetched."""
    if settings.offline:
        raise DownloadError(f"hf:{repo}: {name} needs {len(spans)} byte range(s) and offline mode is on")
    from huggingface_hub import get_hf_file_metadata, hf_hub_url
    from huggingface_hub.errors import HfHubHTTPError

    import httpx2

    url = hf_hub_url(repo, check_name(name, f"hf:{repo}"), revision=check_commit(commit, f"hf:{repo}"),
                     endpoint=settings.endpoint)
    try:  # one HEAD: where the Hub redirects (its CDN), so that each range is one round trip, not two
        meta = get_hf_file_metadata(url, token=settings.token, endpoint=settings.endpoint,
                                    timeout=settings.stall_timeout)
    except httpx2.TransportError as exc:
        raise unreachable(settings, exc) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise translate(exc, DownloadError, f"hf:{repo}: cannot reach {name}")
    if meta.commit_hash and meta.commit_hash != commit:
        raise DownloadError(f"hf:{repo}: {name} answered for commit {meta.commit_hash}, asked for {commit}")
    url = meta.location or url
    total = sum(b - a for a, b in spans)
    task = progress.add(f"{name} (ranges)", total)
    futures = [pool.submit(_fetch_span, settings, url, a, b, fd, progress, task) for a, b in spans]
    return sum(f.result() for f in futures)


def _fetch_span(settings: HubSettings, url: str, start: int, end: int, fd: int, progress: Progress,
                task: int | None) -> int:
    import httpx2
    from huggingface_hub.utils import build_hf_headers, get_session

    # the token goes to the Hub (or its mirror), never to a signed CDN address
    headers = build_hf_headers(token=settings.token if url.startswith(settings.endpoint) else False)
    headers["Accept-Encoding"] = "identity"
    deadline = settings.stall_timeout
    at, tries, moved = start, 0, time.monotonic()  # moved: when the last byte arrived (or the range began)
    while at < end:
        headers["Range"] = f"bytes={at}-{end - 1}"
        before = at
        try:
            with get_session().stream("GET", url, headers=headers, follow_redirects=True, timeout=deadline) as r:
                if r.status_code != 206:
                    raise DownloadError(f"{url}: range {at}-{end - 1} answered HTTP {r.status_code}, not 206")
                got = r.headers.get("Content-Range", "")
                if not got.startswith(f"bytes {at}-"):
                    raise DownloadError(f"{url}: asked for bytes {at}-{end - 1}, got Content-Range {got!r}")
                for chunk in r.iter_bytes(_CHUNK):
                    chunk = chunk[: end - at]
                    if chunk:
                        os.pwrite(fd, chunk, at)
                        at += len(chunk)
                        moved = time.monotonic()
                        progress.advance(task, len(chunk))
                    if at >= end:
                        break
            if at < end:
                raise httpx2.RemoteProtocolError("the range ended early")
        except httpx2.TransportError as exc:
            if time.monotonic() - moved >= deadline:
                raise DownloadError(f"{url}: no bytes of range {start}-{end - 1} for {deadline:g} s (the progress "
                                    f"deadline, SANGAMA_HUB_STALL_TIMEOUT; {describe(exc)})") from exc
            tries = 0 if at > before else tries + 1
            if tries >= _RETRIES:
                raise translate(exc, DownloadError, f"{url}: range {start}-{end - 1} failed {_RETRIES} times")
            time.sleep(0.2 * tries)
    return end - start
