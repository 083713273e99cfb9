"""The seed-style tables that ``generate --timings``, ``demo`` and ``benchmarks/pipeline.py`` print.

Each table is built from plain dicts (what the JSON results hold), so the benchmark's JSON and the printed table
never disagree.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["guesses_table", "peer_label", "print_tables", "requests_table", "where_time_goes_table",
           "print_where_time_goes"]

# rich (0.02-0.05 s to import) is imported where a table is drawn, and client.timing (libp2p, 0.8-1.4 s, through the
# client package) where trips are summarised: every command module imports this one.


def peer_label(peer_id: str) -> str:
    """A peer id cut to its last 8 characters, ``…x2Ab9cQe``: unique in any swarm (58^8 values), where every id's
    first characters are the same multihash prefix (``12D3KooW``)."""
    return "…" + peer_id[-8:] if len(peer_id) > 8 else peer_id


def where_time_goes_table(summary: dict[str, Any], title: str = "Where the time goes (mean per trip)") -> Any:
    """``summary``: :func:`sangama_p2p.client.timing.summarize_trips` output."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption_justify="left",
                  caption="queue: received until its step starts; compute: the stage's layers; send: encoding the "
                  "output and waiting for the link; batch: requests in the step; share: of the trip; network: "
                  "the trip minus the stages' time")
    for col in ("part", "queue ms", "compute ms", "send ms", "batch", "share"):
        table.add_column(col, justify="right" if col != "part" else "left")
    trip = summary.get("trip_ms") or 0.0
    for i, st in enumerate(summary.get("stages", [])):
        total = st["queue_ms"] + st["compute_ms"] + st["send_ms"]
        table.add_row(f"stage {i + 1} ({peer_label(st['peer'])})", f"{st['queue_ms']:.2f}", f"{st['compute_ms']:.2f}",
                      f"{st['send_ms']:.2f}", f"{st['mean_batch']:.1f}", _share(total, trip))
    net = summary.get("network_ms", 0.0)
    hops = len(summary.get("stages", [])) + 1
    table.add_row(f"network ({hops} hops, the rest)", "", "", f"{net:.2f}", "", _share(net, trip))
    table.add_row("[bold]trip[/bold]", "", "", f"[bold]{trip:.2f}[/bold]", "", f"{summary.get('trips', 0)} trips")
    return table


def _share(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f} %" if whole > 0 else "-"


def print_where_time_goes(trips: Sequence[Any]) -> None:
    from rich.console import Console

    from ..client.timing import summarize_trips

    Console(stderr=True).print(where_time_goes_table(summarize_trips(trips)))


def guesses_table(rows: Sequence[dict[str, Any]], title: str = "One request: tokens/s by guesses per trip") -> Any:
    """``rows``: ``{"guesses", "tokens_per_s", "tokens_per_trip", "accepted_per_trip", "local_tokens_per_s"?,
    "same_tokens"?}``."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption_justify="left",
                  caption="guesses: MTP guesses checked per trip; tokens/s: decode over the network; tokens/trip: "
                  "new tokens per trip through the chain; accepted/trip: guesses kept per trip; one process "
                  "tokens/s: the same model in one process; ratio: network / one process; tokens: the network's "
                  "greedy tokens against the one-process run's")
    for col in ("guesses", "tokens/s", "tokens/trip", "accepted/trip", "one process tokens/s", "ratio", "tokens"):
        table.add_column(col, justify="right")
    for r in rows:
        local = r.get("local_tokens_per_s")
        ratio = f"{r['tokens_per_s'] / local:.2f}x" if local else "-"
        same = r.get("same_tokens")
        table.add_row(str(r["guesses"]), f"{r['tokens_per_s']:.1f}", f"{r.get('tokens_per_trip', 0):.2f}",
                      f"{r.get('accepted_per_trip', 0):.2f}", f"{local:.1f}" if local else "-", ratio,
                      "-" if same is None else ("same" if same else "[red]DIFFERENT[/red]"))
    return table


def requests_table(rows: Sequence[dict[str, Any]], title: str = "Many requests at once") -> Any:
    """``rows``: ``{"requests", "aggregate_tokens_per_s", "per_request_tokens_per_s", "mean_batch"?,
    "same_tokens"?}``."""
    from rich.table import Table

    table = Table(title=title, title_justify="left", caption_justify="left",
                  caption="requests: sent at once; aggregate tokens/s: all their tokens over the wall time; per "
                  "request tokens/s: each one's decode rate, averaged; mean batch: requests per stage step; "
                  "tokens = solo: each request's tokens equal its run alone")
    for col in ("requests", "aggregate tokens/s", "per request tokens/s", "mean batch", "tokens = solo"):
        table.add_column(col, justify="right")
    for r in rows:
        same = r.get("same_tokens")
        table.add_row(str(r["requests"]), f"{r['aggregate_tokens_per_s']:.1f}",
                      f"{r['per_request_tokens_per_s']:.1f}", f"{r.get('mean_batch', 0):.1f}",
                      "-" if same is None else ("yes" if same else "[red]NO[/red]"))
    return table


def print_tables(*tables: Any) -> None:
    from rich.console import Console

    console = Console() if sys.stdout.isatty() else Console(width=110)  # logs and pipes: no wrapped headers
    for t in tables:
        console.print(t)
