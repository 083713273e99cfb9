"""A fleet of stage processes on loopback (``LocalFleet``: a bootstrap node and ``join`` processes) and the API
server embedded in this process (``Peer.serve_api`` on a trio run in a background thread)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

SPLIT = ["0:3", "3:5", "5:8", "3:5"]  # the last one: a spare for the middle range
KEY = "sk-test-sangama"


def make_model(root: Path) -> Path:
    from sangama_p2p.model.make import make_model

    return make_model(root / "made", "qwen3_5_moe", "tiny", seed=4)  # with its tokenizer (no chat template)


class ApiThread:
    """``Peer.serve_api`` on a trio run in a thread: ``url``, ``token`` (to call into the run), ``peer``."""

    def __init__(self, model: Path, bootstrap: str, key_file: Path, **config: Any) -> None:
        self.model, self.bootstrap, self.key_file, self.config = model, bootstrap, key_file, config
        self.url = ""
        self.peer: Any = None
        self.token: Any = None
        self._stop: Any = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "ApiThread":
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            self.stop()
            raise RuntimeError(f"the API server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        import trio

        try:
            trio.run(self._main)
        except BaseException as exc:
            self._error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        import trio

        from sangama_p2p.api import ApiConfig
        from sangama_p2p.client.config import ClientConfig
        from sangama_p2p.net.config import HostConfig
        from sangama_p2p.net.identity import generate_key_pair
        from sangama_p2p.peer import Peer, PeerConfig

        host = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(self.bootstrap,),
                          dht_server=False)
        config = PeerConfig(host=host, client=ClientConfig(model_id="made", step_timeout=15))
        self._stop = trio.Event()
        self.token = trio.lowlevel.current_trio_token()
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            self.peer = peer
            self.url = await peer.serve_api(self.model, ApiConfig(port=0, api_key_file=self.key_file, **self.config))
            self._ready.set()
            await self._stop.wait()

    def serve(self, config: Any) -> str:
        """Another server (an ``ApiConfig``) on the same peer; its base URL."""
        import trio

        return trio.from_thread.run(self.peer.serve_api, self.model, config, trio_token=self.token)

    def routes(self) -> list[list[str]]:
        import trio

        client = trio.from_thread.run(self.peer.client, "made", trio_token=self.token)
        return client.routes

    def stop(self) -> None:
        if self.token is not None and self._stop is not None:
            try:
                self.token.run_sync_soon(self._stop.set)
            except Exception:
                pass
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_model(tmp_path_factory.mktemp("api-model"))


@pytest.fixture(scope="module")
def fleet(model_dir, tmp_path_factory):
    from sangama_p2p.cli.local_fleet import LocalFleet

    with LocalFleet(model_dir, SPLIT, tmp_path_factory.mktemp("api-fleet"), join_args=["--batch-invariant"]) as f:
        yield f


@pytest.fixture(scope="module")
def key_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("api-key") / "key"
    path.write_text(KEY + "\n")
    return path


@pytest.fixture(scope="module")
def api(model_dir, fleet, key_file):
    with ApiThread(model_dir, fleet.bootstrap_addr, key_file, max_requests_per_client=16) as server:  # 16 streams
        yield server


@pytest.fixture(scope="module")
def local(model_dir):
    """The in-process chain that every network answer must equal (greedy, batch-invariant)."""
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    return LocalChain.load(open_checkpoint(model_dir), [LayerRange(0, 3), LayerRange(3, 5), LayerRange(5, 8)],
                           batch_invariant=True)


@pytest.fixture(scope="module")
def smol(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) linked as ``made.gguf``: its model id is the one ApiThread's client asks for."""
    link = tmp_path_factory.mktemp("smol") / "made.gguf"
    link.symlink_to(smollm2_gguf)
    return link


def openai_client(api: Any, *, timeout: float = 120) -> Any:
    """The official ``openai`` client on ``api``'s ``/v1``, with the fixtures' key and no retries."""
    import openai

    return openai.OpenAI(base_url=api.url + "/v1", api_key=KEY, timeout=timeout, max_retries=0)


def smol_api_over(smol: Path, split: list[str], key_file: Path, tmp_path_factory) -> Any:
    """Stage processes over ``split`` of ``smol`` (a ``LocalFleet``) and the API in front of them, yielded."""
    from sangama_p2p.cli.local_fleet import LocalFleet

    with LocalFleet(smol, split, tmp_path_factory.mktemp("smol-fleet")) as fleet:
        with ApiThread(smol, fleet.bootstrap_addr, key_file) as server:
            yield server
