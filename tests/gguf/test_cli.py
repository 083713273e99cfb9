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
