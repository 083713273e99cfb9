"""``sangama-peer``'s exit codes when a handler raises: Ctrl-C is 130 and typed errors are 2, also inside groups."""

from __future__ import annotations

import argparse

import pytest

from sangama_p2p.cli import main as cli_main
from sangama_p2p.errors import NetworkError, SangamaError


def _run_raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> int:
    def handler(args: argparse.Namespace) -> int:
        raise exc

    def parser() -> argparse.ArgumentParser:
        p = argparse.ArgumentParser()
        p.add_argument("-v", "--verbose", action="count", default=0)
        p.set_defaults(handler=handler)
        return p

    monkeypatch.setattr(cli_main, "build_parser", parser)
    return cli_main.main([])


def test_ctrl_c_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _run_raising(monkeypatch, KeyboardInterrupt()) == 130


def test_ctrl_c_from_a_background_task_exits_130(monkeypatch: pytest.MonkeyPatch) -> None:
    # trio raises Ctrl-C in the task that runs when it lands; crossing nurseries it arrives wrapped, maybe beside
    # the errors it caused in other tasks
    nested = BaseExceptionGroup("outer", [BaseExceptionGroup("inner", [KeyboardInterrupt()]), RuntimeError("x")])
    assert _run_raising(monkeypatch, nested) == 130


def test_typed_errors_exit_2_also_in_a_group(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    assert _run_raising(monkeypatch, SangamaError("plain")) == 2
    group = ExceptionGroup("two", [NetworkError("peer gone"), ExceptionGroup("in", [SangamaError("bad frame")])])
    assert _run_raising(monkeypatch, group) == 2
    err = capsys.readouterr().err
    assert "plain" in err and "peer gone" in err and "bad frame" in err


def test_other_errors_in_a_group_are_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ExceptionGroup):
        _run_raising(monkeypatch, ExceptionGroup("mixed", [SangamaError("typed"), ValueError("bug")]))


def test_quiet_libp2p_holds_when_libp2p_is_imported_later() -> None:
    # the demo imports libp2p only once its fleet runs; py-libp2p's import-time logging setup used to undo the quiet
    import subprocess
    import sys

    code = ("import logging, sys; logging.basicConfig(level=logging.WARNING)\n"
            "assert 'libp2p' not in sys.modules\n"
            "from sangama_p2p.cli.process import quiet_libp2p; quiet_libp2p()\n"
            "import libp2p.network.swarm as swarm; swarm.logger.error('fail to upgrade mux for peer X')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "fail to upgrade mux" not in out.stderr
