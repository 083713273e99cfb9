"""A whole fleet on loopback as separate processes: one bootstrap node and stage peers, cleaned up however we exit.

``sangama-peer demo``, the multi-process tests and the private-fleet example start real ``sangama-peer`` processes
(what a user runs), not in-process stand-ins. Cleanup is the point of this module:

* every child runs in its own session, so a Ctrl-C in the terminal reaches only us, and we stop the children in
  order (SIGINT, then SIGTERM, then SIGKILL of the whole process group, each after a grace period);
* every child asks the kernel for SIGTERM when its parent dies (``PR_SET_PDEATHSIG``), so even a ``kill -9`` of the
  demo leaves no orphan serving a model;
* a child that exits early fails the start with its own stderr in the error, instead of a timeout.

Readiness is read from the children's stdout: ``bootstrap`` prints ``--bootstrap <addr>`` lines, ``join`` prints
``ready <peer id> <model id> <start>:<end>`` once its record is published.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ..errors import NetworkError

# trio (0.07-0.2 s to import) and the peer (3-4 s: torch and libp2p) are imported by ThreadFleet only: the CLI imports
# this module for LocalFleet (processes) to build its parser

__all__ = ["Child", "LocalFleet", "READY_PREFIX", "ThreadFleet"]

READY_PREFIX = "ready "
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass  # not Linux: the parent's own cleanup still runs


@dataclass
class Child:
    """One ``sangama-peer`` process and the lines it has printed so far."""

    name: str
    proc: subprocess.Popen
    log_path: Path
    lines: "queue.Queue[str]" = field(default_factory=queue.Queue)
    seen: list[str] = field(default_factory=list)

    def wait_for(self, prefix: str, timeout: float) -> str:
        """The first stdout line starting with ``prefix`` (after stripping), or NetworkError with the child's log."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise NetworkError(f"{self.name} did not print {prefix!r} within {timeout:.0f} s\n{self.tail()}")
            try:
                line = self.lines.get(timeout=min(left, 0.2))
            except queue.Empty:
                if self.proc.poll() is not None and self.lines.empty():
                    raise NetworkError(f"{self.name} exited with code {self.proc.returncode}\n{self.tail()}")
                continue
            if line.strip().startswith(prefix):
                return line.strip()

    def tail(self, n: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            text = ""
        out = "\n".join(self.seen[-n:])
        err = "\n".join(text.splitlines()[-n:])
        return f"--- {self.name} stdout ---\n{out}\n--- {self.name} stderr ---\n{err}"


class LocalFleet:
    """Start a bootstrap node and one ``join`` process per layer range; stop them all on exit.

    ``with LocalFleet(model_dir, ["0:3", "3:6", "6:8"], workdir) as fleet: fleet.bootstrap_addr`` - the context
    manager returns once every stage has published its record.
    """

    def __init__(
        self,
        model_dir: Path | str,
        layers: Sequence[str],
        workdir: Path | str,
        *,
        join_args: Sequence[str] = (),
        bootstrap_args: Sequence[str] = (),
        start_timeout: float = 120.0,
        python: str = sys.executable,
        on_ready: Callable[[str, float], None] | None = None,
    ) -> None:
        """``on_ready(what, seconds)``: called as the bootstrap node and then each stage is up (the demo's progress),
        ``what`` e.g. ``"stage 0:3 (peer …x2Ab9cQe)"``, ``seconds`` since the fleet started."""
        self.model_dir = Path(model_dir)
        self.layers = list(layers)
        self.workdir = Path(workdir)
        self.join_args = list(join_args)
        self.bootstrap_args = list(bootstrap_args)
        self.start_timeout = start_timeout
        self.python = python
        self.on_ready = on_ready
        self.children: list[Child] = []
        self.bootstrap_addr = ""
        self.stage_ids: list[str] = []

    def __enter__(self) -> "LocalFleet":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _spawn(self, name: str, args: list[str]) -> Child:
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / f"{name}.stderr"
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
        with open(log_path, "wb") as err:
            proc = subprocess.Popen(
                [self.python, "-m", "sangama_p2p.cli.main", *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
                start_new_session=True,  # Ctrl-C reaches the parent only; it stops the children in order
                preexec_fn=_die_with_parent,
                text=True,
                bufsize=1,
            )
        child = Child(name, proc, log_path)
        threading.Thread(target=_pump, args=(proc.stdout, child), daemon=True).start()
        self.children.append(child)
        return child

    def start(self) -> None:
        t0 = time.monotonic()
        boot = self._spawn("bootstrap", [
            "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(self.workdir / "bootstrap.key"),
            *self.bootstrap_args,
        ])
        self.bootstrap_addr = boot.wait_for("--bootstrap", self.start_timeout).split()[-1]
        if self.on_ready is not None:
            self.on_ready("bootstrap node", time.monotonic() - t0)
        joins = [self.join(f"stage{i}", layers) for i, layers in enumerate(self.layers)]
        for layers, child in zip(self.layers, joins):  # they load at once; we see each as it is ready
            peer_id = child.wait_for(READY_PREFIX, self.start_timeout).split()[1]
            self.stage_ids.append(peer_id)
            if self.on_ready is not None:
                self.on_ready(f"stage {layers} (peer …{peer_id[-8:]})", time.monotonic() - t0)

    def join(self, name: str, layers: str, *extra: str) -> Child:
        """Start one more ``join`` of ``layers`` into the fleet (after :meth:`start`; with the fleet's
        ``join_args``, then ``extra``); wait for its ``ready`` line with :meth:`Child.wait_for`. Call it from the
        thread that stops the fleet: children die with the thread that started them (``PR_SET_PDEATHSIG``)."""
        return self._spawn(name, [
            "join", "--model", str(self.model_dir), "--layers", layers,
            "--bootstrap", self.bootstrap_addr, "--listen", "/ip4/127.0.0.1/tcp/0",
            "--key", str(self.workdir / f"{name}.key"), *self.join_args, *extra,
        ])

    def stop(self, grace: float = 5.0) -> None:
        """SIGINT each child, then SIGTERM, then SIGKILL its process group; reap them all."""
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
            alive = [c for c in self.children if c.proc.poll() is None]
            if not alive:
                break
            for c in alive:
                try:
                    os.killpg(c.proc.pid, sig)
                except (ProcessLookupError, PermissionError):  # already gone, or no longer ours to signal
                    pass
            deadline = time.monotonic() + wait
            for c in alive:
                try:
                    c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:  # still alive: the next, stronger signal follows
                    pass
        for c in self.children:
            if c.proc.stdout is not None:
                c.proc.stdout.close()

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]


def _pump(stream: IO[str] | None, child: Child) -> None:
    if stream is None:
        return
    try:
        for line in stream:
            child.seen.append(line.rstrip("\n"))
            child.lines.put(line)
    except (ValueError, OSError):
        pass  # closed by stop()


class ThreadFleet:
    """Stage peers in this process, on a trio run in a background thread: a fleet for tests and embedding demos.

    Starting it costs no process launches (weights load in this process), so asyncio programs and example apps
    can be tested against a real fleet in seconds. ``with ThreadFleet(model_dir, [(0, 4), (4, 8)]) as fleet:
    fleet.bootstrap_addr`` - the first stage is everyone's bootstrap node, unless ``bootstrap`` names one (a
    ``sangama-peer bootstrap`` node: it also answers reachability checks, which a ``join`` beside the fleet waits
    for). Leaving the block closes every peer and joins the thread; an error while starting is raised here.
    """

    def __init__(self, model_dir: Path | str, ranges: Sequence[tuple[int, int]], workdir: Path | str,
                 *, start_timeout: float = 60.0, bootstrap: str | None = None) -> None:
        self.given_bootstrap = bootstrap
        self.model_dir = Path(model_dir)
        self.ranges = list(ranges)
        self.workdir = Path(workdir)
        self.start_timeout = start_timeout
        self.bootstrap_addr = ""
        self.stage_ids: list[str] = []
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: Any = None  # trio.Event, set through the trio token
        self._token: Any = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "ThreadFleet":
        self._thread = threading.Thread(target=self._run, name="sangama-thread-fleet", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout):
            self.stop()
            raise NetworkError(f"the thread fleet did not start within {self.start_timeout:.0f} s")
        if self._error is not None:
            self.stop()
            raise self._error
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        import trio

        try:
            trio.run(self._main)
        except BaseException as exc:  # reported to the starting thread
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        import trio

        from ..net.config import HostConfig
        from ..peer import Peer, PeerConfig

        self._stop = trio.Event()
        self._token = trio.lowlevel.current_trio_token()
        self.workdir.mkdir(parents=True, exist_ok=True)
        async with AsyncExitStack() as stack:
            boot: tuple[str, ...] = (self.given_bootstrap,) if self.given_bootstrap else ()
            for i, (start, end) in enumerate(self.ranges):
                host = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=boot,
                                  key_path=self.workdir / f"thread-stage{i}.key")
                peer = await stack.enter_async_context(Peer(PeerConfig(host=host)))
                await peer.serve(self.model_dir, (start, end))
                self.stage_ids.append(peer.peer_id)
                if not boot:
                    boot = (peer.addrs[0],)
            self.bootstrap_addr = boot[0]
            self._ready.set()
            await self._stop.wait()

    def stop(self) -> None:
        if self._token is not None and self._stop is not None:
            import trio  # loaded already: the fleet's thread runs it

            try:
                self._token.run_sync_soon(self._stop.set)
            except trio.RunFinishedError:  # already stopped
                pass
        if self._thread is not None:
            self._thread.join(timeout=30)
