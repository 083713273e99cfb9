"""A Hub that lies: file names and commit shas that would leave the cache, transfers that stall, a Hub not there.

Each hostile case checks the files it would have written or overwritten outside the cache (a victim file with
content of its own beside the cache), not only the error.
"""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import pytest

from sangama_p2p.cli.main import main
from sangama_p2p.errors import DownloadError
from sangama_p2p.hub import HubSettings, resolve_model

from .hubserver import HubServer
from .test_download import repos  # noqa: F401  (the module-scoped checkpoints)

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

_PRECIOUS = b"the user's own bytes\n" * 2000
_UP_TO_TMP = "../../../../../"  # from <cache>/models--org--evil/sangama/<commit>/layers-0-2 to the cache's parent


@pytest.fixture
def victim(tmp_path) -> Path:
    path = tmp_path / "victim.safetensors"
    path.write_bytes(_PRECIOUS)
    return path


def _outside_cache(tmp_path: Path) -> set[str]:
    """What lies beside the cache: the names of tmp_path's entries other than the cache and the test's own."""
    return {p.name for p in tmp_path.iterdir()} - {"cache", "repo", "victim.safetensors"}


def _evil_repo(repos, tmp_path: Path, name: str) -> Path:  # noqa: F811
    """The sharded repo whose index names the last shard (the head's: partial on a stage of layers 0:2) ``name``."""
    repo = tmp_path / "repo"
    shutil.copytree(repos["sharded"], repo)
    index = json.loads((repo / "model.safetensors.index.json").read_text())
    last = max(set(index["weight_map"].values()))
    index["weight_map"] = {k: name if v == last else v for k, v in index["weight_map"].items()}
    (repo / "model.safetensors.index.json").write_text(json.dumps(index))
    (repo / last).rename(repo / "served-as-evil.bin")
    return repo


@pytest.fixture
def evil_hub(repos, tmp_path, monkeypatch):  # noqa: F811
    with HubServer() as s:
        s.add("org/gguf1", repos["gguf1"])
        monkeypatch.setenv("HF_ENDPOINT", s.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield s


def _serve_evil(hub: HubServer, repos, tmp_path: Path, name: str) -> None:  # noqa: F811
    repo = _evil_repo(repos, tmp_path, name)
    hub.add("org/evil", repo)
    hub.extra["org/evil"][name] = repo / "served-as-evil.bin"


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_an_index_naming_a_shard_outside_the_stage_writes_nothing_there(evil_hub, repos, tmp_path, victim,  # noqa: F811
                                                                        kind):
    name = _UP_TO_TMP + victim.name if kind == "dotdot" else str(victim)
    _serve_evil(evil_hub, repos, tmp_path, name)
    with pytest.raises(DownloadError, match=name.replace(".", r"\.")):
        resolve_model("hf:org/evil", layers=(0, 2), settings=HubSettings.from_env(), progress=False)
    assert victim.read_bytes() == _PRECIOUS  # the old code truncated it to the shard's size and wrote its header
    assert _outside_cache(tmp_path) == set()


def test_a_listing_naming_a_file_outside_the_repo_is_refused_before_anything_is_fetched(evil_hub, repos,  # noqa: F811
                                                                                        tmp_path):
    name = _UP_TO_TMP + "stray.gguf"
    evil_hub.extra["org/gguf1"][name] = repos["one"]
    with pytest.raises(DownloadError, match=r"\.\./\.\./.*stray\.gguf"):
        resolve_model("hf:org/gguf1:tiny-F32.gguf", layers=(1, 3), settings=HubSettings.from_env(), progress=False)
    assert not evil_hub.ranges  # refused at the listing: no byte of any file asked for
    assert _outside_cache(tmp_path) == set()


@pytest.mark.parametrize("name", ["", "a//b.json", "a\\..\\b.json", "nul\0.json", "./config.json"])
def test_odd_listed_names_are_refused(evil_hub, victim, name):
    evil_hub.extra["org/gguf1"][name] = victim
    with pytest.raises(DownloadError, match="refuses the file name"):
        resolve_model("hf:org/gguf1:tiny-F32.gguf", layers=(1, 3), settings=HubSettings.from_env(), progress=False)


@pytest.mark.parametrize("sha", ["../../../somewhere", "0123456789abcdef", "0123456789abcdef0123456789abcdef0123456/"])
def test_a_commit_that_is_not_40_hex_digits_is_refused(evil_hub, tmp_path, sha):
    evil_hub.commit = sha
    with pytest.raises(DownloadError, match="not a commit sha"):
        resolve_model("hf:org/gguf1:tiny-F32.gguf", layers=(1, 3), settings=HubSettings.from_env(), progress=False)
    assert _outside_cache(tmp_path) == set()  # the old code made <tmp>/somewhere/layers-1-3/tiny-F32.gguf


def test_cli_download_of_an_escaping_shard_exits_2_with_one_line(evil_hub, repos, tmp_path, victim,  # noqa: F811
                                                                capsys):
    name = _UP_TO_TMP + victim.name
    _serve_evil(evil_hub, repos, tmp_path, name)
    assert main(["download", "hf:org/evil", "--layers", "0:2", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    err = captured.err.strip()
    assert err.startswith("sangama-peer: error:") and "\n" not in err and name in err, err
    assert victim.read_bytes() == _PRECIOUS
    assert _outside_cache(tmp_path) == set()


# ---- a stalled transfer ------------------------------------------------------------------------------------------
def test_a_range_transfer_with_no_bytes_past_the_deadline_fails_saying_so(evil_hub, monkeypatch):
    monkeypatch.setenv("SANGAMA_HUB_STALL_TIMEOUT", "1")
    evil_hub.stall["tiny-F32.gguf"] = 6.0  # the old code waited (its read timeout was 30 s) and then succeeded
    with pytest.raises(DownloadError, match=r"no bytes .* for 1 s \(the progress deadline"):
        resolve_model("hf:org/gguf1:tiny-F32.gguf", layers=(1, 3), settings=HubSettings.from_env(), progress=False)


def test_a_slow_transfer_that_keeps_moving_is_not_cut(evil_hub, repos, tmp_path, monkeypatch):  # noqa: F811
    """One range that takes twice the deadline in all, with a byte every quarter of it: it completes."""
    from concurrent.futures import ThreadPoolExecutor

    from sangama_p2p.hub.fetch import Progress, fetch_spans

    from .hubserver import COMMIT

    monkeypatch.setenv("SANGAMA_HUB_STALL_TIMEOUT", "1.2")
    evil_hub.delay = 0.3  # per 64 KiB; 8 of them: 2.4 s
    n = 8 * 65536
    assert repos["one"].stat().st_size >= n
    with open(tmp_path / "part", "wb+") as f, ThreadPoolExecutor(1) as pool:
        got = fetch_spans(HubSettings.from_env(), "org/gguf1", COMMIT, "tiny-F32.gguf", [(0, n)], f.fileno(),
                          Progress(False), pool)
    assert got == n and (tmp_path / "part").read_bytes() == repos["one"].read_bytes()[:n]


def test_the_stall_deadline_defaults_to_60_s_and_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("SANGAMA_HUB_STALL_TIMEOUT", raising=False)
    assert HubSettings.from_env().stall_timeout == HubSettings().stall_timeout == 60.0
    monkeypatch.setenv("SANGAMA_HUB_STALL_TIMEOUT", "2.5")
    assert HubSettings.from_env().stall_timeout == 2.5
    monkeypatch.setenv("SANGAMA_HUB_STALL_TIMEOUT", "soon")
    with pytest.raises(DownloadError, match="SANGAMA_HUB_STALL_TIMEOUT"):
        HubSettings.from_env()


# ---- no Hub at all -----------------------------------------------------------------------------------------------
@pytest.fixture
def no_hub(tmp_path, monkeypatch) -> str:
    with socket.socket() as s:  # a loopback port that nobody listens on once this socket is closed
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_ENDPOINT", url)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return url


@pytest.mark.parametrize("argv", [
    ["download", "hf:org/gguf1:tiny-F32.gguf", "--no-progress"],
    ["generate", "--local", "hf:org/gguf1:tiny-F32.gguf", "--prompt-ids", "5,17", "--max-new-tokens", "2"],
    ["join", "--model", "hf:org/gguf1:tiny-F32.gguf", "--layers", "0:2", "--listen", "/ip4/127.0.0.1/tcp/0",
     "--run-for", "0.1"],
], ids=["download", "generate", "join"])
def test_every_hf_command_without_a_hub_says_so_in_one_line(no_hub, tmp_path, capsys, monkeypatch, argv):
    from sangama_p2p.cli import swarm

    monkeypatch.setattr(swarm, "default_bootstrap_addrs", lambda: ())
    if argv[0] == "join":
        argv = [*argv, "--key", str(tmp_path / "k")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith(f"sangama-peer: error: cannot reach the Hub at {no_hub}: "), err
    assert err.endswith("set HF_HUB_OFFLINE=1 to use the cache only"), err
