"""Downloads from a Hub-shaped HTTP server on loopback (tests/hub/hubserver.py), reached through HF_ENDPOINT."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sangama_p2p.errors import DownloadError, LayerRangeError
from sangama_p2p.hub import HubSettings, resolve_model
from sangama_p2p.model.fingerprint import checkpoint_identity

from .hubserver import HubServer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def _shard_by_layer(src: Path, dst: Path) -> Path:
    """``src`` (one model.safetensors) re-saved as one shard per layer (embed with layer 0, head with the last)."""
    from safetensors.torch import load_file, save_file

    from sangama_p2p.model.weights import layer_of

    tensors = load_file(src / "model.safetensors")
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    layers = 1 + max(layer_of(n) or 0 for n in tensors)
    groups: dict[int, list[str]] = {}
    for n in tensors:
        layer = layer_of(n)
        groups.setdefault(0 if n.startswith("model.embed") else layers - 1 if layer is None else layer, []).append(n)
    weight_map = {}
    for k, names in sorted(groups.items()):
        fname = f"model-{k + 1:05d}-of-{layers:05d}.safetensors"
        save_file({n: tensors[n] for n in names}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return dst


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    from sangama_p2p.model.gguf.writer import write_gguf
    from sangama_p2p.model.make import make_model

    root = tmp_path_factory.mktemp("hubrepos")
    full = make_model(root / "full", "llama", "tiny", seed=3)
    sharded = _shard_by_layer(full, root / "sharded")
    gdir = root / "gguf"
    gdir.mkdir()
    splits = write_gguf(full, gdir / "tiny-F32.gguf", "F32", split_max_tensors=12)
    single = root / "gguf1"
    single.mkdir()
    (one,) = write_gguf(full, single / "tiny-F32.gguf", "F32")
    return {"full": full, "sharded": sharded, "gguf": gdir, "splits": splits, "gguf1": single, "one": one}


@pytest.fixture
def hub(repos):
    with HubServer() as s:
        s.add("org/sharded", repos["sharded"])
        s.add("org/gguf", repos["gguf"])
        s.add("org/gguf1", repos["gguf1"])
        s.add("org/full", repos["full"])
        yield s


@pytest.fixture
def settings(hub, tmp_path):
    return HubSettings(endpoint=hub.url, cache_dir=tmp_path / "cache")


def _size(d: Path, name: str) -> int:
    return (d / name).stat().st_size


def test_a_stage_fetches_its_shards_and_only_windows_of_the_others(hub, settings, repos):
    stage = resolve_model("hf:org/sharded", layers=(2, 4), settings=settings, progress=False)
    src = repos["sharded"]
    for k in (3, 4):  # shards of layers 2 and 3 come whole
        name = f"model-{k:05d}-of-00006.safetensors"
        assert hub.served[name] == _size(src, name)
    for k in (1, 2, 5, 6):
        name = f"model-{k:05d}-of-00006.safetensors"
        assert 0 < hub.served[name] < _size(src, name) // 20, (name, hub.served[name])
    total = sum(hub.served.values())
    model = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    assert total < model * 0.4  # 2 of 6 layers
    full = checkpoint_identity(repos["full"], parts=["2", "3"])
    mine = checkpoint_identity(stage, parts=["2", "3"])
    assert mine == full  # the model fingerprint and the stage's part hashes are the full checkpoint's


def test_a_later_stage_fetches_only_what_is_missing_and_offline_mode_uses_the_cache(hub, settings):
    a = resolve_model("hf:org/sharded", layers=(2, 4), settings=settings, progress=False)
    hub.reset_counts()
    b = resolve_model("hf:org/sharded", layers=(2, 4), settings=settings, progress=False)
    assert a == b and sum(hub.served.values()) == 0
    offline = HubSettings(endpoint="http://127.0.0.1:9", cache_dir=settings.cache_dir, offline=True)
    assert resolve_model("hf:org/sharded", layers=(2, 4), settings=offline) == a
    with pytest.raises(DownloadError, match="offline"):
        resolve_model("hf:org/sharded", layers=(0, 1), settings=offline)


def test_a_cut_transfer_resumes_where_it_stopped(hub, settings, repos, monkeypatch):
    from huggingface_hub import constants

    # hf_hub_download writes in chunks of DOWNLOAD_CHUNK_SIZE (10 MB) and resumes from the last whole chunk; the
    # test files are 2.6 MB, so chunks of 64 KiB let the cut land after some were written
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 << 10)
    name = "model-00003-of-00006.safetensors"
    hub.cut_once.add(name)
    resolve_model("hf:org/sharded", layers=(2, 3), settings=settings, progress=False)
    size = _size(repos["sharded"], name)
    assert len(hub.ranges[name]) == 2 and hub.ranges[name][1] is not None  # resumed with a Range request
    assert size <= hub.served[name] < size * 1.1  # not started over


def test_a_corrupted_byte_is_refused_and_the_file_is_not_kept(hub, settings):
    from huggingface_hub import try_to_load_from_cache

    name = "model-00004-of-00006.safetensors"
    hub.corrupt.add(name)
    with pytest.raises(DownloadError, match="sha256"):
        resolve_model("hf:org/sharded", layers=(2, 4), settings=settings, progress=False)
    assert try_to_load_from_cache("org/sharded", name, cache_dir=str(settings.cache_dir)) is None
    assert not list(settings.cache_dir.rglob(name))


def test_six_transfers_run_at_once(hub, settings):
    hub.delay = 0.01
    resolve_model("hf:org/sharded", settings=settings, progress=False)
    assert hub.max_in_flight == 6


def test_split_gguf_fetches_the_first_part_and_the_stage_parts(hub, settings, repos):
    first = repos["splits"][0].name
    stage = resolve_model(f"hf:org/gguf:{first}", layers=(4, 6), settings=settings, progress=False)
    from sangama_p2p.model.gguf.reader import GGUFFile

    whole = GGUFFile(repos["splits"][0])
    need = {i.file for n, i in whole.tensors.items() if n.startswith(("blk.4.", "blk.5.", "output"))} | {0}
    whole.close()
    for i, p in enumerate(repos["splits"]):
        if i in need:  # whole, after a header probe of 256 KiB or more (every part's header says where its tensors are)
            assert p.stat().st_size <= hub.served[p.name] <= p.stat().st_size + (1 << 20)
        else:
            assert hub.served[p.name] < p.stat().st_size // 4, p.name
    assert len(need) < len(repos["splits"])
    assert checkpoint_identity(stage, parts=["4", "5"]) == checkpoint_identity(repos["splits"][0], parts=["4", "5"])


def test_one_big_gguf_is_fetched_by_ranges_into_a_sparse_file(hub, settings, repos):
    hub.cut_once.add("tiny-F32.gguf")  # the first range request is cut halfway: it continues from there
    stage = resolve_model("hf:org/gguf1:tiny-F32.gguf", layers=(1, 3), settings=settings, progress=False)
    size = repos["one"].stat().st_size
    assert stage.stat().st_size == size
    assert hub.served["tiny-F32.gguf"] < size * 0.5
    assert all(r is not None for r in hub.ranges["tiny-F32.gguf"])
    assert checkpoint_identity(stage, parts=["1", "2"]) == checkpoint_identity(repos["one"], parts=["1", "2"])


def test_bad_names_and_ranges_are_typed_errors(hub, settings):
    from sangama_p2p.errors import CheckpointError

    with pytest.raises(DownloadError):
        resolve_model("hf:org/missing", settings=settings, progress=False)
    with pytest.raises(LayerRangeError):
        resolve_model("hf:org/sharded", layers=(4, 9), settings=settings, progress=False)
    for bad in ("hf:nope", "hf:org/r:weights.bin", "hf:org/r:../x.gguf"):
        with pytest.raises(CheckpointError):
            resolve_model(bad, settings=settings)


@pytest.mark.parametrize("repo", ["hf:org/gguf1:tiny-F32.gguf", "hf:org/sharded", "hf:org/full"])
def test_three_stage_copies_chained_give_the_full_checkpoints_tokens(hub, settings, repos, repo):
    """Each stage loads from its own partial copy (only its layers' bytes are real): the chain's greedy tokens
    equal those of the full local checkpoint split the same way."""
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange
    from sangama_p2p.model.stage import StageModel

    ranges = [(0, 2), (2, 4), (4, 6)]
    stages, opened = [], []
    for a, b in ranges:
        ckpt = open_checkpoint(resolve_model(repo, layers=(a, b), settings=settings, progress=False))
        opened.append(ckpt)
        stages.append(StageModel.load(ckpt.spec, ckpt.source, a, b))
    full = open_checkpoint(repos["one"] if "gguf" in repo else repos["full"])
    if repo == "hf:org/full":  # one model.safetensors: each stage fetched ranges of it, about a third
        assert hub.served["model.safetensors"] < 1.5 * (repos["full"] / "model.safetensors").stat().st_size
    want = LocalChain.load(full, [LayerRange(a, b) for a, b in ranges]).generate([5, 17, 42], 8, stop_at_eos=False)
    got = LocalChain(stages).generate([5, 17, 42], 8, stop_at_eos=False)
    assert got.tokens == want.tokens and len(want.tokens) == 8
    # a copy holds only its own layers: the last stage loaded from the first stage's copy reads zeros
    wrong = StageModel.load(opened[0].spec, opened[0].source, 4, 6)
    assert LocalChain([*stages[:2], wrong]).generate([5, 17, 42], 8, stop_at_eos=False).tokens != want.tokens
    for c in opened + [full]:
        c.close()


def test_progress_bars_draw_on_stderr(hub, settings, capsys):
    resolve_model("hf:org/gguf1:tiny-F32.gguf", layers=(0, 1), settings=settings, progress=True)
    assert "tiny-F32.gguf" in capsys.readouterr().err


@pytest.mark.parametrize("repo", ["hf:org/gguf1:tiny-F32.gguf", "hf:org/sharded"])
def test_metadata_only_gives_the_tokenizer_and_template_without_weights(hub, settings, repos, repo):
    from sangama_p2p.model.chat_model import open_chat_model

    path = resolve_model(repo, settings=settings, progress=False, metadata_only=True)
    assert open_chat_model(path).tokenizer.encode("hello world")
    weights = sum(n for k, n in hub.served.items() if k.endswith((".safetensors", ".gguf")))
    assert weights < 300_000  # a GGUF's header probe at most; no shard


def test_a_hub_ggufs_metadata_copy_pins_the_full_files_fingerprint(hub, settings, repos):
    """A client of ``hf:ORG/REPO:FILE.gguf`` chains only peers of that very file (cli/pin.py): its sparse metadata copy
    holds the header and the fingerprint's sample windows, so it fingerprints as the whole file does."""
    from sangama_p2p.cli.pin import local_pin
    from sangama_p2p.model.fingerprint import checkpoint_identity

    path = resolve_model("hf:org/gguf1:tiny-F32.gguf", settings=settings, progress=False, metadata_only=True)
    full = checkpoint_identity(repos["one"])
    pin = local_pin(path, None)
    assert (pin.fingerprint, pin.num_layers) == (full.fingerprint, full.num_layers)
    assert hub.served["tiny-F32.gguf"] < repos["one"].stat().st_size  # not the weights


@pytest.mark.parametrize("repo", ["org/sharded", "org/full"])
def test_a_safetensors_repos_metadata_copy_pins_the_full_checkpoints_fingerprint(hub, settings, repos, repo):
    """``hf:ORG/REPO`` of safetensors (sharded, or one model.safetensors): the client's metadata copy holds every
    shard's header and the fingerprint's sample windows, so it pins fingerprint and depth without the weights (a
    copy of config and tokenizer alone gave the depth only, and an unpinned client in a public swarm)."""
    from sangama_p2p.cli.pin import local_pin

    path = resolve_model(f"hf:{repo}", settings=settings, progress=False, metadata_only=True)
    full = checkpoint_identity(repos["full"])
    pin = local_pin(path, None)
    assert (pin.fingerprint, pin.num_layers) == (full.fingerprint, full.num_layers)
    src = repos["sharded" if repo == "org/sharded" else "full"]
    weights = sum(n for k, n in hub.served.items() if k.endswith(".safetensors"))
    assert weights < sum(p.stat().st_size for p in src.glob("*.safetensors")) // 20  # not the weights


def test_all_layers_come_as_whole_checked_files(hub, settings, repos):
    path = resolve_model("hf:org/gguf1:tiny-F32.gguf", layers=(0, 6), settings=settings, progress=False)
    assert "snapshots" in path.parts and path.read_bytes() == repos["one"].read_bytes()
    assert hub.served["tiny-F32.gguf"] <= repos["one"].stat().st_size + (256 << 10)  # + the header probe
