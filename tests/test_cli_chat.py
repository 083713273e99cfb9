"""``sangama-peer chat`` over a two-stage fleet of a tiny Llama (in-process ``ThreadFleet``), driven through stdin.

Each answer's prompt ids are the checkpoint's chat template rendered over the conversation so far (``--system``
first); ``/reset`` starts over; a turn the swarm refuses is printed and the conversation goes on without it; a long
conversation drops its oldest turns (said once); a model without a template gets plain lines (said once).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sangama_p2p.model.chat import load_chat_template, render_chat
from sangama_p2p.model.fingerprint import checkpoint_identity
from sangama_p2p.model.tokenizer import Tokenizer

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SYSTEM = "You are a tiny model."


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose tokenizer_config.json carries a ChatML template (its tokenizer has the markers)."""
    from sangama_p2p.model.make import make_model

    path = make_model(tmp_path_factory.mktemp("chat") / "chat-llama", "llama", "tiny")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps(dict(config, chat_template=CHATML)))
    return path


@pytest.fixture(scope="module")
def fleet(model: Path, tmp_path_factory: pytest.TempPathFactory):
    from sangama_p2p.cli.local_fleet import ThreadFleet

    with ThreadFleet(model, [(0, 3), (3, 6)], tmp_path_factory.mktemp("fleet")) as f:
        yield model, f


def chat(fleet, *args: str, lines: list[str]) -> subprocess.CompletedProcess:
    model, f = fleet
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "chat", "--bootstrap", f.bootstrap_addr,
                           "--json", "--max-new-tokens", "4", *args], input="".join(x + "\n" for x in lines),
                          capture_output=True, text=True, env=env, timeout=180)


def test_template_reset_and_a_refused_turn(fleet) -> None:
    model, _ = fleet
    tok = Tokenizer.from_dir(model)
    template = load_chat_template(model)
    long_line = "hello " * 1000
    assert 2048 < len(tok.encode(long_line)) < 4000  # more positions than the stages hold (the model's 2048)
    # --context 4096 is the user's word against the swarm's: the stages refuse the long turn with CAPACITY
    out = chat(fleet, "--model", str(model), "--system", SYSTEM, "--context", "4096",
               lines=["hello", long_line, "again", "/reset", "once more"])
    assert out.returncode == 0, out.stderr[-3000:]
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == 4, out.stdout
    first, refused, second, third = answers
    assert "positions on every stage" in refused["error"] and "max_length must be in 1..2048" in refused["error"]
    assert f"error: {refused['error']}" in out.stderr and "(conversation reset)" in out.stderr
    assert "note:" not in out.stderr  # the model has a template: no fallback note
    history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}]
    assert first["prompt_ids"] == list(render_chat(template, tok, history).ids)
    assert 0 < len(first["tokens"]) <= 4 and first["dropped"] == 0
    # the refused question is not part of the conversation; the answer is
    history += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "again"}]
    assert second["prompt_ids"] == list(render_chat(template, tok, history).ids)
    assert tok.decode(second["prompt_ids"]).startswith(tok.decode(first["prompt_ids"]) + first["text"] + "<|im_end|>")
    reset = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "once more"}]
    assert third["prompt_ids"] == list(render_chat(template, tok, reset).ids)
    im_end = tok.token_id("<|im_end|>")
    assert im_end not in first["tokens"][:-1] and first["text"] == tok.decode(
        first["tokens"][:-1] if first["tokens"][-1] in (im_end, *tok.eos_token_ids) else first["tokens"])


def test_a_long_conversation_drops_its_oldest_turns_and_plain_lines_are_said_once(fleet, tmp_path: Path) -> None:
    model, _ = fleet
    bare = tmp_path / "tokenizer-only"  # the same tokenizer, no chat template
    bare.mkdir()
    shutil.copy(model / "tokenizer.json", bare / "tokenizer.json")
    lines = [f"question {i}: " + "tell me more about the model " * 4 for i in range(6)]
    ident = checkpoint_identity(model)  # a bare id is pinned by hand (a public swarm refuses it otherwise)
    out = chat(fleet, "--model", model.name, "--tokenizer", str(bare), "--context", "120",
               "--fingerprint", f"{ident.fingerprint}:{ident.num_layers}", lines=lines)
    assert out.returncode == 0, out.stderr[-3000:]
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == 6 and all("error" not in a for a in answers), out.stdout
    budget = 120 - (4 + 8 + 1)  # --context minus the answer's reserve (new tokens + most guesses + 1)
    assert all(len(a["prompt_ids"]) <= budget for a in answers)
    assert answers[0]["dropped"] == 0 and sum(a["dropped"] for a in answers) > 0
    assert out.stderr.count("the oldest turns are dropped") == 1
    assert out.stderr.count("has no chat template") == 1
    tok = Tokenizer.from_dir(bare)
    last = tok.decode(answers[-1]["prompt_ids"])
    assert last.endswith(f"user: {lines[-1]}\nassistant:") and "question 0" not in last  # plain lines, trimmed


def test_generate_local_chat_renders_one_turn(model: Path, capsys: pytest.CaptureFixture) -> None:
    from sangama_p2p.cli.main import main
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    assert main(["generate", "--local", str(model), "--chat", "--system", SYSTEM, "hello", "--json",
                 "--max-new-tokens", "5"]) == 0
    out = json.loads(capsys.readouterr().out)
    ckpt = open_checkpoint(model)
    prompt = render_chat(load_chat_template(model), ckpt.tokenizer,
                         [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello"}])
    assert out["prompt_ids"] == list(prompt.ids)
    assert prompt.stop_ids == (ckpt.tokenizer.token_id("<|endoftext|>"), ckpt.tokenizer.token_id("<|im_end|>"))
    chain = LocalChain.load(ckpt, [LayerRange(0, ckpt.spec.num_layers)])
    tokens = chain.generate(list(prompt.ids), 5, stop_tokens=prompt.stop_ids).tokens
    assert out["tokens"] == tokens
    assert out["text"] == ckpt.tokenizer.decode(tokens[:-1] if tokens[-1] in prompt.stop_ids else tokens)


@pytest.mark.parametrize("argv, message", [
    (["--local", "M", "--chat", "--prompt-ids", "1,2"], "--chat needs a text prompt"),
    (["--local", "M", "--system", "be brief", "hello"], "--system needs --chat"),
    (["--model", "m", "--bootstrap", "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWCMUhR2Vq8yRPLC9f7PxQVC8iN1zNj3i2pYJQaZLsDq9C",
      "--chat", "hello"], "--chat is for --local"),
])
def test_generate_chat_flags_are_checked(argv: list[str], message: str, model: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    from sangama_p2p.cli.main import main

    assert main(["generate", *[str(model) if a == "M" else a for a in argv]]) == 2
    assert message in capsys.readouterr().err


class _Reader:
    """A child's stdout read in a thread: wait for the next ``> `` prompt of an interactive chat."""

    def __init__(self, stream) -> None:
        import threading

        self.data = b""
        self.cond = threading.Condition()
        threading.Thread(target=self._pump, args=(stream,), daemon=True).start()

    def _pump(self, stream) -> None:
        while chunk := stream.read1(4096):
            with self.cond:
                self.data += chunk
                self.cond.notify_all()

    def prompts(self, n: int, timeout: float) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: self.data.count(b"> ") >= n, timeout), self.data
            return self.data


@pytest.mark.slow
def test_chat_on_a_terminal_survives_a_killed_stage_and_goes_on_once_the_swarm_is_whole(model: Path,
                                                                                        tmp_path: Path) -> None:
    """A stage killed (no spare): the turn's error is printed, the prompt comes back, the question is taken back; a
    new peer for the range joins, and the next turn is answered in the same conversation."""
    import pty
    import time

    from sangama_p2p.cli.local_fleet import READY_PREFIX, LocalFleet
    from sangama_p2p.client.config import ClientConfig

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")
    cli = [sys.executable, "-m", "sangama_p2p.cli.main"]
    primary, secondary = pty.openpty()  # stdin a terminal: chat is interactive and prints its "> " prompt
    chat = rejoin = None
    try:
        with LocalFleet(model, ["0:3", "3:6"], tmp_path / "fleet") as fleet:
            chat = subprocess.Popen([*cli, "chat", "--model", str(model), "--bootstrap", fleet.bootstrap_addr,
                                     "--json", "--max-new-tokens", "4"], stdin=secondary, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env)
            out = _Reader(chat.stdout)
            out.prompts(1, 60)
            os.write(primary, b"hello\n")
            out.prompts(2, 60)
            fleet.children[2].proc.kill()  # the only 3:6 stage
            fleet.children[2].proc.wait()
            os.write(primary, b"again\n")
            out.prompts(3, 90)  # the error came back as a turn, and the prompt with it
            failed_at = time.monotonic()
            rejoin = subprocess.Popen([*cli, "join", "--model", str(model), "--layers", "3:6", "--bootstrap",
                                       fleet.bootstrap_addr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key",
                                       str(tmp_path / "rejoin.key")], stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, env=env, text=True)
            assert rejoin.stdout is not None
            assert any(line.startswith(READY_PREFIX) for line in rejoin.stdout)
            # a new generation re-uses a survey of the swarm younger than ClientConfig.survey_max_age (10 s)
            time.sleep(max(0.0, ClientConfig("m").survey_max_age + 0.5 - (time.monotonic() - failed_at)))
            os.write(primary, b"third\n")
            data = out.prompts(4, 90)
            os.write(primary, b"\x04")  # Ctrl-D: end of the conversation
            assert chat.wait(timeout=30) == 0
    finally:
        for proc in (chat, rejoin):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        os.close(primary)
        os.close(secondary)
    err = chat.stderr.read().decode() if chat.stderr else ""
    docs = [json.loads(line.removeprefix("> ")) for line in data.decode().split("\n") if line.strip("> ").strip()]
    assert len(docs) == 3, data
    first, failed, third = docs
    assert "error" not in first and "error" not in third and failed["error"]
    assert f"error: {failed['error']}" in err and "Traceback" not in err
    tok = Tokenizer.from_dir(model)
    history = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": first["text"]},
               {"role": "user", "content": "third"}]  # "again" was taken back
    assert third["prompt_ids"] == list(render_chat(load_chat_template(model), tok, history).ids)
