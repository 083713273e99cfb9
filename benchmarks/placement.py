"""Placement against the exact optimum of its cost model, and the Petals-style greedy beside it.

    python benchmarks/placement.py [--seeds 20] [--json benchmarks/results/placement.json]

For each seeded random 8-peer swarm (``placement.random_swarm``: 32 layers, three regions, 4-16 layers of memory and
1-5 ms per layer per peer, 8 concurrent sessions, ranges on the 8-block grid) prints what ``place``, the exact
``brute_force`` and ``petals_greedy`` serve (steps/s under ``placement.score``), the ratios to the optimum and the
seconds each search took, then min / median of the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from sangama_p2p.placement import brute_force, petals_greedy, place, random_swarm, score


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--json", type=Path, default=Path(__file__).parent / "results" / "placement.json")
    args = ap.parse_args()
    rows = []
    print(f"{'seed':>4} {'optimum':>8} {'place':>8} {'ratio':>6} {'greedy':>7} {'ratio':>6} {'place s':>8} "
          f"{'exact s':>8}")
    for seed in range(args.seeds):
        peers, links = random_swarm(seed)
        t0 = time.perf_counter()
        ours = place(peers, links, 32)
        t1 = time.perf_counter()
        best = brute_force(peers, links, 32)
        t2 = time.perf_counter()
        s_ours, s_best = score(ours, peers, links, 32), score(best, peers, links, 32)
        s_greedy = score(petals_greedy(peers, links, 32), peers, links, 32)
        row = {"seed": seed, "optimum": s_best.served, "place": s_ours.served, "greedy": s_greedy.served,
               "place_ratio": s_ours.served / s_best.served, "greedy_ratio": s_greedy.served / s_best.served,
               "place_s": t1 - t0, "exact_s": t2 - t1, "place_ranges": ours, "optimum_ranges": best}
        rows.append(row)
        print(f"{seed:>4} {s_best.served:>8.2f} {s_ours.served:>8.2f} {row['place_ratio']:>6.3f} "
              f"{s_greedy.served:>7.2f} {row['greedy_ratio']:>6.3f} {row['place_s']:>8.2f} {row['exact_s']:>8.1f}",
              flush=True)
    summary = {k: {"min": min(r[k] for r in rows), "median": statistics.median(r[k] for r in rows)}
               for k in ("place_ratio", "greedy_ratio", "place_s", "exact_s")}
    for k, v in summary.items():
        print(f"{k}: min {v['min']:.3f}, median {v['median']:.3f}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"swarms": rows, "summary": summary, "depth": 32, "peers": 8, "blocks": 8,
                                     "sessions": 8}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
