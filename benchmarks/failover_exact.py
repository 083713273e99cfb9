"""Kill -9 the middle stage at random tokens of a greedy generation: do the tokens stay those of an uninterrupted run,
and what does the replay cost?

    python benchmarks/failover_exact.py [--kills 10] [--tokens 200] [--replay shapes|prefill] [--seed 22]

Real SmolLM2-135M-Instruct (Q4_1, ``.ci/fetch-models``) over three ``sangama-peer join`` processes (0:10, 10:20,
20:30) and a spare 10:20, one thread each, and a client in this process. One uninterrupted generation, then one per
kill (the token drawn at random from 5 .. tokens-5); after each kill a fresh ``join`` of the killed range is the next
spare. ``--replay shapes`` is the shipped replay (every answered trip re-sent in its original shape);
``--replay prefill`` patches the client back to the replay before issue 22 (one prefill of everything so far), for
the side-by-side. Prints a table per kill and writes benchmarks/results/failover_exact[-prefill].json.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import random
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from client.failover_fleet import READY_PREFIX, run_kills, start_fleet  # noqa: E402

from sangama_p2p import generation  # noqa: E402
from sangama_p2p.model.checkpoint import open_checkpoint  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODEL = Path.home() / ".cache" / "sangama-test" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPT = "The history of the city of Paris begins with a small settlement on an island in the river"


def _prefill_replay() -> None:
    """The replay before issue 22: the next trip re-sends the prompt and every token so far from position 0."""
    shaped = generation.Generation.finish

    def finish(self, trip, answer, now=None):  # type: ignore[no-untyped-def]
        if answer is None:
            self.pending, self.start, self.n_guesses = [*self.result.prompt_ids, *self.result.tokens], 0, 0
            return []
        return shaped(self, trip, answer, now)

    generation.Generation.finish = finish  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--replay", choices=["shapes", "prefill"], default="shapes")
    ap.add_argument("--seed", type=int, default=22)
    ap.add_argument("--model", type=Path, default=MODEL)
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("libp2p").setLevel(logging.CRITICAL)  # its dial warnings about the killed peers
    logging.getLogger("sangama_p2p").setLevel(logging.INFO)  # the client's failovers: what broke, what it chose
    if args.replay == "prefill":
        _prefill_replay()
    prompt = open_checkpoint(args.model).tokenizer.encode(PROMPT)
    kills = random.Random(args.seed).sample(range(5, args.tokens - 5), args.kills)
    with tempfile.TemporaryDirectory() as tmp:
        fleet = start_fleet(args.model, ["0:10", "10:20", "20:30"], "10:20", Path(tmp))
        try:
            model_id = next(line for line in fleet.children[1].seen if line.startswith(READY_PREFIX)).split()[2]
            runs = run_kills(fleet, model_id, prompt, args.tokens, kills)
        finally:
            fleet.stop()
    base, killed = runs[0], runs[1:]
    print(f"uninterrupted: {len(base.tokens)} tokens in {base.total_s:.1f} s (longest gap {base.gap_s * 1e3:.0f} ms)")
    print(f"{'kill at':>8} {'equal':>6} {'first diff':>10} {'failovers':>9} {'replayed':>8} {'exact?':>6} "
          f"{'gap s':>6} {'total s':>7}")
    rows = []
    for r in killed:
        diff = next((i for i, (a, b) in enumerate(zip(r.tokens, base.tokens)) if a != b), None)
        equal = r.tokens == base.tokens
        print(f"{r.kill_at:>8} {'yes' if equal else 'NO':>6} {diff if diff is not None else '-':>10} "
              f"{r.failovers:>9} {r.replayed_trips:>8} {'yes' if r.replay_exact else 'no':>6} {r.gap_s:>6.2f} "
              f"{r.total_s:>7.1f}")
        rows.append({"kill_at": r.kill_at, "equal": equal, "first_difference": diff, "failovers": r.failovers,
                     "replayed_trips": r.replayed_trips, "replay_exact": r.replay_exact,
                     "failover_gap_s": round(r.gap_s, 3), "total_s": round(r.total_s, 2)})
    equal = sum(r["equal"] for r in rows)
    print(f"{equal} of {len(rows)} killed runs equal the uninterrupted one; median failover gap "
          f"{statistics.median(r['failover_gap_s'] for r in rows):.2f} s")
    out = RESULTS / f"failover_exact{'-prefill' if args.replay == 'prefill' else ''}.json"
    out.write_text(json.dumps({
        "replay": args.replay, "tokens": args.tokens, "model": args.model.name, "machine": platform.machine(),
        "uninterrupted_s": round(base.total_s, 2), "uninterrupted_gap_s": round(base.gap_s, 3),
        "equal": equal, "runs": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
