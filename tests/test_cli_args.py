"""Bad input at the command line: refused before anything starts, with one clear error and exit code 2 (never a
traceback, never a silent run that does nothing); Ctrl-C is never lost."""

from __future__ import annotations

import json
import os
import pty
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sangama_p2p.cli import main as cli_main
from sangama_p2p.cli.main import main

BOOT = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWKvVTzQZ5gKwzBq5rQxBdYDu1d3GLwX2ZJgzyvg4cbyzY"  # nothing listens there
PIN = "5a" * 16 + ":8"  # a --fingerprint FP:LAYERS


@pytest.mark.parametrize("argv, message", [
    (["generate", "--local", "m", "--prompt-ids", "1", "--guesses", "abc"], "argument --guesses"),
    (["generate", "--local", "m", "--prompt-ids", "1", "--guesses", "9"], "argument --guesses"),
    (["generate", "--local", "m", "--prompt-ids", "1", "--threads", "-2"], "argument --threads: must be >= 1"),
    (["generate", "--local", "m", "--prompt-ids", "1", "--max-new-tokens", "-3"], "must be >= 0, got -3"),
    (["generate", "--model", "m", "--prompt-ids", "1", "--batch", "0"], "argument --batch: must be >= 1"),
    (["join", "--model", "m", "--layers", "0:2", "--threads", "0"], "argument --threads"),
    (["chat", "--model", "m", "--guesses", "x"], "argument --guesses"),
    (["chat", "--model", "m", "--max-new-tokens", "-1"], "argument --max-new-tokens"),
    (["demo", "--tokens", "0"], "argument --tokens: must be >= 1"),
])
def test_bad_numbers_are_refused_by_the_parser(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["demo", "--requests", "0"], "--requests expects comma-separated integers >= 1"),
    (["demo", "--requests", "1,x"], "--requests expects comma-separated integers"),
    (["demo", "--guesses", "0,9"], "--guesses expects comma-separated integers 0..8"),
    (["demo", "--guesses", ""], "--guesses expects"),
])
def test_demo_lists_are_checked_before_anything_starts(argv: list[str], message: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    assert main([*argv, "--workdir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # no model made, no fleet started


def test_a_prompt_given_twice_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--local", str(tmp_path), "hello", "--prompt-ids", "1,2"]) == 2
    assert "give the prompt once: TEXT and --prompt-ids" in capsys.readouterr().err
    assert main(["generate", "--model", "m", "--bootstrap", BOOT, "hello", "--prompt", "hi"]) == 2
    assert "TEXT and --prompt" in capsys.readouterr().err


@pytest.mark.parametrize("argv, what", [
    (["generate", "hello", "--model", "tiny"], "a text prompt"),
    (["chat", "--model", "tiny"], "chat"),
])
def test_text_with_a_model_id_asks_for_the_tokenizer_before_joining(argv: list[str], what: str,
                                                                      capsys: pytest.CaptureFixture) -> None:
    t0 = time.monotonic()
    # pinned (a bare id is refused in a public swarm otherwise: test_a_bare_model_id_is_refused_in_a_public_swarm)
    assert main([*argv, "--bootstrap", BOOT, "--fingerprint", PIN]) == 2  # nothing listens at BOOT: never dialled
    err = capsys.readouterr().err
    assert f"{what} needs the model's tokenizer" in err and "--tokenizer DIR" in err
    assert "tokenizer_path" not in err  # the flags a user can pass, not the Python API's names
    assert time.monotonic() - t0 < 10


def test_an_interrupt_swallowed_inside_an_import_is_raised_after_it(tmp_path: Path, monkeypatch) -> None:
    # torch's import swallows a KeyboardInterrupt that lands in part of it; `join` then went on and served
    (tmp_path / "swallows_ctrl_c.py").write_text(
        "import signal\ntry:\n    signal.raise_signal(signal.SIGINT)\nexcept KeyboardInterrupt:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        cli_main.import_keeping_interrupts("swallows_ctrl_c")
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's handler is back
    monkeypatch.delitem(sys.modules, "swallows_ctrl_c")
    monkeypatch.setattr(cli_main, "_TORCH", "swallows_ctrl_c")
    assert main(["generate", "--local", str(tmp_path), "--prompt-ids", "1"]) == 130


def test_chat_waiting_for_a_line_exits_130_on_ctrl_c(tmp_path: Path) -> None:
    from sangama_p2p.model.make import make_model

    model = make_model(tmp_path / "chat-tiny", "llama", "tiny")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")
    cli = [sys.executable, "-m", "sangama_p2p.cli.main"]
    boot = subprocess.Popen([*cli, "bootstrap", "--listen", "/ip4/127.0.0.1/tcp/0", "--key", str(tmp_path / "b.key"),
                             "--run-for", "120"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    primary, secondary = pty.openpty()  # a terminal on stdin: chat prints its "> " prompt and waits for a line
    chat = None
    try:
        assert boot.stdout is not None
        addr = next(line.split()[-1] for line in boot.stdout if "--bootstrap" in line)
        chat = subprocess.Popen([*cli, "chat", "--model", str(model), "--bootstrap", addr], stdin=secondary,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        assert chat.stdout is not None
        assert chat.stdout.read(2) == b"> ", chat.stderr.read() if chat.stderr else ""
        time.sleep(0.5)  # in readline now
        chat.send_signal(signal.SIGINT)
        assert chat.wait(timeout=20) == 130  # it waited for Enter before
        assert b"Traceback" not in (chat.stderr.read() if chat.stderr else b"")
    finally:
        for proc in (chat, boot):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        os.close(primary)
        os.close(secondary)


def test_make_model_into_a_path_that_cannot_be_created(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "a-file").write_text("x")
    assert main(["make-model", str(tmp_path / "a-file" / "model"), "--arch", "llama"]) == 2
    assert "cannot write the model to" in capsys.readouterr().err


def test_chat_with_default_settings_works_on_a_model_without_mtp(tmp_path: Path) -> None:
    # chat asked for guesses=auto whatever the model: a dense Llama refused every line (TOO_MANY_GUESSES)
    from sangama_p2p.cli.local_fleet import ThreadFleet
    from sangama_p2p.cli.swarm import default_guesses
    from sangama_p2p.model.make import make_model

    model = make_model(tmp_path / "llama-tiny", "llama", "tiny")
    assert default_guesses(model) == 0
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1] / "src"), OMP_NUM_THREADS="1")
    with ThreadFleet(model, [(0, 3), (3, 6)], tmp_path) as fleet:
        out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "chat", "--model", str(model),
                              "--bootstrap", fleet.bootstrap_addr, "--max-new-tokens", "6", "--json"],
                             input="hello\nand again\n", capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    answers = [json.loads(line) for line in out.stdout.splitlines()]  # an answer's text may hold newlines
    assert len(answers) == 2 and all(a["tokens"] and "error" not in a for a in answers), out.stdout
    assert "error" not in out.stderr


def test_default_guesses_for_a_model_with_mtp_or_only_a_tokenizer(tmp_path: Path) -> None:
    from sangama_p2p.cli.swarm import default_guesses
    from sangama_p2p.model.make import make_model

    model = make_model(tmp_path / "qwen-tiny", "qwen3_5_moe", "tiny")
    assert default_guesses(model) == "auto"
    assert default_guesses(tmp_path) == "auto"  # no config.json: nothing to tell, the swarm will say


@pytest.mark.parametrize("command", ["bootstrap", "join"])
def test_a_busy_listen_port_is_refused(command: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # py-libp2p listens with SO_REUSEPORT: a second node on a busy port started silently and the kernel split the
    # incoming connections between the two
    import socket

    with socket.socket() as busy:
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as a running node's listener has it
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        addr = f"/ip4/127.0.0.1/tcp/{busy.getsockname()[1]}"
        argv = {"bootstrap": ["bootstrap"], "join": ["join", "--model", str(tmp_path), "--layers", "0:1"]}[command]
        t0 = time.monotonic()
        assert main([*argv, "--listen", addr, "--key", str(tmp_path / "k"), "--run-for", "0.1"]) == 2
        assert time.monotonic() - t0 < 10  # refused before any model loads or any node starts
    assert f"cannot listen on {addr}: Address already in use" in capsys.readouterr().err


def test_status_timeout_must_be_positive(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["status", "--bootstrap", BOOT, "--timeout", "0"])
    assert "argument --timeout: must be a number > 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--local", "m", "--timings"], "--timings is for the network mode"),
    (["--local", "m", "--bootstrap", BOOT], "--bootstrap is for the network mode"),
    (["--model", "m", "--bootstrap", BOOT, "--stages", "0:3,3:8"], "--stages is for --local"),
    (["--model", "m", "--bootstrap", BOOT, "--threads", "2", "--batch-invariant"],
     "--batch-invariant, --threads are for --local"),
])
def test_generate_refuses_a_flag_of_the_other_mode(argv: list[str], message: str,
                                                    capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", *argv, "--prompt-ids", "1,2"]) == 2  # it was ignored without a word
    assert message in capsys.readouterr().err


def test_join_model_flag_wins_over_the_config_also_for_the_model_id(tmp_path: Path, monkeypatch,
                                                                   capsys: pytest.CaptureFixture) -> None:
    # flags win over the file: --model took the layers from the new checkpoint but announced the file's model name
    from sangama_p2p.cli import swarm
    from sangama_p2p.model.make import make_model

    monkeypatch.setattr(swarm, "default_bootstrap_addrs", lambda: ())  # the swarm's first peer: dial nobody
    model = make_model(tmp_path / "flag-model", "llama", "tiny")
    conf = tmp_path / "stage.toml"
    conf.write_text('[host]\nlisten_addrs = ["/ip4/127.0.0.1/tcp/0"]\n[stage]\nmodel = "file-model"\nlayers = "0:2"\n')
    explicit = tmp_path / "explicit.toml"
    explicit.write_text(conf.read_text() + 'model_id = "fleet-name"\n')
    for path, expected in ((conf, "flag-model"), (explicit, "fleet-name")):
        assert main(["join", "--config", str(path), "--model", str(model), "--key", str(tmp_path / "k"),
                     "--run-for", "0.1"]) == 0
        out = capsys.readouterr().out
        ready = [line.split() for line in out.splitlines() if line.startswith("ready ")]
        assert ready and ready[0][2:] == [expected, "0:2"], out


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["chat"]])
def test_a_model_path_that_is_not_there_is_not_taken_for_a_model_id(command: list[str], tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture) -> None:
    # a typo in the directory went to the swarm as a model id: "no live peer serves '/srv/models/qwne'"
    assert main([*command, "--model", str(tmp_path / "typo"), "--bootstrap", BOOT]) == 2
    assert f"checkpoint {tmp_path / 'typo'} does not exist" in capsys.readouterr().err


def test_generate_with_a_checkpoint_directory_pins_its_fingerprint_and_depth(tmp_path: Path) -> None:
    """``--model DIR`` chains only peers of that very checkpoint, at its depth; a directory with only a config pins
    the depth; ``--fingerprint FP:LAYERS`` pins both, and must agree with a local copy."""
    from sangama_p2p.cli.main import build_parser
    from sangama_p2p.cli.swarm import client_peer_config
    from sangama_p2p.errors import RouteError
    from sangama_p2p.model.fingerprint import checkpoint_identity
    from sangama_p2p.model.make import make_model

    ckpt = make_model(tmp_path / "m", "llama", "tiny")
    ident = checkpoint_identity(ckpt)
    secret = tmp_path / "secret"
    secret.write_text("ab" * 32)
    conf_only = tmp_path / "conf"
    conf_only.mkdir()
    for f in ("tokenizer.json", "config.json"):
        (conf_only / f).write_bytes((ckpt / f).read_bytes())

    def pin(*argv: str) -> tuple[str | None, int | None]:
        args = build_parser().parse_args(["generate", "--prompt-ids", "1", "--bootstrap", BOOT, *argv])
        config, _ = client_peer_config(args, args.model)
        return config.client.fingerprint, config.client.num_layers

    assert pin("--model", str(ckpt)) == (ident.fingerprint, ident.num_layers)
    assert pin("--model", "org/m", "--fingerprint", PIN) == ("5a" * 16, 8)
    assert pin("--model", str(ckpt), "--fingerprint", f"{ident.fingerprint}:{ident.num_layers}") == (
        ident.fingerprint, ident.num_layers)
    with pytest.raises(RouteError, match="is not the checkpoint"):
        pin("--model", str(ckpt), "--fingerprint", PIN)
    # in a private fleet a bare id (or a config without weights: the depth alone) is enough
    assert pin("--model", "org/m", "--fleet-secret-file", str(secret)) == (None, None)
    assert pin("--model", str(conf_only), "--fleet-secret-file", str(secret)) == (None, ident.num_layers)
    assert pin("--model", "org/m", "--tokenizer", str(conf_only), "--fleet-secret-file", str(secret)) == (
        None, ident.num_layers)


@pytest.mark.parametrize("model", ["org/m", "CONF"])
def test_a_bare_model_id_is_refused_in_a_public_swarm(model: str, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture) -> None:
    # issue 26: five peers of another checkpoint under the honest id took over every client that did not pin
    from sangama_p2p.model.make import make_model

    if model == "CONF":  # a directory with a config and a tokenizer but no weights names no checkpoint either
        ckpt = make_model(tmp_path / "m", "llama", "tiny")
        model = str(tmp_path / "conf")
        Path(model).mkdir()
        for f in ("tokenizer.json", "config.json"):
            (Path(model) / f).write_bytes((ckpt / f).read_bytes())
    for argv in (["generate", "--prompt-ids", "1"], ["chat"], ["api"]):
        assert main([*argv, "--model", model, "--bootstrap", BOOT]) == 2
        err = capsys.readouterr().err
        assert "does not name a checkpoint" in err and "--fingerprint FP:LAYERS" in err, err
    with pytest.raises(SystemExit):  # a fingerprint without its depth: the depth is never a vote
        main(["generate", "--prompt-ids", "1", "--model", "org/m", "--fingerprint", "5a" * 16, "--bootstrap", BOOT])
    assert "FINGERPRINT:LAYERS" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["generate", "--prompt-ids", "1"], ["chat"], ["api"]])
def test_verify_takes_a_fraction_and_reaches_the_client_config(command: list[str],
                                                              capsys: pytest.CaptureFixture) -> None:
    from sangama_p2p.cli.main import build_parser
    from sangama_p2p.cli.swarm import client_peer_config
    from sangama_p2p.net.bans import default_bans_path

    for bad in ("1.5", "-0.1", "x"):
        with pytest.raises(SystemExit) as exc:
            main([*command, "--model", "org/m", "--verify", bad, "--bootstrap", BOOT, "--fingerprint", PIN])
        assert exc.value.code == 2 and "argument --verify" in capsys.readouterr().err
    for given, want in ((["--verify", "0.25"], 0.25), ([], None)):  # None: the swarm decides (public 0.05)
        args = build_parser().parse_args([*command, "--model", "org/m", *given, "--bootstrap", BOOT,
                                          "--fingerprint", PIN])
        config, _ = client_peer_config(args, args.model)
        assert config.client.verify == want and config.client.bans_file == default_bans_path()


def test_verify_is_for_the_network_mode(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--local", "m", "--prompt-ids", "1", "--verify", "0.5"]) == 2
    assert "--verify is for the network mode" in capsys.readouterr().err
