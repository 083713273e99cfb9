"""What a survey costs while a layer range is served by nobody (issue 25): the walk past the gap against the
enumeration of every provider, which is what a survey did whenever the walk reached no end of the model.

For each ``--peers N``: a bootstrap DHT server and N peers on loopback in this process (each a DHT server, as a
public peer is), half announcing 0:3 and half 5:8 of an 8-layer model (3:5: nobody), then a fresh client host
surveys ``--repeats`` times each way, alternating: ``walk`` (``find_serving_peers`` as a client's survey makes it
now: the directories from layer 0, past the gap a lookup per layer) and ``enumerate`` (``walk=False``: the provider
key, then every provider's record, asked of the provider itself first). Per survey: the distinct peers it asked
(DHT servers and providers: ``SurveyFacts.contacted``), its directory lookups, and its wall time. No stage runs:
the records are what is surveyed (a client then probes the candidates it keeps, at most 6 a range).

    python benchmarks/gap_survey.py --peers 20 40 80 --repeats 3 --json benchmarks/results/gap_survey.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import uuid
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.discovery import Announcer, ServingOffer, SurveyFacts, find_serving_peers
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair

HERE = Path(__file__).resolve().parent
RANGES = [(0, 3), (5, 8)]  # 3:5 is the gap
LAYERS = 8
FP = "ab" * 16


def _config(keys: Path, **changes: object) -> HostConfig:
    base = {"listen_addrs": ("/ip4/127.0.0.1/tcp/0",), "handshake_timeout": 10.0,
            "key_path": keys / f"{uuid.uuid4().hex}.key"}
    base.update(changes)
    return HostConfig(**base)  # type: ignore[arg-type]


async def _one_size(n: int, repeats: int, keys: Path) -> dict:
    async with AsyncExitStack() as stack:
        boot = await stack.enter_async_context(open_host(_config(keys), key_pair=generate_key_pair()))
        addr = str(boot.advertised_addrs()[0])
        t0 = time.monotonic()
        peers = []
        for i in range(n):
            node = await stack.enter_async_context(
                open_host(_config(keys, bootstrap_addrs=(addr,)), key_pair=generate_key_pair()))
            lo, hi = RANGES[i % len(RANGES)]
            await Announcer(node).update(ServingOffer("m", lo, hi, 1.0 + i, 1, ttl=600, fingerprint=FP,
                                                      num_layers=LAYERS))
            peers.append(node)
        up_s = time.monotonic() - t0
        client = await stack.enter_async_context(
            open_host(_config(keys, bootstrap_addrs=(addr,), dht_server=False), key_pair=generate_key_pair()))
        runs: dict[str, list[dict]] = {"walk": [], "enumerate": []}
        for _ in range(repeats):
            for way in ("walk", "enumerate"):
                facts = SurveyFacts()
                s0 = time.monotonic()
                found = await find_serving_peers(client, "m", facts=facts, num_layers=LAYERS, walk=way == "walk")
                runs[way].append({"asked": len(facts.contacted), "lookups": facts.directories,
                                  "records": facts.records, "found": len(found),
                                  "ranges": sorted({(r.start, r.end) for r in found}),
                                  "s": round(time.monotonic() - s0, 3)})
        return {"peers": n, "swarm_up_s": round(up_s, 1), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, nargs="+", default=[20, 40, 80])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=str(HERE / "results" / "gap_survey.json"))
    args = ap.parse_args()
    keys = Path(tempfile.mkdtemp(prefix="sangama-gap-keys-"))
    started = time.time()
    sizes = [trio.run(_one_size, n, args.repeats, keys) for n in args.peers]
    print(f"{'peers':>6} | {'way':>9} | {'peers asked (median, max)':>26} | {'lookups':>7} | {'records':>7} | "
          f"{'candidates':>10} | {'ranges found':>14} | {'seconds (median)':>16}")
    for size in sizes:
        for way, runs in size["runs"].items():
            asked = [r["asked"] for r in runs]
            print(f"{size['peers']:>6} | {way:>9} | {statistics.median(asked):>18} ({max(asked):>4}) | "
                  f"{runs[0]['lookups']:>7} | {runs[0]['records']:>7} | {runs[0]['found']:>10} | "
                  f"{' '.join(f'{a}:{b}' for a, b in runs[0]['ranges']):>14} | "
                  f"{statistics.median(r['s'] for r in runs):>16}")
    out = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)), "load": list(os.getloadavg()[:2]),
           "seconds": round(time.time() - started, 1), "layers": LAYERS, "ranges": RANGES, "sizes": sizes}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
