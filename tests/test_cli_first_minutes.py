"""A new user's first commands (issue 22, item 3; issue 23, item 6): ``generate --model FILE.gguf`` over the swarm;
``join`` refusing a bad checkpoint, range or key in use before it loads or dials, warning about a range that cannot
chain and about serving alone; a bootstrap node that no peer could dial refused, and one that says it stops."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sangama_p2p.cli.join_checks import chain_warning
from sangama_p2p.cli.local_fleet import ThreadFleet
from sangama_p2p.cli.main import main
from sangama_p2p.model.make import make_model

BOOT = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWKvVTzQZ5gKwzBq5rQxBdYDu1d3GLwX2ZJgzyvg4cbyzY"  # nothing listens there
QUIC = "/ip4/127.0.0.1/udp/4001/quic-v1/p2p/12D3KooWKvVTzQZ5gKwzBq5rQxBdYDu1d3GLwX2ZJgzyvg4cbyzY"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("first") / "first-tiny", "llama", "tiny")  # 6 layers


@pytest.fixture(scope="module")
def tiny_gguf(tiny: Path) -> Path:
    from sangama_p2p.model.gguf import write_gguf

    (path,) = write_gguf(tiny, tiny.parent / "first-tiny.gguf", "Q8_0")
    return path


def _spawn_bootstrap(key: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "bootstrap", "--listen",
                             "/ip4/127.0.0.1/tcp/0", "--key", str(key)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.strip().startswith("--bootstrap"):
            return proc, line.split()[-1]
    proc.wait()
    raise AssertionError(f"the bootstrap node exited: {proc.stderr.read()[-2000:]}")


@pytest.fixture(scope="module")
def bootstrap_node(tmp_path_factory: pytest.TempPathFactory):
    """A ``sangama-peer bootstrap`` process (it answers the reachability checks that ``join`` waits for)."""
    proc, addr = _spawn_bootstrap(tmp_path_factory.mktemp("boot") / "boot.key")
    try:
        yield addr
    finally:
        proc.kill()
        proc.communicate()


def test_a_range_between_the_swarms_boundaries_is_named():
    warning = chain_warning((5, 15), [(0, 10), (10, 20), (20, 30)], 30)
    assert warning is not None
    assert "layers 5:15" in warning and "0:10, 10:20, 20:30" in warning
    assert "no range ends at 5 and none starts at 15" in warning and "boundaries are 0, 10, 20, 30" in warning
    assert "none starts at 5" in chain_warning((0, 5), [(0, 10), (10, 30)], 30)
    assert "no range ends at 25" in chain_warning((25, 30), [(0, 10), (10, 20)], 30)


@pytest.mark.parametrize("mine", [(10, 20), (0, 10), (20, 30), (0, 30), (10, 30)])
def test_a_range_on_the_swarms_boundaries_or_a_first_peer_gets_no_warning(mine):
    assert chain_warning(mine, [(0, 10), (10, 20), (20, 30)], 30) is None
    assert chain_warning(mine, [], 30) is None


def test_a_range_that_only_meets_nobody_yet_is_said_only_if_it_still_cannot_chain_later(monkeypatch, capsys):
    """Eight stages started together (the distance benchmark) each warned that its range did not line up, from the
    few peers up at that moment. A boundary that crosses another range is a mistake, said at once; one that no range
    reaches yet is looked at again ``SETTLE_S`` later and said only if it still cannot chain."""
    import trio

    from sangama_p2p.cli import join_checks
    from sangama_p2p.cli.join_checks import Checked, crosses, warn_if_unchainable

    assert crosses((1, 3), [(0, 2), (2, 4)]) and crosses((5, 15), [(0, 10)])
    assert not crosses((3, 6), [(0, 3)]) and not crosses((25, 30), [(0, 10), (10, 20)])
    views: list[list[tuple[int, int]]] = []

    async def served(node, model_id, checked):
        return views.pop(0)

    monkeypatch.setattr(join_checks, "_served", served)
    monkeypatch.setattr(join_checks, "SETTLE_S", 0.01)
    checked = Checked(8, "ab" * 16, (3, 6))

    async def main(first, then):
        views[:] = [first, then]
        async with trio.open_nursery() as later:
            now = await warn_if_unchainable(None, "m", checked, later)
        return now

    assert trio.run(main, [(0, 3)], [(0, 3), (6, 8)]) is None  # 6:8 came up meanwhile: nothing to say
    assert "warning" not in capsys.readouterr().err
    assert trio.run(main, [(0, 3)], [(0, 3)]) is None
    assert "warning: layers 3:6 do not line up with the ranges the swarm serves (0:3): none starts at 6" in (
        capsys.readouterr().err)
    crossing = trio.run(main, [(0, 4), (4, 8)], [])  # a mistake: said at once, nothing deferred
    assert crossing is not None and "no range ends at 3" in capsys.readouterr().err


@pytest.fixture
def never_dial(monkeypatch: pytest.MonkeyPatch):
    """Fail the test if join starts a host (dials the swarm) or, with ``loads``, opens a checkpoint."""
    import sangama_p2p.model.checkpoint
    import sangama_p2p.peer

    def dial(*a, **kw):
        raise AssertionError("join started its host (connected to the swarm) before refusing")

    monkeypatch.setattr(sangama_p2p.peer, "open_host", dial)

    def no_loads():
        def load(*a, **kw):
            raise AssertionError("join opened the checkpoint before refusing")

        monkeypatch.setattr(sangama_p2p.model.checkpoint, "open_checkpoint", load)

    return no_loads


@pytest.mark.parametrize("model, layers, message", [
    ("absent", "0:2", "does not exist"),
    ("tiny", "0:99", "layer range 0:99 is outside the model's 6 layers"),
    ("tiny", "auto:9", "N in auto:N must be in 1..6"),
])
def test_join_refuses_a_bad_checkpoint_or_range_before_dialling(model, layers, message, tiny, tmp_path, never_dial,
                                                                 capsys):
    path = tiny if model == "tiny" else tmp_path / model
    argv = ["join", "--model", str(path), "--layers", layers, "--bootstrap", BOOT, "--key", str(tmp_path / "k")]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_join_refuses_a_key_in_use_before_reading_its_model_or_dialling(tiny, tmp_path, never_dial, capsys):
    """Issue 23, item 6: a second peer on a key in use was refused only once its layers had loaded."""
    from sangama_p2p.net.identity import lock_key_file

    never_dial()
    key = tmp_path / "shared.key"
    held = lock_key_file(key)  # as a running peer holds it
    try:
        argv = ["join", "--model", str(tiny), "--layers", "0:2", "--bootstrap", BOOT, "--key", str(key)]
        assert main(argv) == 2
    finally:
        held.close()
    assert f"key file {key} is in use by another running peer (pid {os.getpid()})" in capsys.readouterr().err


def test_join_without_a_bootstrap_says_it_serves_alone(tiny, tmp_path, capsys):
    argv = ["join", "--model", str(tiny), "--layers", "0:6", "--listen", "/ip4/127.0.0.1/tcp/0", "--key",
            str(tmp_path / "k"), "--run-for", "0.1"]
    assert main(argv) == 0
    out = capsys.readouterr()
    assert "serving alone" in out.err and out.out.startswith("ready ")


def test_join_warns_about_a_range_that_cannot_chain_and_still_serves(tiny, tmp_path, bootstrap_node, capsys):
    with ThreadFleet(tiny, [(0, 2), (2, 4), (4, 6)], tmp_path / "fleet", bootstrap=bootstrap_node):
        argv = ["join", "--model", str(tiny), "--layers", "1:3", "--bootstrap", bootstrap_node, "--listen",
                "/ip4/127.0.0.1/tcp/0", "--key", str(tmp_path / "k"), "--run-for", "0.1"]
        assert main(argv) == 0
    out = capsys.readouterr()
    assert "warning: layers 1:3 do not line up with the ranges the swarm serves (0:2, 2:4, 4:6)" in out.err
    assert "no range ends at 1 and none starts at 3" in out.err and "serving alone" not in out.err
    assert out.out.startswith("ready ") and " 1:3" in out.out.splitlines()[0]


def test_generate_with_a_gguf_file_as_the_model(tiny_gguf, tmp_path, capsys):
    """``generate --model FILE.gguf`` said "is a model id"; now the file names the model (its stem), encodes the
    prompt and pins the fingerprint, and the tokens equal ``--local`` on the same file."""
    from sangama_p2p.cli.main import build_parser
    from sangama_p2p.cli.swarm import client_peer_config
    from sangama_p2p.model.fingerprint import checkpoint_identity

    args = build_parser().parse_args(["generate", "hi", "--model", str(tiny_gguf), "--bootstrap", BOOT])
    config, model_id = client_peer_config(args, args.model)
    assert model_id == "first-tiny" and config.tokenizer_path == tiny_gguf
    assert config.client.fingerprint == checkpoint_identity(tiny_gguf).fingerprint
    common = ["--max-new-tokens", "5", "--ignore-eos", "--json"]
    assert main(["generate", "--local", str(tiny_gguf), "--prompt", "hello world", *common]) == 0
    local = json.loads(capsys.readouterr().out)
    with ThreadFleet(tiny_gguf, [(0, 3), (3, 6)], tmp_path / "fleet") as fleet:
        assert main(["generate", "hello world", "--model", str(tiny_gguf), "--bootstrap", fleet.bootstrap_addr,
                     *common]) == 0
    network = json.loads(capsys.readouterr().out)
    assert network["tokens"] == local["tokens"] and len(local["tokens"]) == 5


def test_a_gguf_path_that_is_not_there_is_not_a_model_id(tmp_path, capsys):
    assert main(["generate", "hi", "--model", "typo.gguf", "--bootstrap", BOOT]) == 2
    assert "checkpoint typo.gguf does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["generate", "--model", "m", "--prompt-ids", "1"], ["status"],
                                  ["join", "--model", "m", "--layers", "0:1"]])
def test_a_quic_bootstrap_address_is_refused_before_dialling(argv, tmp_path, never_dial, capsys):
    """Peers dial what they listen on, TCP by default: a QUIC bootstrap address failed after the dial timeout with
    py-libp2p's "No registered transport can dial"."""
    assert main([*argv, "--bootstrap", QUIC]) == 2
    assert f"cannot dial the bootstrap address {QUIC}: peers dial over TCP" in capsys.readouterr().err


def test_a_bootstrap_node_only_on_quic_is_refused(tmp_path, capsys):
    argv = ["bootstrap", "--listen", "/ip4/127.0.0.1/udp/0/quic-v1", "--key", str(tmp_path / "k"), "--run-for", "0"]
    assert main(argv) == 2
    assert "cannot bootstrap on /ip4/127.0.0.1/udp/0/quic-v1: peers dial bootstrap nodes over TCP" in \
        capsys.readouterr().err


class _Lines(logging.Handler):
    def __init__(self, level: int) -> None:
        super().__init__(level)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_the_readme_peer_beside_a_join_logs_no_mux_failure(tiny, tmp_path, bootstrap_node):
    """The README's "Embed a peer" snippet beside a running stage: it serves the layers the swarm lacks and
    generates; the bootstrap's reachability probe (a Noise handshake, then close) made py-libp2p log ``fail to upgrade
    mux for peer ...`` at ERROR on every check, which now shows at DEBUG only."""
    import trio

    from sangama_p2p import Peer, PeerConfig
    from sangama_p2p.net.config import HostConfig

    libp2p_log, swarm_log = logging.getLogger("libp2p"), logging.getLogger("libp2p.network.swarm")
    level = libp2p_log.level
    libp2p_log.setLevel(logging.WARNING)  # as a library user has it (a CLI test in this process may have quieted it)
    shown, debug = _Lines(logging.WARNING), _Lines(logging.DEBUG)
    swarm_log.addHandler(shown)
    swarm_log.addHandler(debug)

    def host(name: str) -> HostConfig:
        return HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(bootstrap_node,),
                          key_path=tmp_path / f"{name}.key")

    async def run() -> str | None:
        async with Peer(PeerConfig(host=host("join"))) as stage:  # what `join --layers 0:4` runs
            await stage.serve(tiny, "0:4", tokenizer=False)
            async with Peer(PeerConfig(host=host("snippet"))) as peer:  # the README's snippet
                assert await peer.serve(tiny, "auto") == (4, 6)
                text = (await peer.generate("hello", 4, guesses="auto")).text
                with trio.fail_after(60):  # the probe's hang-up was seen, at DEBUG
                    while not any("fail to upgrade mux" in line for line in debug.lines):
                        await trio.sleep(0.05)
                return text

    try:
        assert trio.run(run)
    finally:
        swarm_log.removeHandler(shown)
        swarm_log.removeHandler(debug)
        libp2p_log.setLevel(level)
    assert not [line for line in shown.lines if "fail to upgrade mux" in line], shown.lines


def test_a_bootstrap_node_says_it_stops_on_sigterm(tmp_path):
    proc, _ = _spawn_bootstrap(tmp_path / "k")
    try:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert out.splitlines()[-1] == "stopping (SIGTERM)"
