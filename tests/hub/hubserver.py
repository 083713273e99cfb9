"""A Hub-shaped HTTP server on loopback for the download tests (a real server: threads, sockets, HTTP/1.1).

It serves files of local directories as repos: ``/api/models/ORG/REPO[/revision/REV]`` (siblings with sizes, git
blob ids and LFS sha256) and ``/ORG/REPO/resolve/REV/FILE`` (HEAD and GET, ``Range``, ``ETag``, ``X-Repo-Commit``,
``X-Linked-Etag``/``X-Linked-Size`` for LFS files as the Hub sends them). It counts the bytes served per file, the
ranges asked for and the most GETs in flight at once; faults can be injected: ``cut_once`` (a file's first GET stops
after half its body), ``corrupt`` (one byte flipped, headers unchanged) and ``stall`` (seconds a file's GETs wait
after their headers before the body). A hostile Hub is played with ``extra`` (names listed and served beside a repo's
files, however they are spelled: ``../../x``, ``/abs/x``) and ``commit`` (the sha the listing and headers give).
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
_LFS_MIN = 1024  # files at least this big are "LFS" files (the Hub's threshold is 10 MB; smaller here)


class HubServer:
    def __init__(self) -> None:
        self.repos: dict[str, Path] = {}
        self.served: dict[str, int] = defaultdict(int)
        self.ranges: dict[str, list[str | None]] = defaultdict(list)
        self.cut_once: set[str] = set()
        self.corrupt: set[str] = set()
        self.stall: dict[str, float] = {}
        self.extra: dict[str, dict[str, Path]] = defaultdict(dict)  # repo -> listed name -> the file served for it
        self.commit = COMMIT
        self.delay = 0.0  # seconds per 64 KiB chunk of a GET body (to observe concurrency)
        self.in_flight = 0
        self.max_in_flight = 0
        self._lock = threading.Lock()
        self._meta: dict[tuple[Path, int], dict] = {}
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> "HubServer":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    def add(self, repo: str, directory: Path) -> None:
        self.repos[repo] = Path(directory)

    def reset_counts(self) -> None:
        self.served.clear()
        self.ranges.clear()
        self.max_in_flight = 0

    # ---- repo contents ---------------------------------------------------------------------------------------
    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        out = {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file() and ".git" not in p.parts}
        return {**out, **self.extra[repo]}

    def lookup(self, repo: str, rev: str, name: str) -> Path | None:
        """The file for ``name``; an extra name also as a client's URL normalization leaves it (``a/../b`` -> ``b``)
        and by its last component alone (a hostile Hub answers whatever it is asked)."""
        files = self.files(repo)
        if name in files:
            return files[name]
        asked = posixpath.normpath(f"/{repo}/resolve/{rev}/{name}")
        for extra, path in self.extra[repo].items():
            if asked == posixpath.normpath(f"/{repo}/resolve/{rev}/{extra}") or name == posixpath.basename(extra):
                return path
        return None

    def meta(self, path: Path) -> dict:
        key = (path, path.stat().st_mtime_ns)
        if key not in self._meta:
            self._meta[key] = self._hash(path)
        return self._meta[key]

    @staticmethod
    def _hash(path: Path) -> dict:
        data = path.read_bytes()
        out = {"size": len(data), "blobId": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
        if len(data) >= _LFS_MIN:
            out["lfs"] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
        return out


def _handler(hub: HubServer) -> type:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            import socket

            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # no 40 ms header/body stalls

        def log_message(self, *args: object) -> None:  # quiet
            return None

        def _json(self, obj: object, status: int = 200) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _not_found(self) -> None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_HEAD(self) -> None:
            self._resolve(head=True)

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path.startswith("/api/models/"):
                rest = path[len("/api/models/"):].split("/")
                repo = "/".join(rest[:2])
                if repo not in hub.repos:
                    return self._json({"error": "Repository not found"}, 404)
                siblings = [{"rfilename": n, **hub.meta(p)} for n, p in hub.files(repo).items()]
                return self._json({"id": repo, "sha": hub.commit, "siblings": siblings})
            self._resolve(head=False)

        def _resolve(self, head: bool) -> None:
            parts = self.path.split("?", 1)[0].split("/")
            # /ORG/REPO/resolve/REV/FILE...
            if len(parts) < 6 or parts[3] != "resolve" or "/".join(parts[1:3]) not in hub.repos:
                return self._not_found()
            repo, name = "/".join(parts[1:3]), "/".join(parts[5:])
            path = hub.lookup(repo, parts[4], name)
            if path is None:
                return self._not_found()
            meta = hub.meta(path)
            data = _FileBytes(path, flip=not head and name in hub.corrupt)
            etag = meta["lfs"]["sha256"] if "lfs" in meta else meta["blobId"]
            start, end, status = 0, len(data), 200
            rng = self.headers.get("Range")
            if not head:
                hub.ranges[name].append(rng)
            if rng and rng.startswith("bytes="):
                a, _, b = rng[len("bytes="):].partition("-")
                start = int(a)
                end = min(int(b) + 1, len(data)) if b else len(data)
                status = 206
            self.send_response(status)
            self.send_header("X-Repo-Commit", hub.commit)
            self.send_header("ETag", f'"{etag}"')
            if "lfs" in meta:
                self.send_header("X-Linked-Etag", f'"{etag}"')
                self.send_header("X-Linked-Size", str(meta["size"]))
            self.send_header("Accept-Ranges", "bytes")
            if status == 206:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("Content-Length", str(end - start))
            self.end_headers()
            if head:
                return
            with hub._lock:
                hub.in_flight += 1
                hub.max_in_flight = max(hub.max_in_flight, hub.in_flight)
            try:
                if name in hub.stall:
                    self.wfile.flush()
                    time.sleep(hub.stall[name])
                body = data[start:end]
                stop = len(body)
                if name in hub.cut_once:
                    hub.cut_once.discard(name)
                    stop = len(body) // 2
                for at in range(0, stop, 65536):
                    if hub.delay:
                        time.sleep(hub.delay)
                    chunk = body[at:min(at + 65536, stop)]
                    self.wfile.write(chunk)
                    with hub._lock:
                        hub.served[name] += len(chunk)
                if stop < len(body):
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(2)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a stall test's deadline)
                self.close_connection = True
            finally:
                with hub._lock:
                    hub.in_flight -= 1

    return Handler


class _FileBytes:
    """A file's bytes read by slice (a range request reads only its range); ``flip`` corrupts its middle byte."""

    def __init__(self, path: Path, flip: bool) -> None:
        self.path, self.size, self.flip = path, path.stat().st_size, flip

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, s: slice) -> bytes:
        start, stop, _ = s.indices(self.size)
        with open(self.path, "rb") as f:
            f.seek(start)
            out = bytearray(f.read(stop - start))
        mid = self.size // 2
        if self.flip and start <= mid < stop:
            out[mid - start] ^= 0xFF
        return bytes(out)
