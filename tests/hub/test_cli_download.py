"""``sangama-peer download`` and ``generate --local hf:...`` through HF_ENDPOINT against the loopback Hub server."""

from __future__ import annotations

from pathlib import Path

import pytest

from sangama_p2p.cli.main import main
from sangama_p2p.model.fingerprint import checkpoint_identity

from .hubserver import HubServer
from .test_download import repos  # noqa: F401  (the module-scoped checkpoints)


@pytest.fixture
def hub_env(repos, tmp_path, monkeypatch):  # noqa: F811
    with HubServer() as s:
        s.add("org/sharded", repos["sharded"])
        s.add("org/gguf1", repos["gguf1"])
        monkeypatch.setenv("HF_ENDPOINT", s.url)
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "cache"))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield s


def _out(capsys) -> str:
    return capsys.readouterr().out


def test_download_prints_the_stage_copy(hub_env, repos, capsys, tmp_path):  # noqa: F811
    assert main(["download", "hf:org/sharded", "--layers", "0:2", "--no-progress", "--dir", str(tmp_path / "d")]) == 0
    path = Path(_out(capsys).strip())
    assert path == tmp_path / "d"
    assert checkpoint_identity(path, parts=["embed", "0", "1"]) == checkpoint_identity(
        repos["full"], parts=["embed", "0", "1"])
    assert hub_env.served["model-00006-of-00006.safetensors"] < 100_000  # the last layer's shard: windows only


def test_download_refuses_a_bad_range_with_exit_2(hub_env, capsys):
    assert main(["download", "hf:org/sharded", "--layers", "5", "--no-progress"]) == 2
    assert "A:B" in capsys.readouterr().err


@pytest.mark.parametrize("repo,local", [("hf:org/sharded", "full"), ("hf:org/gguf1:tiny-F32.gguf", "one")])
def test_generate_local_from_the_hub_equals_the_local_file(hub_env, repos, capsys, repo, local):  # noqa: F811
    args = ["--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--threads", "1"]
    assert main(["generate", "--local", str(repos[local]), *args]) == 0
    want = _out(capsys)
    assert main(["generate", "--local", repo, *args]) == 0
    assert _out(capsys) == want and want.strip()


def test_smollm2_stage_by_ranges_fetches_a_third_and_keeps_the_fingerprint(smollm2_gguf, tmp_path):
    from sangama_p2p.hub import HubSettings, resolve_model
    from sangama_p2p.model.gguf.reader import GGUFFile

    path = Path(smollm2_gguf)
    f = GGUFFile(path)
    stage_bytes = sum(i.nbytes for n, i in f.tensors.items()
                      if any(n.startswith(f"blk.{k}.") for k in range(10, 20)))
    f.close()
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / path.name).symlink_to(path)
    with HubServer() as s:
        s.add("HuggingFaceTB/SmolLM2-135M-Instruct-GGUF", repo)
        settings = HubSettings(endpoint=s.url, cache_dir=tmp_path / "cache")
        stage = resolve_model(f"hf:HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:{path.name}", layers=(10, 20),
                              settings=settings, progress=False)
        served = s.served[path.name]
        requests = len(s.ranges[path.name])
    size = path.stat().st_size
    print(f"SmolLM2 {path.name}: layers 10:20 of 30 fetched {served} of {size} bytes ({served / size:.1%}); "
          f"the stage's tensors are {stage_bytes} bytes; {requests} range requests")
    assert stage_bytes <= served < stage_bytes + (4 << 20)  # + the header (~1.6 MB) and the sample windows
    parts = [str(k) for k in range(10, 20)]
    assert checkpoint_identity(stage, parts=parts) == checkpoint_identity(path, parts=parts)


def test_join_serves_a_stage_fetched_from_the_hub(hub_env, repos, capsys, tmp_path, monkeypatch):  # noqa: F811
    from sangama_p2p.cli import swarm

    monkeypatch.setattr(swarm, "default_bootstrap_addrs", lambda: ())  # the swarm's first peer: dial nobody
    assert main(["join", "--model", "hf:org/gguf1:tiny-F32.gguf", "--layers", "2:4", "--listen", "/ip4/127.0.0.1/tcp/0",
                 "--key", str(tmp_path / "k"), "--run-for", "0.1"]) == 0
    out = capsys.readouterr().out
    ready = [line.split() for line in out.splitlines() if line.startswith("ready ")]
    assert ready and ready[0][2:] == ["tiny-F32", "2:4"], out
    assert hub_env.served["tiny-F32.gguf"] < repos["one"].stat().st_size // 2  # only the stage's ranges


def test_hf_hub_offline_uses_the_cache_or_exits_2(hub_env, capsys, monkeypatch):
    assert main(["download", "hf:org/gguf1:tiny-F32.gguf", "--layers", "1:3", "--no-progress"]) == 0
    first = capsys.readouterr().out.strip()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub_env.reset_counts()
    assert main(["download", "hf:org/gguf1:tiny-F32.gguf", "--layers", "1:3", "--no-progress"]) == 0
    assert capsys.readouterr().out.strip() == first and not hub_env.ranges
    assert main(["download", "hf:org/gguf1:tiny-F32.gguf", "--layers", "0:3", "--no-progress"]) == 2
    assert "offline" in capsys.readouterr().err


def test_api_takes_its_tokenizer_from_the_hub_and_answers_as_generate_local(hub_env, repos, capsys,  # noqa: F811
                                                                            tmp_path):
    """``api --model hf:ORG/REPO:FILE.gguf`` fetches the tokenizer, template and config only (the weights stay with
    the stages) and names the model as ``join`` does; its greedy tokens equal ``generate --local``'s."""
    import json
    import os
    import subprocess
    import sys
    import urllib.request

    from sangama_p2p.cli.local_fleet import ThreadFleet

    args = ["--prompt-ids", "5,17,42", "--max-new-tokens", "6", "--threads", "1", "--json"]
    assert main(["generate", "--local", str(repos["one"]), *args]) == 0
    want = json.loads(_out(capsys))["tokens"]
    hub_env.reset_counts()
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"), OMP_NUM_THREADS="1")
    with ThreadFleet(repos["one"], [(0, 3), (3, 6)], tmp_path) as fleet:
        proc = subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "api", "--model",
                                 "hf:org/gguf1:tiny-F32.gguf", "--bootstrap", fleet.bootstrap_addr, "--port", "0"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("api listening "), proc.stderr.read() if proc.stderr else ""
            url = line.split()[2]
            assert line.split()[-1] == "tiny-F32)"
            with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
                assert [m["id"] for m in json.load(r)["data"]] == ["tiny-F32"]
            body = json.dumps({"model": "tiny-F32", "prompt": [5, 17, 42], "max_tokens": 6, "temperature": 0}).encode()
            req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                got = json.load(r)["choices"][0]["token_ids"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    assert got == want
    weights = hub_env.served.get("tiny-F32.gguf", 0)
    assert weights < repos["one"].stat().st_size // 4  # the header's metadata, not the tensors
