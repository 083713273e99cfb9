"""Issue 27 in namespaces, short: a NATed home fleet (bootstrap/relay, three NATed stages) and a new short-lived
client (``generate`` / ``status``) every 20 s behind another NAT, for 2 minutes. The SYNs each stage's NAT sees per
minute stay within 2x of the first minute's (on the old code they grew 1.6-5x in the second minute, nearly all
towards departed clients), and the clients all finish. ``benchmarks/dial_soak.py`` runs the same for 10 minutes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .cli_fleet import make_tiny
from .fleet_soak import STAGE_SIDES, format_row, run_soak
from .netns import NatLab, netns_unavailable_reason

_REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def test_dial_attempts_per_minute_stay_flat_under_client_churn(tmp_path: Path) -> None:
    tiny = make_tiny(tmp_path / "tiny")
    with NatLab(sides="abcd") as lab:
        result = run_soak(lab, tiny, tmp_path, minutes=2, every_s=20.0, on_minute=lambda m: print(format_row(m)))
    totals = {side: result.totals(side) for side in STAGE_SIDES}
    assert result.worst_ratio() <= 2.0, totals
    assert sum(m.clients_failed for m in result.minutes) == 0, [(m.clients_ok, m.clients_failed)
                                                               for m in result.minutes]
