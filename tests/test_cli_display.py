"""What ``sangama-peer`` shows a newcomer: its version, the defaults in ``--help``, ``-v`` on either side of the
subcommand, peers by a unique id suffix (never ``12D3KooW -> 12D3KooW``), failovers in text mode, tables that say
what their columns mean, and ``status`` within 80 columns with its bootstrap row labelled."""

from __future__ import annotations

import logging
import time

import pytest
from rich.console import Console

from sangama_p2p import __version__
from sangama_p2p.cli import main as cli_main
from sangama_p2p.cli.main import build_parser, main

IDS = ["12D3KooWKvVTzQZ5gKwzBq5rQxBdYDu1d3GLwX2ZJgzyvg4cbyzY", "12D3KooWQ6b8iQyKgq1Q3NYuUPPbW1MmdiDNYL9fQm3Jw2bPaT8A",
       "12D3KooWJ9zuKx4NWFZkWUD5nqFQb5fBRSzdRhDkyC4Cp6P1uUHk", "12D3KooWEy8pQGmbwyT7fM4gWTGRGZuJ8V1vPJkq8ZZcbNcGHrQ2"]


def test_version(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"sangama-peer {__version__}"


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_help_shows_the_sampling_defaults(command: str) -> None:
    text = build_parser()._subparsers._group_actions[0].choices[command].format_help()  # type: ignore[union-attr]
    flat = " ".join(text.split())
    defaults = {"generate": ("32", "0.0", "1.0", "0"), "chat": ("128", "0.0", "1.0", "0")}[command]
    for flag, default in zip(("--max-new-tokens", "--temperature", "--top-p", "--seed"), defaults):
        part = flat.rsplit(f"{flag} {flag.lstrip('-').replace('-', '_').upper()}", 1)[1].split(" --", 1)[0]
        assert f"(default {default})" in part, (flag, part)


@pytest.mark.parametrize("argv, level", [
    ([], logging.WARNING), (["-v"], logging.INFO), (["-v", "id", "-v"], logging.DEBUG), (["id", "-vv"], logging.DEBUG),
    (["id", "-v"], logging.INFO),
])
def test_verbose_before_and_after_the_subcommand_add_up(argv: list[str], level: int,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = cli_main.build_parser

    def parser():
        p = real()
        p._subparsers._group_actions[0].choices["id"].set_defaults(  # type: ignore[union-attr]
            handler=lambda args: seen.append(logging.getLogger().level) or 0)
        return p

    monkeypatch.setattr(cli_main, "build_parser", parser)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])  # let basicConfig set the level afresh (pytest's handlers are back after)
    monkeypatch.setattr(root, "level", root.level)
    argv = argv if "id" in argv else [*argv, "id"]
    assert main(argv) == 0
    assert seen == [level]


def test_peer_label_is_a_unique_suffix() -> None:
    from sangama_p2p.cli.tables import peer_label

    labels = [peer_label(i) for i in IDS]
    assert len(set(labels)) == len(IDS) and all(i.endswith(lab[1:]) for i, lab in zip(IDS, labels))
    assert [i[:8] for i in IDS] == ["12D3KooW"] * len(IDS)  # what the route showed before


def test_network_stats_name_each_peer_and_say_a_failover(capsys: pytest.CaptureFixture) -> None:
    from sangama_p2p.cli.generate_cmds import _network_stats
    from sangama_p2p.client.generate import GenerationResult

    r = GenerationResult(prompt_ids=[1], tokens=[5, 6, 7], route=IDS[:3], failovers=1, prefill_s=0.1, decode_s=0.2)
    _network_stats(r)
    err = capsys.readouterr().err
    assert "route …" + IDS[0][-8:] + " -> …" + IDS[1][-8:] + " -> …" + IDS[2][-8:] in err
    assert "the chain failed 1 time during this generation: re-routed and replayed" in err
    _network_stats(GenerationResult(prompt_ids=[1], tokens=[5], route=IDS[:1]))
    err = capsys.readouterr().err
    assert "failed" not in err and "verify" not in err


def test_network_stats_say_how_many_trips_verification_could_not_check(capsys: pytest.CaptureFixture) -> None:
    """Issue 26: "cannot verify" is always said; a run whose checks all passed says how many it checked."""
    from sangama_p2p.cli.generate_cmds import _network_stats
    from sangama_p2p.client.generate import GenerationResult

    _network_stats(GenerationResult(prompt_ids=[1], tokens=[5], route=IDS[:1], verified_trips=3, unverified_trips=2))
    assert "verify: 3 trips checked on a second chain, 2 could not be" in capsys.readouterr().err
    _network_stats(GenerationResult(prompt_ids=[1], tokens=[5], route=IDS[:1], verified_trips=4, unverified_trips=0))
    err = capsys.readouterr().err
    assert "verify: 4 trips checked on a second chain]" in err and "could not" not in err


def test_demo_tables_say_what_each_column_means() -> None:
    from sangama_p2p.cli.tables import guesses_table, requests_table, where_time_goes_table

    console = Console(width=110, record=True, color_system=None)
    console.print(guesses_table([{"guesses": 2, "tokens_per_s": 10.0, "tokens_per_trip": 1.5,
                                  "accepted_per_trip": 0.5, "local_tokens_per_s": 12.0, "same_tokens": True}]))
    console.print(requests_table([{"requests": 4, "aggregate_tokens_per_s": 30.0, "per_request_tokens_per_s": 8.0,
                                   "mean_batch": 3.5, "same_tokens": True}]))
    console.print(where_time_goes_table({"trips": 3, "trip_ms": 10.0, "network_ms": 4.0, "stages": [
        {"peer": IDS[0], "queue_ms": 1.0, "compute_ms": 4.0, "send_ms": 1.0, "mean_batch": 1.0}]}))
    text = " ".join(console.export_text().split())
    for said in ("accepted/trip: guesses kept per trip", "ratio: network / one process",
                 "aggregate tokens/s: all their tokens over the wall time", "mean batch: requests per stage step",
                 "queue: received until its step starts", "network: the trip minus the stages' time",
                 f"stage 1 (…{IDS[0][-8:]})"):
        assert said in text, said


def _status():
    from sangama_p2p.net.records import ServingRecord
    from sangama_p2p.net.status import PeerStatus, SwarmStatus

    def rec(peer: str, start: int, end: int, reach: str = "direct") -> ServingRecord:
        return ServingRecord(model_id="SmolLM2-135M-Instruct.Q4_1", peer_id=peer, start=start, end=end,
                             throughput=412.5, free_sessions=31,
                             addrs=(f"/ip4/203.0.113.7/tcp/40{start:02d}/p2p/{peer}",
                                    f"/ip4/10.0.0.7/tcp/40{start:02d}/p2p/{peer}"),
                             reachability=reach, version="0.1.0", expires_at=time.time() + 60, seq=1,
                             fingerprint="5a" * 16, num_layers=30)

    peers = (PeerStatus(IDS[1], "direct", 0.42, (rec(IDS[1], 0, 10),)),
             PeerStatus(IDS[2], f"relayed via {IDS[0]}", 12.5, (rec(IDS[2], 10, 20, reach=IDS[0]),)),
             PeerStatus(IDS[3], "direct", 0.51, (rec(IDS[3], 20, 30),)),
             PeerStatus(IDS[0], "direct", 0.3, ()))
    return SwarmStatus(peers, time.time())


def test_status_fits_80_columns_and_labels_the_bootstrap_row() -> None:
    from sangama_p2p.cli.net_cmds import _print_table, bootstrap_peer_ids

    console = Console(width=80, record=True, color_system=None)
    boot = bootstrap_peer_ids((f"/ip4/203.0.113.5/tcp/4001/p2p/{IDS[0]}",))
    assert boot == {IDS[0]}
    _print_table(_status(), boot, console=console)
    text = console.export_text()
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(line for line in lines if len(line) > 80)
    header = next(line for line in lines if "peer" in line and "layers" in line)
    for column in ("peer", "layers", "steps/s", "free", "link", "rtt ms", "reach"):
        assert column in header, (column, header)  # not folded into pieces
    assert "SmolLM2-135M-Instruct.Q4_1: layers covered 0:30" in text
    rows = [line.split() for line in lines]
    assert [f"…{IDS[2][-8:]}", "10:20", "412.5", "31", "relay", f"…{IDS[0][-8:]}", "12.5", f"…{IDS[0][-8:]}"] in rows
    assert [f"…{IDS[0][-8:]}", "bootstrap", "direct", "0.3"] in rows  # the bootstrap row, labelled
    assert all(i in text for i in IDS)  # every peer's full id, under the tables
