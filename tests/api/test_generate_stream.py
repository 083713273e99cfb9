"""``generate`` streams its tokens (``--local`` and over the swarm) and keeps what it produced when the chain fails."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from sangama_p2p.cli.main import main
from sangama_p2p.model.emit import TokenPrinter


class Writes(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, s: str) -> int:
        self.writes.append(s)
        return super().write(s)


def test_token_printer_writes_each_token_as_it_comes(local):
    tok = local.tokenizer
    ids = tok.encode("Streaming héllo wörld, token by token")
    out = Writes()
    printer = TokenPrinter(tok, "text", out)
    for i in ids:
        before = len(out.writes)
        printer.push([i])
        assert len(out.writes) <= before + 1
    assert len(out.writes) > len(ids) // 2  # most tokens showed at once (a split character waits for its rest)
    printer.done({})
    assert out.getvalue() == tok.decode(ids) + "\n"
    lines = Writes()
    printer = TokenPrinter(tok, "jsonl", lines)
    printer.push(ids[:3])
    printer.fail(RuntimeError("stage gone"))
    docs = [json.loads(line) for line in lines.getvalue().splitlines()]
    assert [d["token"] for d in docs[:3]] == ids[:3]
    assert docs[-1] == {"done": False, "tokens": ids[:3], "text": tok.decode(ids[:3]), "error": "stage gone"}
    plain = io.StringIO()
    printer = TokenPrinter(None, "text", plain)
    printer.push([5, 6])
    printer.push([7])
    printer.done({})
    assert plain.getvalue() == "5 6 7\n"


def test_generate_local_streams_json_lines_and_keeps_its_text(model_dir, local, capsys):
    from sangama_p2p.model.sampling import SamplingParams

    want = local.generate(local.tokenizer.encode("Once upon"), 10, SamplingParams()).tokens
    assert main(["generate", "--local", str(model_dir), "--prompt", "Once upon", "--max-new-tokens", "10",
                 "--jsonl", "--threads", "1"]) == 0
    docs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [d["token"] for d in docs[:-1]] == want and docs[-1]["done"] and docs[-1]["tokens"] == want
    assert "".join(d["text"] for d in docs[:-1]) == docs[-1]["text"] == local.tokenizer.decode(want)
    assert main(["generate", "--local", str(model_dir), "--prompt", "Once upon", "--max-new-tokens", "10",
                 "--threads", "1"]) == 0
    assert capsys.readouterr().out == local.tokenizer.decode(want) + "\n"
    assert main(["generate", "--local", str(model_dir), "--prompt", "Once upon", "--max-new-tokens", "10",
                 "--json", "--threads", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["tokens"] == want


@pytest.mark.slow
def test_generate_over_the_swarm_streams_and_keeps_partial_output(model_dir, tmp_path, local):
    """A stage killed mid-generation with no spare: the lines printed so far stay, then the error, exit code 2."""
    from sangama_p2p.cli.local_fleet import LocalFleet
    from sangama_p2p.model.sampling import SamplingParams

    ids = local.tokenizer.encode("Partial output")
    want = local.generate(ids, 40, SamplingParams(), stop_at_eos=False).tokens
    with LocalFleet(model_dir, ["0:4", "4:8"], tmp_path, join_args=["--batch-invariant"]) as fleet:
        cmd = [sys.executable, "-m", "sangama_p2p.cli.main", "generate", "--model", str(model_dir), "--bootstrap",
               fleet.bootstrap_addr, "--prompt", "Partial output", "--max-new-tokens", "40", "--ignore-eos"]
        whole = subprocess.run([*cmd, "--max-new-tokens", "8"], capture_output=True, text=True, timeout=60)
        assert whole.returncode == 0, whole.stderr
        assert whole.stdout == local.tokenizer.decode(want[:8]) + "\n"
        proc = subprocess.Popen([*cmd, "--jsonl"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            lines = [proc.stdout.readline() for _ in range(3)]  # 3 tokens arrived while the rest is not made yet
            fleet.children[2].proc.kill()  # the last stage: no spare
            rest = proc.stdout.read()
            err = proc.stderr.read()
            assert proc.wait(timeout=60) == 2
        finally:
            proc.kill()
    docs = [json.loads(line) for line in lines + rest.splitlines()]
    tokens = [d["token"] for d in docs if "token" in d]
    assert 3 <= len(tokens) < 40 and tokens == want[:len(tokens)]
    assert docs[-1]["done"] is False and docs[-1]["tokens"] == tokens and docs[-1]["error"]
    assert "sangama-peer: error:" in err
