"""Regenerate ``tokenize_stress.json``: llama.cpp's own pieces and token ids for the stress texts.

    python tests/gguf/data/make_tokenize_refs.py --llama-cpp /path/to/llama.cpp [--work /tmp/tok] [--smollm2 FILE]
        [--spm-model tokenizer.model] [--retrain]

Needs a llama.cpp tree with ``build/bin/llama-tokenize`` and ``build/bin/libllama.so`` (a CPU build), g++, and
gguf-py. llama.cpp is the oracle only; nothing of it is stored here except its outputs:

- ``splits``: for every llama.cpp pre-tokenizer type, the pieces its regex list gives for each text. The regex lists
  and the name -> type table are read from ``src/llama-vocab.cpp``, and the pieces come from llama.cpp's
  ``unicode_regex_split`` (a 30-line C++ program linked against libllama, written to ``--work``).
- ``pre_ids``: ids from ``llama-tokenize`` (default options: BOS when the model adds one, special tokens parsed) for a
  small byte-level BPE vocabulary (``tokenize_vocabs.json``: trained here with no pre-split, so its merges cross
  every boundary a rule could put), written as one GGUF per pre-tokenizer name into ``--work``.
- ``bpe_variant_ids``: two flag cases of that vocabulary (see ``bpe_variant_fields``).
- ``spm_ids``: the same for a small SentencePiece vocabulary (``tokenizer.ggml.model = llama``; scores, byte
  fallback, a control and a user-defined marker) with llama.cpp's defaults and with the flags flipped.
- ``real_spm_ids``: the same for a real SentencePiece vocabulary when ``--spm-model`` names a ``tokenizer.model``
  (e.g. Mistral 7B v0.1's, shipped in the Apache-2.0 ``mistral-common`` wheel as ``data/tokenizer.model.v1``; needs
  the ``sentencepiece`` package). Its pieces, scores and types, read as llama.cpp's converter reads them, are stored
  in ``spm_real_vocab.json.gz``.
- ``file_ids``: the same for real files (SmolLM2's ``smollm``, the shared Llama and Qwen fixtures) when present.
Run it again after changing the texts or updating llama.cpp; the tests compare our tokenizer with these.
``--fuzz N`` writes nothing: it compares our tokenizer with ``llama-tokenize`` on N random texts per vocabulary
(the GGUF copies above, the SentencePiece ones, the real files) and prints every difference.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import json
import re
import struct
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2] / "src"))

STRESS = [
    "x  1 and  \n\n  y",
    "Hello world!",
    "  leading spaces and\ttabs\n\nnew lines  ",
    "Привет, мир! Ünïcödé façade naïve café",
    "日本語のテキストと中文混合 123456789 3.14159",
    "emoji 🤖🚀 👩\u200d👩\u200d👧 and combining e\u0301 (NFC) and ﬁ ligature",
    "<|im_start|>user\nWhat's 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "code: def f(x):\n    return x**2  # don't\r\n",
    "\tif (a<=b && c!=d) {\n\t\treturn a->b;\n\t}\n",
    "I'LL  they'RE 's 'll 'S 'Ve we'd can't",
    "trailing   \n\n",
    "numbers 1234567890 12,345.67 0.000001 1e-9 ½ ² ٣٤٥",
    "3141592653589793238462643383279",
    "     ",
    "\n\n\n",
    "a\u00a0b\u3000c\u2003d\u200be",
    "한국어 텍스트와 ひらがな カタカナ 漢字",
    "Ελληνικά και عربي и עברית हिन्दी",
    "$100 + 5% = <tag> ~^|` @user #hash",
    "...!!!???—–“quotes” «guillemets» ‘single’",
    "CamelCaseWord HTTPServer iPhone XMLHttpRequest",
    "line1\r\nline2\rline3\n",
    "mixed\u00a0\n \u3000\n  end",
    "<s>hello</s> <|endoftext|> world",
    "über-naïve ÀÉÎÕÜ àéîõü ßẞ ǅ",
    "a  b   c    d\t\te",
    "<sentinel:12> IMGIMGABCZ",
]
# the brief's pre-tokenizer names, plus one name of every other type (the GGUF copies for pre_ids)
PRE_NAMES = ["gpt-2", "llama-bpe", "smollm", "qwen2", "qwen35", "deepseek-llm", "deepseek-v3", "falcon", "starcoder",
             "refact", "command-r", "olmo", "default"]
# llama.cpp names whose splitting is hand-written C++ with no regex equivalent in our tokenizer (left out here)
NOT_SUPPORTED = {"afmoe", "cohere2moe", "kimi-k2", "superbpe", "tiny_aya"}
CONTROL, USER_DEFINED, UNKNOWN, BYTE, NORMAL = 3, 4, 2, 6, 1
ORACLE_CPP = r"""
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
std::vector<std::string> unicode_regex_split(const std::string &, const std::vector<std::string> &, bool);
static std::string rd() { uint32_t n = 0; if (fread(&n, 4, 1, stdin) != 1) return ""; std::string s(n, '\0');
    if (n && fread(&s[0], 1, n, stdin) != n) return ""; return s; }
static void wr(const std::string & s) {
    uint32_t n = s.size(); fwrite(&n, 4, 1, stdout); fwrite(s.data(), 1, n, stdout); }
int main() {
    uint32_t nr = 0, nt = 0;
    if (fread(&nr, 4, 1, stdin) != 1) return 1;
    std::vector<std::string> rx;
    for (uint32_t i = 0; i < nr; ++i) rx.push_back(rd());
    if (fread(&nt, 4, 1, stdin) != 1) return 1;
    for (uint32_t i = 0; i < nt; ++i) {
        auto parts = unicode_regex_split(rd(), rx, false);
        uint32_t np = parts.size(); fwrite(&np, 4, 1, stdout);
        for (auto & p : parts) wr(p);
    }
    return 0;
}
"""


def _c_strings(line: str) -> list[str]:
    out, pos = [], 0
    while m := re.compile(r'\s*"((?:[^"\\]|\\.)*)"\s*,?').match(line, pos):
        out.append(ast.literal_eval('"' + m.group(1) + '"'))
        pos = m.end()
    return out


def llama_cpp_rules(vocab_cpp: str) -> tuple[dict[str, list[str]], dict[str, dict]]:
    """(pre type -> regex list, for byte-encoding types only; name -> {type, ignore_merges, add_bos})."""
    ctor = vocab_cpp[vocab_cpp.index("llm_tokenizer_bpe(const llama_vocab & vocab)"):]
    ctor = ctor[: ctor.index("std::vector<std::string> regex_exprs;")]
    types: dict[str, list[str]] = {}
    pending: list[str] = []
    lines = iter(ctor.splitlines())
    for line in lines:
        s = line.strip()
        if m := re.match(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", s):
            pending.append(m.group(1))
        elif s.startswith("default:"):
            pending.append("DEFAULT")
        elif s.startswith("regex_exprs = {"):
            regexes = []
            for body in lines:
                if body.strip() == "};":
                    break
                if not body.strip().startswith("//"):
                    regexes += _c_strings(body)
            for t in pending:
                types[t] = regexes
        elif s.startswith("byte_encode = false"):
            for t in pending:
                types.pop(t, None)
        elif s == "break;":
            pending = []
    load = vocab_cpp[vocab_cpp.index("if (tokenizer_pre.empty())"):]
    load = load[: load.index("} else if (type == LLAMA_VOCAB_TYPE_SPM)")]
    names: dict[str, dict] = {}
    found: list[str] = []
    group: list[str] = []
    events = r'tokenizer_pre == "([^"]+)"|pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);|(ignore_merges|add_bos) = true'
    for m in re.finditer(events, load):
        if m.group(1):
            found.append(m.group(1))
        elif m.group(2):
            group, found = found, []
            for n in group:
                names[n] = {"type": m.group(2), "ignore_merges": False, "add_bos": False}
        else:
            for n in group:
                names[n][m.group(3)] = True
    return types, names


def oracle_splits(exe: Path, regexes: list[str], texts: list[str]) -> list[list[str]]:
    def blob(s: str) -> bytes:
        b = s.encode()
        return struct.pack("<I", len(b)) + b

    data = struct.pack("<I", len(regexes)) + b"".join(map(blob, regexes))
    data += struct.pack("<I", len(texts)) + b"".join(map(blob, texts))
    out = subprocess.run([str(exe)], input=data, capture_output=True, check=True).stdout
    pos, result = 0, []
    for _ in texts:
        (n,), pos = struct.unpack_from("<I", out, pos), pos + 4
        parts = []
        for _ in range(n):
            (k,), pos = struct.unpack_from("<I", out, pos), pos + 4
            parts.append(out[pos : pos + k].decode())
            pos += k
        result.append(parts)
    return result


def train_vocabs() -> dict:
    """A byte-level BPE (no pre-split: merges cross spaces, digits and scripts) and a SentencePiece-style vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from sangama_p2p.model.tokenizer import corpus_text

    corpus = [corpus_text(), *STRESS[::2]]  # half the texts: some pieces are known words, some are not
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1500, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], max_token_length=8)
    bpe.train_from_iterator(corpus, trainer=trainer)
    j = json.loads(bpe.to_str())
    tokens = [t for t, _ in sorted(j["model"]["vocab"].items(), key=lambda kv: kv[1])] + ["<think>"]
    types = [CONTROL if t.startswith("<|") else NORMAL for t in tokens[:-1]] + [USER_DEFINED]
    merges = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]

    spm = Tokenizer(models.BPE())
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=700, show_progress=False, limit_alphabet=90)
    spm.train_from_iterator(corpus, trainer=trainer)
    sj = json.loads(spm.to_str())
    alphabet = [t for t in sj["model"]["vocab"] if len(t) == 1]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in sj["model"]["merges"]]
    pieces = list(dict.fromkeys(["\u2581\u2581", "\u2581\u2581\u2581\u2581", *merged]))
    spm_tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    spm_types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256
    spm_scores = [0.0] * len(spm_tokens)
    for i, p in enumerate(pieces):
        spm_tokens.append(p), spm_types.append(NORMAL), spm_scores.append(-float(i))
    for i, c in enumerate(a for a in alphabet if a not in spm_tokens):
        spm_tokens.append(c), spm_types.append(NORMAL), spm_scores.append(-1e4 - i)
    spm_tokens += ["<|im_start|>", "<|im_end|>"]
    spm_types += [USER_DEFINED, CONTROL]
    spm_scores += [0.0, 0.0]
    return {"bpe": {"tokens": tokens, "token_type": types, "merges": merges},
            "spm": {"tokens": spm_tokens, "token_type": spm_types, "scores": spm_scores}}


def write_gguf(path: Path, fields: dict) -> None:
    """A vocabulary-only llama GGUF (no tensors; llama-tokenize loads vocab_only)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for key, value in (("block_count", 1), ("context_length", 256), ("embedding_length", 8),
                       ("feed_forward_length", 16), ("attention.head_count", 1), ("attention.head_count_kv", 1),
                       ("rope.dimension_count", 8)):
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_float32("llama.rope.freq_base", 10000.0)
    w.add_uint32("llama.vocab_size", len(fields["tokenizer.ggml.tokens"]))
    for key, value in fields.items():
        if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"):
            w.add_array(key, value)
        elif key == "tokenizer.ggml.token_type":
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
        elif key == "tokenizer.ggml.scores":
            w.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.FLOAT32)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_string(key, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def bpe_fields(vocabs: dict, pre: str) -> dict:
    v = vocabs["bpe"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": v["tokens"],
            "tokenizer.ggml.token_type": v["token_type"], "tokenizer.ggml.merges": v["merges"],
            "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 0}


def bpe_variant_fields(vocabs: dict, variant: str) -> dict:
    """Flag cases: <|im_end|> stored as a NORMAL token (llama.cpp forces end-of-generation names to control), and
    BOS plus EOS (EOS is <|im_end|>, id 2)."""
    if variant == "gpt-2/im_end-normal":
        fields = bpe_fields(vocabs, "gpt-2")
        types = list(fields["tokenizer.ggml.token_type"])
        types[vocabs["bpe"]["tokens"].index("<|im_end|>")] = NORMAL
        return {**fields, "tokenizer.ggml.token_type": types}
    if variant == "llama-bpe/bos-eos":
        return {**bpe_fields(vocabs, "llama-bpe"), "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.add_eos_token": True}
    raise KeyError(variant)


BPE_VARIANTS = ("gpt-2/im_end-normal", "llama-bpe/bos-eos")


SPM_VARIANTS = {  # name -> extra fields
    "defaults": {},
    "no_prefix_bos_eos": {"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": True,
                          "tokenizer.ggml.add_eos_token": True},
    "no_bos": {"tokenizer.ggml.add_bos_token": False},
}


def spm_fields(vocabs: dict, variant: str) -> dict:
    v = vocabs["spm"]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": v["tokens"], "tokenizer.ggml.scores": v["scores"],
            "tokenizer.ggml.token_type": v["token_type"], "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.unknown_token_id": 0, **SPM_VARIANTS[variant]}


def real_spm_vocab(model: Path) -> dict:
    """Pieces, scores and types of a SentencePiece model, as llama.cpp's converter (``_create_vocab_sentencepiece``)."""
    from sentencepiece import SentencePieceProcessor

    sp = SentencePieceProcessor()
    sp.LoadFromFile(str(model))
    tokens, scores, types = [], [], []
    for i in range(sp.vocab_size()):
        tokens.append(sp.IdToPiece(i))
        scores.append(sp.GetScore(i))
        types.append(UNKNOWN if sp.IsUnknown(i) else CONTROL if sp.IsControl(i) else 5 if sp.IsUnused(i)
                     else BYTE if sp.IsByte(i) else NORMAL)
    return {"source": model.name, "tokens": tokens, "scores": scores, "token_type": types}


def llama_tokenize(exe: Path, model: Path, text: str, work: Path) -> list[int]:
    prompt = work / "prompt.txt"
    prompt.write_bytes(text.encode())
    out = subprocess.run([str(exe), "-m", str(model), "-f", str(prompt), "--ids", "--log-disable", "--no-escape"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def dump(obj, indent: str = "") -> str:
    """JSON with one line per innermost list (a text's ids or pieces), so that diffs stay readable."""
    inner = indent + " "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(k)}: {dump(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}" if items else "{}"
    if isinstance(obj, list) and any(isinstance(v, (list, dict)) for v in obj):
        return "[\n" + ",\n".join(inner + dump(v, inner) for v in obj) + "\n" + indent + "]"
    return json.dumps(obj, ensure_ascii=False)


FUZZ_ALPHABET = [*" \t\n\r  ab'sSLlXyZ09123456789.,;:!?-_()[]{}<>$%^|~`@#\"/\\", *"éüßÀΩжλ日本語中文한국ひカ٣½²🤖👩",
                 "\u200d", "\u0301", "\u00a0", "\u3000", "\u2003", "\u200b", "'s", "'LL", "<|im_start|>", "<|im_end|>",
                 "<s>", "</s>", "  ", "\n\n", "1234"]


def fuzz(n: int, work: Path, tokenize: Path, cases: dict[str, tuple[Path, dict | None]]) -> int:
    """Differences between our tokenizer and llama-tokenize on ``n`` random texts per case (seed 0)."""
    import random

    from sangama_p2p.model.gguf.reader import read_metadata
    from sangama_p2p.model.gguf.tokenizer import tokenizer_from_gguf, tokenizer_from_metadata

    rng, bad = random.Random(0), 0
    for name, (path, fields) in cases.items():
        tok = tokenizer_from_gguf(read_metadata(path)) if fields is None else tokenizer_from_metadata(fields)
        for _ in range(n):
            text = "".join(rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 40)))
            ours, theirs = tok.encode(text).ids, llama_tokenize(tokenize, path, text, work)
            if ours != theirs:
                bad += 1
                print(f"DIFF {name} {text!r}: ours {ours} llama.cpp {theirs}")
    print(f"fuzz: {bad} differences in {n * len(cases)} texts over {len(cases)} vocabularies")
    return bad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/sangama-tok"))
    ap.add_argument("--smollm2", type=Path, default=Path.home() / ".cache/sangama-test/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--fuzz", type=int, default=0, metavar="N", help="only compare on N random texts per vocabulary")
    ap.add_argument("--retrain", action="store_true", help="train new small vocabularies (tokenize_vocabs.json)")
    ap.add_argument("--spm-model", type=Path, default=None, help="a real SentencePiece tokenizer.model")
    ap.add_argument("--fixtures", type=Path, default=Path("/work/shared/fixtures/gguf"))
    args = ap.parse_args()
    bin_dir = args.llama_cpp / "build" / "bin"
    args.work.mkdir(parents=True, exist_ok=True)
    exe = args.work / "split_oracle"
    (args.work / "split_oracle.cpp").write_text(ORACLE_CPP)
    subprocess.run(["g++", "-O1", "-o", str(exe), str(args.work / "split_oracle.cpp"), f"-L{bin_dir}", "-lllama",
                    f"-Wl,-rpath,{bin_dir}"], check=True)
    if args.fuzz:
        vocabs = json.loads((HERE / "tokenize_vocabs.json").read_text(encoding="utf-8"))
        cases: dict[str, tuple[Path, dict | None]] = {}
        for pre in PRE_NAMES:
            cases[pre] = (args.work / f"bpe-{pre}.gguf", bpe_fields(vocabs, pre))
            write_gguf(cases[pre][0], cases[pre][1])
        for variant in SPM_VARIANTS:
            cases[f"spm-{variant}"] = (args.work / f"spm-{variant}.gguf", spm_fields(vocabs, variant))
            write_gguf(*cases[f"spm-{variant}"])
        for p in (args.smollm2, args.fixtures / "llama-h32/tiny-llama-F16.gguf",
                  args.fixtures / "qwen35moe-h16/tiny-qwen35moe-F32.gguf"):
            if p.is_file():
                cases[p.name] = (p, None)
        sys.exit(1 if fuzz(args.fuzz, args.work, bin_dir / "llama-tokenize", cases) else 0)
    types, names = llama_cpp_rules((args.llama_cpp / "src" / "llama-vocab.cpp").read_text())
    names = {n: v for n, v in names.items() if v["type"] in types}
    used = {v["type"] for n, v in names.items() if n not in NOT_SUPPORTED}
    splits = {t: oracle_splits(exe, rx, STRESS) for t, rx in sorted(types.items()) if t in used}
    vocab_file = HERE / "tokenize_vocabs.json"
    if args.retrain or not vocab_file.is_file():  # training is not bit-reproducible (tie order): keep the stored one
        vocab_file.write_text(json.dumps(train_vocabs(), ensure_ascii=False) + "\n", encoding="utf-8")
    vocabs = json.loads(vocab_file.read_text(encoding="utf-8"))
    tokenize = bin_dir / "llama-tokenize"
    one_per_type = {v["type"]: n for n, v in sorted(names.items(), reverse=True) if n not in NOT_SUPPORTED}
    pre_ids = {}
    for pre in dict.fromkeys(PRE_NAMES + sorted(one_per_type.values())):
        path = args.work / f"bpe-{pre}.gguf"
        write_gguf(path, bpe_fields(vocabs, pre))
        pre_ids[pre] = [llama_tokenize(tokenize, path, s, args.work) for s in STRESS]
    bpe_variant_ids = {}
    for variant in BPE_VARIANTS:
        path = args.work / f"bpe-{variant.replace('/', '-')}.gguf"
        write_gguf(path, bpe_variant_fields(vocabs, variant))
        bpe_variant_ids[variant] = [llama_tokenize(tokenize, path, s, args.work) for s in STRESS]
    spm_ids = {}
    for variant in SPM_VARIANTS:
        path = args.work / f"spm-{variant}.gguf"
        write_gguf(path, spm_fields(vocabs, variant))
        spm_ids[variant] = [llama_tokenize(tokenize, path, s, args.work) for s in STRESS]
    real_spm_ids = {}
    if args.spm_model is not None:
        real = real_spm_vocab(args.spm_model)
        blob = json.dumps(real, ensure_ascii=False).encode()
        (HERE / "spm_real_vocab.json.gz").write_bytes(gzip.compress(blob, mtime=0))  # byte-reproducible
        path = args.work / "spm-real.gguf"
        write_gguf(path, spm_fields({"spm": real}, "defaults"))
        real_spm_ids = {"source": real["source"], "ids": [llama_tokenize(tokenize, path, s, args.work) for s in STRESS]}
    files = {"smollm2": args.smollm2, "llama-h32": args.fixtures / "llama-h32/tiny-llama-F16.gguf",
             "qwen35moe-h16": args.fixtures / "qwen35moe-h16/tiny-qwen35moe-F32.gguf"}
    file_ids = {k: {"file": p.name, "ids": [llama_tokenize(tokenize, p, s, args.work) for s in STRESS]}
                for k, p in files.items() if p.is_file()}
    commit = subprocess.run(["git", "-C", str(args.llama_cpp), "rev-parse", "HEAD"], capture_output=True, text=True)
    out = {"llama_cpp_commit": commit.stdout.strip() or "unknown", "texts": STRESS, "names": names, "splits": splits,
           "pre_ids": pre_ids, "bpe_variant_ids": bpe_variant_ids, "spm_ids": spm_ids, "real_spm_ids": real_spm_ids, "file_ids": file_ids}
    (HERE / "tokenize_stress.json").write_text(dump(out) + "\n", encoding="utf-8")
    print(f"{len(STRESS)} texts, {len(splits)} pre types, {len(names)} names, {len(pre_ids)} GGUF copies, "
          f"{len(spm_ids)} SPM variants, files: {', '.join(file_ids)}")


if __name__ == "__main__":
    main()
