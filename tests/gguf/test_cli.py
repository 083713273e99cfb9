"""``sangama-peer make-model --gguf TYPE`` writes a GGUF beside the checkpoint that opens like any other."""

from __future__ import annotations

from pathlib import Path

import torch

from sangama_p2p.cli.main import main as cli_main
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.gguf.quants import QuantTensor


def test_make_model_gguf_flag(tmp_path: Path, capsys) -> None:
    assert cli_main(["make-model", str(tmp_path / "m"), "--arch", "llama", "--gguf", "Q8_0"]) == 0
    path = tmp_path / "m" / "model-Q8_0.gguf"
    assert path.is_file() and "GGUF Q8_0" in capsys.readouterr().out
    ck = open_checkpoint(path)
    ref = open_checkpoint(tmp_path / "m")
    assert ck.spec == ref.spec
    assert ck.tokenizer.encode("hello world") == ref.tokenizer.encode("hello world")
    assert isinstance(ck.source.get("model.layers.0.mlp.up_proj.weight", torch.float32), QuantTensor)
    for p in (path, tmp_path / "m"):  # tokenizer=False: the weights only, for GGUF files and directories alike
        bare = open_checkpoint(p, tokenizer=False)
        assert bare.tokenizer is None and bare.spec == ref.spec
        bare.close()


def test_requantize_command(tmp_path: Path, capsys) -> None:
    from helpers import LLAMA_F16

    from sangama_p2p.cli.make_cmds import REQUANT_PRESETS
    from sangama_p2p.model.gguf.mix import PRESETS
    from sangama_p2p.model.gguf.reader import GGUFFile

    assert REQUANT_PRESETS == tuple(PRESETS)
    out = tmp_path / "q.gguf"
    assert cli_main(["requantize", str(LLAMA_F16), str(out), "Q4_K_M"]) == 0
    printed = capsys.readouterr().out
    assert "GGUF Q4_K_M" in printed and "Q4_K 2, Q5_0 23, Q6_K 2, Q8_0 3" in printed
    assert GGUFFile(out).metadata["general.file_type"] == 15
    assert cli_main(["requantize", str(tmp_path / "missing.gguf"), str(out), "F16"]) != 0  # a typed error, no crash


def test_prompt_ids_need_no_supported_tokenizer(tmp_path: Path, capsys) -> None:
    """A GGUF whose tokenizer we cannot rebuild still runs from token ids; text prompts get the typed error."""
    import struct

    import pytest

    from sangama_p2p.errors import UnsupportedModelError

    assert cli_main(["make-model", str(tmp_path / "m"), "--arch", "llama", "--gguf", "F32"]) == 0
    path = tmp_path / "m" / "model-F32.gguf"
    key = struct.pack("<Q", 18) + b"tokenizer.ggml.pre" + struct.pack("<IQ", 8, 5)
    data = path.read_bytes()
    assert data.count(key + b"gpt-2") == 1
    path.write_bytes(data.replace(key + b"gpt-2", key + b"kimi2"))  # same length: nothing else moves
    with pytest.raises(UnsupportedModelError, match="pre-tokenizer 'kimi2'"):
        open_checkpoint(path)
    assert open_checkpoint(path, need_tokenizer=False).tokenizer is None
    capsys.readouterr()
    assert cli_main(["generate", "--local", str(path), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"]) == 0
    assert len(capsys.readouterr().out.split()) == 2  # the new ids, printed as numbers
    assert cli_main(["generate", "--local", str(path), "--prompt", "hello", "--max-new-tokens", "2"]) != 0
    assert "GGUF pre-tokenizer 'kimi2' is not supported (supported: " in capsys.readouterr().err
