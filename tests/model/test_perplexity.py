"""Perplexity as llama-perplexity computes it: the pure rules (model/perplexity.py) on hand-computed numbers, and the
command on a made model against transformers' logits for the same windows."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import transformers

from sangama_p2p.cli import main as cli_main
from sangama_p2p.errors import ModelError
from sangama_p2p.model.perplexity import PerplexityRun, chunk_starts, read_text, scored_rows, token_nll, window
from sangama_p2p.model.tokenizer import Tokenizer, corpus_text


def test_the_text_loses_one_trailing_newline_as_dash_f_reads_it() -> None:
    assert read_text(b"a b\n\n") == "a b\n"
    assert read_text(b"a b") == "a b"
    assert read_text("\u00e9\n".encode()) == "\u00e9"
    with pytest.raises(ModelError):
        read_text(b"\xff\xfe")


def test_the_second_half_of_each_chunk_is_scored() -> None:
    assert scored_rows(256) == (128, 127)
    assert scored_rows(5) == (2, 2)  # logits at 2, 3 predict tokens 3, 4
    assert scored_rows(3) == (1, 1)
    with pytest.raises(ModelError):
        scored_rows(2)


def test_chunks_are_whole_windows_and_need_two_of_them() -> None:
    assert chunk_starts(10, 4) == [0, 4]  # the 2 tokens left over are never read
    assert chunk_starts(40, 4, 3) == [0, 4, 8]
    assert chunk_starts(40, 4, None) == chunk_starts(40, 4, -1) == list(range(0, 40, 4))
    assert chunk_starts(8, 4, 99) == [0, 4]
    with pytest.raises(ModelError, match="at least 8 tokens"):
        chunk_starts(7, 4)


def test_a_window_starts_with_bos_only_when_the_model_adds_it() -> None:
    tokens = [7, 8, 9, 10, 11, 12]
    assert window(tokens, 3, 3, bos=1) == [1, 11, 12]
    assert window(tokens, 3, 3, bos=None) == [10, 11, 12]
    assert tokens == [7, 8, 9, 10, 11, 12]  # the text's tokens are left as they were (the targets)
    with pytest.raises(ModelError):
        window(tokens, 4, 3, bos=None)


def test_nll_of_a_known_tiny_logits_array() -> None:
    # softmax([ln 1, ln 2, ln 5]) = [1/8, 2/8, 5/8]; the row shifted by 1000 does not overflow (float32's step
    # at 1000 is 6e-5: within that)
    row = torch.tensor([math.log(1), math.log(2), math.log(5)], dtype=torch.float32)
    logits = torch.stack([row, row, row + 1000.0, torch.zeros(3)])
    nll = token_nll(logits, [2, 0, 1, 1])
    assert nll.dtype == torch.float64
    expect = [-math.log(5 / 8), -math.log(1 / 8), -math.log(2 / 8), math.log(3)]
    assert nll.tolist() == pytest.approx(expect, abs=1e-4)
    assert nll[[0, 1, 3]].tolist() == pytest.approx([expect[i] for i in (0, 1, 3)], rel=1e-6)
    with pytest.raises(ModelError):
        token_nll(logits, [0, 1])


def test_the_running_figure_and_the_final_estimate_are_llamacpps() -> None:
    run = PerplexityRun()
    assert run.add(torch.tensor([1.0, 2.0], dtype=torch.float64)) == pytest.approx(math.exp(1.5))
    assert run.add(torch.tensor([3.0], dtype=torch.float64)) == pytest.approx(math.exp(2.0))
    assert run.chunks == pytest.approx([math.exp(1.5), math.exp(2.0)])
    assert run.count == 3 and run.ppl == pytest.approx(math.exp(2.0))
    # mean(nll^2) - mean(nll)^2 = 14/3 - 4 = 2/3; error = ppl * sqrt((2/3) / (count - 1))
    assert run.ppl_error == pytest.approx(math.exp(2.0) * math.sqrt((2 / 3) / 2))
    doc = run.as_dict()
    assert doc["scored_tokens"] == 3 and doc["mean_nll"] == pytest.approx(2.0)


def test_the_command_equals_transformers_on_the_same_windows(tmp_path: Path, capsys) -> None:
    from sangama_p2p.model.make import make_model

    ckpt = make_model(tmp_path / "m", "llama", "tiny", seed=3)
    text = tmp_path / "text.txt"
    text.write_text(corpus_text()[:3000] + "\n")
    n_ctx, n_chunks = 24, 3
    assert cli_main.main(["perplexity", str(ckpt), "--text-file", str(text), "--ctx", str(n_ctx),
                          "--chunks", str(n_chunks), "--threads", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["chunks"] == n_chunks and doc["scored_tokens"] == n_chunks * (n_ctx - n_ctx // 2 - 1)

    tok = Tokenizer.from_dir(ckpt)
    ids = tok.backend.encode(corpus_text()[:3000], add_special_tokens=True).ids
    assert doc["tokens"] == len(ids) and doc["bos"] is None  # the made tokenizer adds no BOS
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    total, first = [], n_ctx // 2
    for c in range(n_chunks):
        w = torch.tensor(ids[c * n_ctx : (c + 1) * n_ctx])
        with torch.no_grad():
            logp = torch.log_softmax(model(w[None]).logits[0].double(), -1)
        total += [-float(logp[p, w[p + 1]]) for p in range(first, n_ctx - 1)]
        assert doc["chunk_ppl"][c] == pytest.approx(math.exp(sum(total) / len(total)), rel=1e-4)
    assert doc["ppl"] == pytest.approx(math.exp(sum(total) / len(total)), rel=1e-4)


def test_too_short_a_text_is_a_typed_error(tmp_path: Path, capsys) -> None:
    from sangama_p2p.model.make import make_model

    ckpt = make_model(tmp_path / "m", "llama", "tiny", seed=3)
    text = tmp_path / "short.txt"
    text.write_text("The river town woke before the sun.")
    assert cli_main.main(["perplexity", str(ckpt), "-f", str(text), "--ctx", "64"]) == 2
    assert "needs at least 128 tokens" in capsys.readouterr().err
