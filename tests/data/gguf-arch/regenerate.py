"""Regenerate the GGUF files in this folder with llama.cpp's own converter (see README.md for the provenance).

    PYTHONPATH=src python tests/data/gguf-arch/regenerate.py /path/to/llama.cpp [EXTRA_SITE_DIR]

The converter needs torch, numpy, safetensors and transformers (for ``AutoTokenizer``), and ``sentencepiece``: its
Llama path imports it before looking for a ``tokenizer.model``. ``EXTRA_SITE_DIR`` (e.g. made with
``pip install --target DIR sentencepiece``) is put on the converter subprocess's ``PYTHONPATH`` only.

For every case below: ``make_model`` writes the micro checkpoint (seed 0), transformers' greedy continuation of
``PROMPT`` is recorded, and ``convert_hf_to_gguf.py`` turns the checkpoint into ``<case>-F32.gguf`` and
``<case>-Q8_0.gguf``. The converter runs in a subprocess with the gguf-py of the same llama.cpp tree (it puts
``<llama.cpp>/gguf-py`` first on ``sys.path`` itself).

Pre-tokenizer: the converter identifies a BPE tokenizer by the sha256 of its token ids for a fixed text and refuses
hashes it does not list. make-model's tokenizer is a byte-level BPE trained on the project's own corpus with GPT-2's
pre-tokenizer (``ByteLevel(use_regex=True)``), so its hash is new, while its pre-tokenizer is exactly llama.cpp's
``gpt-2`` rule. The runner below adds that one entry, ``MADE_TOKENIZER_HASH -> "gpt-2"``, the entry
``convert_hf_to_gguf_update.py`` would generate, at run time instead of editing llama.cpp's file; every other hash
goes through the converter's own table unchanged.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPT = [5, 17, 42, 99, 3, 250, 7, 11]
NEW_TOKENS = 16
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}
# case -> (arch, make_model options)
CASES = {
    "llama": ("llama", {}),
    "llama-tied-llama3": ("llama", {"tie_word_embeddings": True, "rope_scaling": LLAMA3}),
    "llama-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3_moe": ("qwen3_moe", {}),
}
TYPES = ("f32", "q8_0")
# sha256 of make-model's tokenizer's ids for the converter's check text (the same for every micro checkpoint: one
# vocabulary of 384); the runner maps this one hash to llama.cpp's "gpt-2" pre-tokenizer
MADE_TOKENIZER_HASH = "d92287f617621d53ece1347e73cdf4a5c64c74af6f2dfaf0bc3d731555bb336b"

_RUNNER = r'''
import runpy, sys
from hashlib import sha256
llama_cpp, made_hash = sys.argv[1], sys.argv[2]
sys.path.insert(0, llama_cpp)
from conversion import base
_own = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    chktxt = _CHKTXT
    if sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest() == made_hash:
        return "gpt-2"
    return _own(self, tokenizer)
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
sys.argv = [llama_cpp + "/convert_hf_to_gguf.py"] + sys.argv[3:]
runpy.run_path(sys.argv[0], run_name="__main__")
'''


def chktxt(llama_cpp: Path) -> str:
    """The converter's own hash text, read from its source (so that the hash is the one it computes)."""
    src = (llama_cpp / "conversion" / "base.py").read_text(encoding="utf-8")
    line = next(ln for ln in src.splitlines() if ln.strip().startswith("chktxt = "))
    return eval(line.split("=", 1)[1].strip())  # a string literal


def made_hash(model_dir: Path, text: str) -> str:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return hashlib.sha256(str(tok.encode(text)).encode()).hexdigest()


def greedy(model_dir: Path) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(PROMPT):].tolist()


def main(llama_cpp: Path, extra_site: str | None) -> None:
    import os

    from sangama_p2p.model.make import make_model

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (extra_site, env.get("PYTHONPATH")) if p)
    text = chktxt(llama_cpp)
    refs: dict[str, dict] = {}
    runner = _RUNNER.replace("_CHKTXT", repr(text))
    with tempfile.TemporaryDirectory() as tmp:
        for case, (arch, opts) in CASES.items():
            model_dir = make_model(Path(tmp) / case, arch, "micro", seed=0, **opts)
            h = made_hash(model_dir, text)
            if h != MADE_TOKENIZER_HASH:
                raise SystemExit(f"make-model's tokenizer changed (hash {h}); check its pre-tokenizer, then re-pin")
            safetensors_sha = hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()
            refs[case] = {"arch": arch, "preset": "micro", "seed": 0, "options": opts, "prompt_ids": PROMPT,
                          "transformers_greedy": greedy(model_dir), "safetensors_sha256": safetensors_sha,
                          "tokenizer_hash": h, "files": {}}
            for outtype in TYPES:
                out = HERE / f"{case}-{outtype.upper()}.gguf"
                cmd = [sys.executable, "-c", runner, str(llama_cpp), h, str(model_dir), "--outtype", outtype,
                       "--outfile", str(out)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"converter failed for {case} {outtype}:\n{done.stderr[-4000:]}")
                refs[case]["files"][out.name] = hashlib.sha256(out.read_bytes()).hexdigest()
                print(f"{out.name}  {out.stat().st_size:,} bytes")
    (HERE / "refs.json").write_text(json.dumps(refs, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve(), sys.argv[2] if len(sys.argv) > 2 else None)
