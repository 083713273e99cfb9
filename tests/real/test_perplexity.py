"""``sangama-peer perplexity`` on the real SmolLM2-135M-Instruct files: a finite figure equal to a direct
computation over the same windows, and llama-perplexity's own on the same text (``data/perplexity.llamacpp.json``:
its figures for the first 1,200 characters of the package's corpus.txt, ``-c 128``, 2 chunks, made with
``benchmarks/perplexity.py``'s llama.cpp build; each file's sha256 is checked).

Tolerances, as measured: F16 0.006% (34.9891 against 34.9908; chunk 1 0.008%): the method is llama.cpp's. Q4_1
-1.3% (34.9629 against 35.4283; chunk 1, 63 tokens, -2.0%): llama.cpp quantizes the activations to 8 bits inside
its Q4_1 and Q8_0 products, which moves its Q4_1 figure 1.25% off its own F16 one, where ours is 0.07% off ours
(over the benchmark's 1,143 scored tokens the Q4_1 gap is -0.50%: docs/benchmarks.md, "Perplexity").
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
import torch

from sangama_p2p.cli import main as cli_main
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel, StepInput
from sangama_p2p.model.tokenizer import corpus_text

REF = json.loads((Path(__file__).parent / "data" / "perplexity.llamacpp.json").read_text())
TOLERANCE = {"F16": 1e-3, "Q4_1": 0.025}  # relative, per chunk and final (measured above)


def _file(smollm2_gguf: Path, label: str) -> Path:
    path = smollm2_gguf if label == "Q4_1" else smollm2_gguf.with_name(f"SmolLM2-135M-Instruct.{label}.gguf")
    if not path.is_file():
        pytest.skip(f"{path} is absent (tests/real/test_smollm2.py makes it from the Q4_1 file)")
    if hashlib.sha256(path.read_bytes()).hexdigest() != REF["files"][label]["sha256"]:
        pytest.skip(f"{path.name} is not the file the references were made on")
    return path


@pytest.mark.parametrize("label", ["Q4_1", "F16"])
def test_perplexity_is_the_direct_computation_and_llamacpps(smollm2_gguf: Path, tmp_path: Path, capsys,
                                                            label: str) -> None:
    gguf = _file(smollm2_gguf, label)
    ref = REF["files"][label]
    text = corpus_text()[: REF["text_chars"]]
    path = tmp_path / "text.txt"
    path.write_text(text)
    n_ctx, n_chunks = REF["ctx"], REF["chunks"]
    assert cli_main.main(["perplexity", str(gguf), "-f", str(path), "--ctx", str(n_ctx), "--chunks",
                          str(n_chunks), "--threads", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == REF["tokens"] and doc["bos"] is None  # SmolLM2's GGUF adds no BOS
    assert math.isfinite(doc["ppl"]) and 1.0 < doc["ppl"] < 1000.0

    # direct: one prefill per window, the stage's own logits (the head as generate computes it), log_softmax in fp64
    ckpt = open_checkpoint(gguf)
    ids = ckpt.tokenizer.encode(text)
    stage = StageModel.load(ckpt.spec, ckpt.source, 0, ckpt.spec.num_layers)
    nll = []
    for c in range(n_chunks):
        w = ids[c * n_ctx : (c + 1) * n_ctx]
        x = stage.forward([StepInput(stage.new_session(n_ctx), 0, tokens=torch.tensor(w))])
        logp = torch.log_softmax(stage.logits(x).double(), -1)
        nll += [-float(logp[p, w[p + 1]]) for p in range(n_ctx // 2, n_ctx - 1)]
    assert doc["scored_tokens"] == len(nll)
    assert doc["ppl"] == pytest.approx(math.exp(sum(nll) / len(nll)), rel=2e-3)

    for ours, theirs in zip(doc["chunk_ppl"], ref["chunk_ppl"], strict=True):
        assert ours == pytest.approx(theirs, rel=TOLERANCE[label])
    assert doc["ppl"] == pytest.approx(ref["ppl"], rel=TOLERANCE[label])
