"""Checkpoint identity (model.fingerprint): what makes two checkpoints one model, and what tells them apart."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from sangama_p2p.errors import CheckpointError
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.fingerprint import (
    SAMPLE_BYTES,
    SAMPLE_WINDOWS,
    checkpoint_identity,
    parts_of,
    stage_identity,
    tensor_table,
)
from sangama_p2p.model.make import make_model
from sangama_p2p.model.stage import StageModel

FIXTURES = Path("/work/shared/fixtures/gguf")
QWEN_GGUF = FIXTURES / "qwen35moe-h16" / "tiny-qwen35moe-F32.gguf"

ALL_QWEN = ["embed", *map(str, range(8)), "head"]


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp")
    return {
        "a": make_model(root / "a", "qwen3_5_moe", "tiny", seed=0),
        "b": make_model(root / "b", "qwen3_5_moe", "tiny", seed=0),  # the same bytes, written again
        "seed1": make_model(root / "seed1", "qwen3_5_moe", "tiny", seed=1),
        "bf16": make_model(root / "bf16", "qwen3_5_moe", "tiny", seed=0, dtype="bfloat16"),
        "llama": make_model(root / "llama", "llama", "tiny", seed=0),
    }


def ident(path: Path, parts=ALL_QWEN):
    return checkpoint_identity(path, parts=parts)


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def entry(path: Path, name: str):
    ckpt = open_checkpoint(path)
    try:
        return next(e for e in tensor_table(ckpt.source, ckpt.spec)[1] if e.name == name)
    finally:
        ckpt.close()


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x01]))


def test_the_same_checkpoint_twice_has_one_identity(made):
    a, b = ident(made["a"]), ident(made["b"])
    assert a == b
    assert len(a.fingerprint) == 32 and a.num_layers == 8
    assert [p for p, _ in a.layer_hashes] == ALL_QWEN  # embed, layers in order, head


def test_other_seed_dtype_or_architecture_differ_everywhere(made):
    a = ident(made["a"])
    for other in ("seed1", "bf16"):
        o = ident(made[other])
        assert o.fingerprint != a.fingerprint
        assert all(x != y for (_, x), (_, y) in zip(o.layer_hashes, a.layer_hashes))
    llama = checkpoint_identity(made["llama"])
    assert llama.fingerprint != a.fingerprint and llama.num_layers == 6


def test_stages_of_one_checkpoint_agree_and_hash_only_their_parts(made):
    ckpt = open_checkpoint(made["a"])
    first = StageModel.load(ckpt.spec, ckpt.source, 0, 3)
    last = StageModel.load(ckpt.spec, ckpt.source, 3, 8)
    parts_first, parts_last = parts_of(first.loaded_names), parts_of(last.loaded_names)
    assert parts_first == {"embed", "0", "1", "2"}
    assert parts_last == {"embed", "3", "4", "5", "6", "7", "head"}  # the MTP layer reads the embedding
    i1, i2 = stage_identity(ckpt.spec, ckpt.source, parts_first), stage_identity(ckpt.spec, ckpt.source, parts_last)
    full = dict(ident(made["a"]).layer_hashes)
    assert i1.fingerprint == i2.fingerprint
    assert dict(i1.layer_hashes) == {p: full[p] for p in parts_first}
    assert dict(i2.layer_hashes) == {p: full[p] for p in parts_last}
    ckpt.close()


def test_a_changed_byte_changes_its_layer_hash_and_a_sampled_one_the_fingerprint(made, tmp_path):
    a = ident(made["a"])
    name = "model.layers.2.mlp.shared_expert.down_proj.weight"
    e = entry(made["a"], name)
    # a byte between the sample windows: only layer 2's hash moves (the fingerprint reads samples, not all bytes)
    between = copy(made["a"], tmp_path / "between")
    window_gap = (e.nbytes - SAMPLE_BYTES) // (SAMPLE_WINDOWS - 1)
    assert window_gap > SAMPLE_BYTES  # room between two windows
    flip_byte(between / "model.safetensors", e.offset + SAMPLE_BYTES + 1)
    c = ident(between)
    changed = [p for (p, x), (_, y) in zip(a.layer_hashes, c.layer_hashes) if x != y]
    assert changed == ["2"]
    assert c.fingerprint == a.fingerprint
    # a byte inside a sample window (the last byte of the tensor): the fingerprint moves too
    sampled = copy(made["a"], tmp_path / "sampled")
    flip_byte(sampled / "model.safetensors", e.offset + e.nbytes - 1)
    s = ident(sampled)
    assert s.fingerprint != a.fingerprint
    assert [p for (p, x), (_, y) in zip(a.layer_hashes, s.layer_hashes) if x != y] == ["2"]


def test_config_values_that_change_numbers_count_and_token_ids_do_not(made, tmp_path):
    a = ident(made["a"])
    for key, value, same in (("rms_norm_eps", 1e-5, False), ("rope_theta", 12345.0, False),
                             ("eos_token_id", 3, True), ("max_position_embeddings", 77, True)):
        d = copy(made["a"], tmp_path / key)
        cfg = json.loads((d / "config.json").read_text())
        target = cfg.get("text_config", cfg)
        if key == "rope_theta" and "rope_parameters" in target:
            target["rope_parameters"]["rope_theta"] = value
        else:
            target[key] = value
        (d / "config.json").write_text(json.dumps(cfg))
        assert (ident(d).fingerprint == a.fingerprint) is same, key


def test_sharding_does_not_change_the_identity(made, tmp_path):
    from safetensors.torch import load_file, save_file

    tensors = load_file(made["a"] / "model.safetensors")
    d = tmp_path / "sharded"
    d.mkdir()
    for f in ("config.json",):
        shutil.copy(made["a"] / f, d / f)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n] for n in part}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    assert ident(d) == ident(made["a"])


def test_gguf_and_safetensors_of_one_model_are_different_models(made, tmp_path):
    from sangama_p2p.model.gguf.writer import write_gguf

    (f32,) = write_gguf(made["llama"], tmp_path / "llama-F32.gguf", "F32")
    (f16,) = write_gguf(made["llama"], tmp_path / "llama-F16.gguf", "F16")
    st = checkpoint_identity(made["llama"])
    g32, g16 = checkpoint_identity(f32), checkpoint_identity(f16)
    assert len({st.fingerprint, g32.fingerprint, g16.fingerprint}) == 3  # format and types are part of identity
    assert st.num_layers == g32.num_layers == 6
    assert checkpoint_identity(f32) == g32  # and a GGUF agrees with itself


@pytest.mark.skipif(not QWEN_GGUF.is_file(), reason="GGUF fixtures not on this machine")
def test_gguf_parts_follow_layers_and_put_mtp_blocks_in_the_head():
    ckpt = open_checkpoint(QWEN_GGUF)
    fmt, entries = tensor_table(ckpt.source, ckpt.spec)
    assert fmt == "gguf" and len(entries) == 169
    by_part: dict[str, list[str]] = {}
    for e in entries:
        by_part.setdefault(e.part, []).append(e.name)
    assert set(by_part) == set(ALL_QWEN)
    assert all(n.startswith("blk.8.") or n in ("output.weight", "output_norm.weight") for n in by_part["head"])
    assert by_part["embed"] == ["token_embd.weight"]
    assert all(n.startswith("blk.3.") for n in by_part["3"])
    whole = stage_identity(ckpt.spec, ckpt.source, ALL_QWEN)
    ckpt.close()
    assert checkpoint_identity(QWEN_GGUF, parts=["5"]).layer_hashes == (("5", whole.hash_of("5")),)


def test_a_part_the_checkpoint_lacks_and_a_truncated_file_are_errors(made, tmp_path):
    with pytest.raises(CheckpointError, match="no tensors for part"):
        ident(made["a"], parts=["8"])
    d = copy(made["a"], tmp_path / "cut")
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:4])
    with pytest.raises(CheckpointError):
        checkpoint_identity(d)


def test_an_mtp_layer_taken_from_safetensors_is_part_of_the_gguf_identity(made, tmp_path):
    from sangama_p2p.model.gguf.writer import write_gguf

    (q8,) = write_gguf(made["a"], tmp_path / "q.gguf", "Q8_0")
    alone = checkpoint_identity(q8, parts=["head"])
    with_mtp = checkpoint_identity(q8, parts=["head"], mtp_from=made["a"])
    other_mtp = checkpoint_identity(q8, parts=["head"], mtp_from=made["seed1"])
    assert len({alone.fingerprint, with_mtp.fingerprint, other_mtp.fingerprint}) == 3
    assert len({alone.hash_of("head"), with_mtp.hash_of("head"), other_mtp.hash_of("head")}) == 3
    ckpt = open_checkpoint(q8, mtp_from=made["a"])
    names = [e.name for e in tensor_table(ckpt.source, ckpt.spec)[1] if e.name.startswith("mtp_from:")]
    ckpt.close()
    assert names and all(n.startswith("mtp_from:mtp.") for n in names)


def _mapped_rss(path: Path) -> dict[str, int]:
    """Resident bytes of each of this process's mappings of ``path``, by address range (/proc/self/smaps)."""
    out: dict[str, int] = {}
    where = None
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:
            where = head[0] if len(head) >= 6 and head[5] == str(path) else None
        elif where is not None and line.startswith("Rss:"):
            out[where] = int(head[1]) * 1024
    return out


@pytest.mark.parametrize("kind", ["safetensors", "gguf"])
def test_hashing_leaves_no_pages_of_the_checkpoint_resident(made, tmp_path: Path, kind: str) -> None:
    """Hashing every part reads every stored byte with positioned reads into one buffer, so no page of the file is
    left mapped in this process (through a read-only map, as before, the whole 17.8 MB file stayed resident here,
    and SmolLM2 Q4_K_M's stage peaked 93 MiB over its own memory)."""
    from sangama_p2p.model.fingerprint import _Files, _sample_digest, part_hashes

    if kind == "gguf":
        from sangama_p2p.model.gguf import write_gguf

        (path,) = write_gguf(made["llama"], tmp_path / "l.gguf", "F32")
    else:
        path = made["llama"] / "model.safetensors"
    ckpt = open_checkpoint(path if kind == "gguf" else made["llama"], tokenizer=False)
    _fmt, entries = tensor_table(ckpt.source, ckpt.spec)
    before = _mapped_rss(path.resolve())  # the source's own maps
    files = _Files()
    try:
        _sample_digest(entries, files)
        part_hashes(entries, {e.part for e in entries}, files)
        held = sum(rss for where, rss in _mapped_rss(path.resolve()).items() if where not in before)
    finally:
        files.close()
    assert path.stat().st_size > 1 << 20
    assert held <= 64 << 10, (held, path.stat().st_size)
