"""What the HTTP API adds: per-token decode time and time to first token, streamed over HTTP vs. ``generate`` on the
same client, over 3 stage processes on loopback (the tiny model).

    python benchmarks/api_latency.py [--tokens 64] [--runs 5] [--json benchmarks/results/api_latency.json]

One trio process holds the client peer, the API server (``Peer.serve_api``) and an httpx client streaming
``/v1/completions``; the two paths alternate run by run, greedy, no guesses, same prompt. "direct" times each token
as ``Peer.generate``'s ``on_tokens`` sees it; "http" as the SSE chunk arrives at the HTTP client.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import httpx
    import trio

    from sangama_p2p.api import ApiConfig
    from sangama_p2p.cli.local_fleet import LocalFleet
    from sangama_p2p.client.config import ClientConfig
    from sangama_p2p.model.make import make_model
    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.identity import generate_key_pair
    from sangama_p2p.peer import Peer, PeerConfig

    work = Path(tempfile.mkdtemp(prefix="sangama-api-bench-"))
    model = make_model(work / "made", "qwen3_5_moe", "tiny", seed=4)
    prompt = list(range(5, 17))

    def per_token(stamps: list[float]) -> float:
        return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3

    with LocalFleet(model, ["0:3", "3:6", "6:8"], work / "fleet") as fleet:
        async def run() -> dict:
            host = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(fleet.bootstrap_addr,),
                              dht_server=False)
            config = PeerConfig(host=host, client=ClientConfig(model_id="made"))
            out: dict = {"direct": [], "http": []}
            async with Peer(config, key_pair=generate_key_pair()) as peer:
                url = await peer.serve_api(model, ApiConfig(port=0))
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    for i in range(args.runs + 1):  # the first round warms both paths up and is not counted
                        t0 = time.perf_counter()
                        stamps: list[float] = []
                        await peer.generate(prompt, args.tokens, stop_at_eos=False,
                                            on_tokens=lambda new: stamps.extend([time.perf_counter()] * len(new)))
                        direct = (stamps[0] - t0, per_token(stamps), len(stamps))
                        body = {"model": "made", "prompt": prompt, "max_tokens": args.tokens, "temperature": 0,
                                "stream": True, "guesses": 0}
                        t0 = time.perf_counter()
                        stamps = []
                        async with http.stream("POST", "/v1/completions", json=body) as res:
                            async for line in res.aiter_lines():
                                if line.startswith("data: {"):
                                    chunk = json.loads(line[6:])
                                    n = len(chunk["choices"][0]["token_ids"]) if chunk["choices"] else 0
                                    stamps.extend([time.perf_counter()] * n)
                        over = (stamps[0] - t0, per_token(stamps), len(stamps))
                        if i:
                            out["direct"].append(direct)
                            out["http"].append(over)
            return out

        out = trio.run(run)
    rows = {}
    for name, runs in out.items():
        rows[name] = {"ttft_ms": round(statistics.median(r[0] for r in runs) * 1e3, 2),
                      "ms_per_token": round(statistics.median(r[1] for r in runs), 3),
                      "tokens": [r[2] for r in runs]}
    added = rows["http"]["ms_per_token"] / rows["direct"]["ms_per_token"] - 1
    print(f"{'path':8} {'TTFT ms':>9} {'ms/token':>9}   (median of {args.runs} runs, {args.tokens} tokens)")
    for name, row in rows.items():
        print(f"{name:8} {row['ttft_ms']:9.2f} {row['ms_per_token']:9.3f}")
    print(f"the API adds {added * 100:+.1f}% per token, "
          f"{rows['http']['ttft_ms'] - rows['direct']['ttft_ms']:+.2f} ms to the first token")
    if args.json:
        args.json.write_text(json.dumps({"tokens": args.tokens, "runs": args.runs, **rows,
                                         "added_per_token": round(added, 4)}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
