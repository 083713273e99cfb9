"""The pipeline over loopback: stage peers as separate processes against the same model in one process.

    python benchmarks/pipeline.py [--model DIR] [--tokens 64] [--requests 1,4,16,48] [--guesses 0,2,4,6,auto]

Two fleets, each a bootstrap node plus stage peers started with ``sangama-peer join`` (what users run):

1. qwen3_5_moe over three stages (tiny: 0:3, 3:6, 6:8): one request's decode tokens/s at each guess count, time to
   first token, many requests at once (aggregate and per request; each request's tokens must equal its solo run),
   and where the time goes per trip. ``--model DIR``: a trained checkpoint (``benchmarks/train_tiny.py``), so that
   guesses get accepted and the guess rows measure what guessing gains over the network; without it the fleet runs
   a made model with random weights, whose guesses are all rejected (those rows then measure only their cost).
2. The Petals anchor: the tiny Llama (hidden 256, 6 layers, 4 heads, vocab 1000, intermediate 512, fp32) split 3+3
   over two stage peers, one greedy request of 64 tokens. Petals 2.2 measured 92 tokens/s = 0.17x of one process's
   538 tokens/s on this shape; our goal is >= 0.75x of one process.

The one-process numbers come from ``LocalChain`` in this process, measured before the fleet starts. Every process
runs torch with one thread (the fleet's children get OMP_NUM_THREADS=1). Prints tables and writes
benchmarks/results/pipeline.json (with the machine's load average, since other work on the machine moves numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import torch

from sangama_p2p.cli.demo import DEMO_SPLIT, demo_split, local_references, measure_network
from sangama_p2p.cli.local_fleet import LocalFleet
from sangama_p2p.cli.tables import guesses_table, print_tables, requests_table, where_time_goes_table
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model

RESULTS = Path(__file__).parent / "results"
ANCHOR_SPLIT = ("0:3", "3:6")
PETALS = {"petals_tokens_per_s": 92.0, "petals_one_process_tokens_per_s": 538.0, "petals_ratio": 0.17,
          "goal_ratio": 0.75}


def _guess_list(text: str) -> list[int | str]:
    return [t if t == "auto" else int(t) for t in text.split(",") if t.strip()]


def run_fleet(model: Path, split: tuple[str, ...], work: Path, *, guesses, requests, tokens, label) -> dict:
    t = time.perf_counter()
    refs = local_references(model, guesses=guesses, requests=requests, new_tokens=tokens)
    print(f"{label}: one-process references in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    with LocalFleet(model, split, work) as fleet:
        print(f"{label}: fleet of {len(split)} stages up in {time.perf_counter() - t:.1f} s", flush=True)
        return measure_network(model, fleet.bootstrap_addr, refs, guesses=guesses, requests=requests,
                               new_tokens=tokens, split=split, label=label)


def run_anchor(model: Path, work: Path, *, repeats: int, tokens: int = 64) -> dict:
    """The Petals anchor: one-process and network runs alternate (medians), so machine load hits both alike."""
    import statistics

    import trio

    from sangama_p2p import Peer, PeerConfig
    from sangama_p2p.client.config import ClientConfig
    from sangama_p2p.client.timing import summarize_trips
    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.spec import LayerRange
    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.identity import generate_key_pair

    ckpt = open_checkpoint(model)
    local = LocalChain.load(ckpt, [LayerRange(0, ckpt.spec.num_layers)])
    prompt = ckpt.tokenizer.encode("def fibonacci(n):")
    local.generate(prompt, 8, stop_at_eos=False)
    runs: dict[str, list] = {"local": [], "net": [], "same": [], "ttft_ms": [], "trips": []}
    with LocalFleet(model, ANCHOR_SPLIT, work) as fleet:
        config = PeerConfig(host=HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",),
                                            bootstrap_addrs=(fleet.bootstrap_addr,), dht_server=False),
                            client=ClientConfig(model_id=model.name))

        async def main() -> None:
            async with Peer(config, key_pair=generate_key_pair()) as peer:
                await peer.generate(prompt, 8, stop_at_eos=False)  # warm up route, sessions, streams
                for _ in range(repeats):
                    ref = local.generate(prompt, tokens, stop_at_eos=False)
                    net = await peer.generate(prompt, tokens, stop_at_eos=False)
                    runs["local"].append(ref.decode_tokens_per_s)
                    runs["net"].append(net.result.decode_tokens_per_s)
                    runs["same"].append(list(net.tokens) == ref.tokens)
                    runs["ttft_ms"].append(net.result.prefill_s * 1e3)
                    runs["trips"].extend(net.result.trips)

        trio.run(main)
    local_tps, net_tps = statistics.median(runs["local"]), statistics.median(runs["net"])
    # each network run is paired with the one-process run just before it: on a host whose speed drifts from second
    # to second (a shared VM), the median of the pairs' ratios is steadier than the ratio of the medians
    pair_ratio = statistics.median(n / lo for n, lo in zip(runs["net"], runs["local"]) if lo)
    print(f"anchor runs (tokens/s), one process: {[round(x, 1) for x in runs['local']]}, "
          f"network: {[round(x, 1) for x in runs['net']]}", flush=True)
    return {
        "model": "llama/tiny", "split": list(ANCHOR_SPLIT), "new_tokens": tokens, "repeats": repeats,
        "guesses": [{"guesses": 0, "tokens_per_s": round(net_tps, 2), "local_tokens_per_s": round(local_tps, 2),
                     "tokens_per_trip": 1.0, "accepted_per_trip": 0.0, "same_tokens": all(runs["same"]),
                     "ttft_ms": round(statistics.median(runs["ttft_ms"]), 2)}],
        "runs_tokens_per_s": {"one_process": [round(x, 2) for x in runs["local"]],
                              "network": [round(x, 2) for x in runs["net"]]},
        "ratio": round(pair_ratio, 3),
        "ratio_of_medians": round(net_tps / local_tps, 3) if local_tps else 0.0,
        "where_the_time_goes": summarize_trips(runs["trips"]),
        **PETALS,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None,
                   help="qwen3_5_moe checkpoint for the three-stage fleet, e.g. a trained tiny model "
                        "(default: a made model with random weights)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--requests", default="1,4,16,48")
    p.add_argument("--guesses", default="0,2,4,6,auto")
    p.add_argument("--skip-qwen", action="store_true", help="only the Petals anchor")
    p.add_argument("--anchor-repeats", type=int, default=9, help="alternating one-process/network runs (median)")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="sangama-bench-pipeline-"))
    out: dict = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                             "load_avg_before": os.getloadavg()}, "tokens": args.tokens}
    if not args.skip_qwen:
        if args.model is None:
            qwen, split, label = make_model(work / "qwen-tiny", "qwen3_5_moe", "tiny"), DEMO_SPLIT, "qwen3_5_moe/tiny"
            print("qwen3_5_moe/tiny with random weights: every guess is rejected (pass --model for a trained one)")
        else:
            qwen = args.model.resolve()
            split, label = demo_split(open_checkpoint(qwen).spec.num_layers), qwen.name
        out["qwen3_5_moe_tiny"] = run_fleet(qwen, split, work / "qwen-fleet", guesses=_guess_list(args.guesses),
                                            requests=[int(r) for r in args.requests.split(",")], tokens=args.tokens,
                                            label=label)
        out["qwen3_5_moe_tiny"].update(model=label, split=list(split))
        r = out["qwen3_5_moe_tiny"]
        print_tables(guesses_table(r["guesses"], f"{label}, 3 stages: one request by guesses per trip"),
                     requests_table(r["requests"], f"{label}, 3 stages: many requests at once"),
                     where_time_goes_table(r["where_the_time_goes"], f"{label}: where the time goes "
                                           "(0 guesses, mean per trip)"))
    llama = make_model(work / "llama-tiny", "llama", "tiny")
    anchor = run_anchor(llama, work / "llama-fleet", repeats=args.anchor_repeats)
    row = anchor["guesses"][0]
    out["petals_anchor"] = anchor
    print_tables(guesses_table(anchor["guesses"], "Petals anchor: tiny Llama 3+3 over two peers, 64 greedy tokens "
                               "(Petals 2.2: 0.17x; goal >= 0.75x)"),
                 where_time_goes_table(anchor["where_the_time_goes"], "Petals anchor: where the time goes"))
    out["machine"]["load_avg_after"] = os.getloadavg()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "pipeline.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"anchor: {row['tokens_per_s']:.1f} tokens/s over two peers vs {row['local_tokens_per_s']:.1f} in one "
          f"process (medians); median ratio of paired runs {anchor['ratio']:.2f}x (goal >= 0.75x); "
          f"wrote {RESULTS / 'pipeline.json'}")


if __name__ == "__main__":
    main()
