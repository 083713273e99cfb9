"""Dial attempts of a NATed home fleet under client churn: do departed peers keep being dialled? (issue 27)

    sudo python benchmarks/dial_soak.py [--minutes 10] [--every 20] [--json benchmarks/results/dial_soak.json]

The lab of ``tests/net/netns.py`` and the CLI fleet of ``tests/net/cli_fleet.py``: a bootstrap/relay on the public
host, three stages (``qwen3_5_moe/tiny``: 0:3, 3:6, 6:8) each behind its own NAT, and a new short-lived client every
``--every`` seconds behind a fourth NAT (``generate`` of 8 tokens and ``status``, in turn). Each NAT box counts the
SYNs its stage sends (``tests/net/fleet_soak.py``), per minute and by destination. Done when the dial attempts per
minute of every stage stay within 2x of its first minute's. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.net.cli_fleet import make_tiny  # noqa: E402
from tests.net.fleet_soak import HEADER, STAGE_SIDES, format_row, run_soak  # noqa: E402
from tests.net.netns import NatLab, netns_unavailable_reason  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "dial_soak.json"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=int, default=10)
    parser.add_argument("--every", type=float, default=20.0, help="seconds between two new clients")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--label", default="", help="a note saved with the results (e.g. the commit)")
    args = parser.parse_args()
    reason = netns_unavailable_reason()
    if reason is not None:
        print(f"cannot run the NAT lab: {reason}", file=sys.stderr)
        return 2
    import sangama_p2p

    commit = subprocess.run(["git", "-C", str(Path(sangama_p2p.__file__).parent), "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip()
    print(f"code: {sangama_p2p.__file__} ({commit or 'no git'}); {args.minutes} min, a client every {args.every:g} s")
    print(HEADER, flush=True)
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        tiny = make_tiny(tmp / "tiny")
        with NatLab(sides="abcd") as lab:
            result = run_soak(lab, tiny, tmp, minutes=args.minutes, every_s=args.every,
                              on_minute=lambda m: print(format_row(m), flush=True))
    ratio = result.worst_ratio()
    ok = ratio <= 2.0
    print(f"worst minute / first minute over the stages: {ratio:.2f} ({'within' if ok else 'NOT within'} 2x)")
    out = {
        "label": args.label,
        "code": str(Path(sangama_p2p.__file__).parent),
        "commit": commit,
        "minutes": args.minutes,
        "client_every_s": args.every,
        "machine": f"{platform.machine()}, {platform.python_version()}",
        "per_minute": [asdict(m) for m in result.minutes],
        "totals_per_stage": {side: result.totals(side) for side in STAGE_SIDES},
        "worst_ratio_to_first_minute": ratio,
        "within_2x": ok,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
