"""Soak (issue 15's last acceptance): honest generations through a stage that takes mixed hostile traffic for
``--minutes`` (default 30), over loopback. A benchmark script, not a CI test.

What it does:

1. makes the tiny Qwen3.5-MoE model (``make_model``, vocabulary cut to 16 so MTP guesses are often accepted) and the
   one-process reference tokens of 4 prompts (``LocalChain``, batch-invariant, 2 guesses);
2. starts a loopback fleet of real ``sangama-peer`` processes (``cli/local_fleet.py``): a bootstrap node and stages
   0:4 and 4:8, ``--batch-invariant`` (a request's numbers do not depend on its batch) and a ``--config`` that sets
   ``session_idle_s`` (default 30 s, so that idle expiry happens within minutes) and ``outbox_bytes`` (8 MiB, so
   one 10 s burst of unread replies reaches the bound); every other bound is the stage default;
3. runs 4 honest clients (one node each, in this process), each generating its prompt in a loop with a fresh
   ``ChainClient`` (new links and lanes) every 5 generations; the solo tokens of each prompt, generated once alone
   before anything else runs, are the tokens every later generation must give;
4. after ``--quiet-s`` of honest traffic alone, starts benchmarks/soak_attacks.py (a process per stage) against
   the first stage 0:4 and the last 4:8 (``--attack``) for the whole soak: fuzzed frames, idle connections on the lane
   port, lane handshake replays, sessions to the per-peer quota left idle, partial-record floods, NaN/Inf hidden
   states, replies never read (see that file); and benchmarks/soak_liars.py (unless ``--no-liars``): stages that
   lie - a constant liar that rejoins under a fresh key, one honest only on the first step, a noisy first stage,
   colluders framing the attacked stages, another checkpoint under the model id, a depth liar (see that file).
   With liars the fleet has ``--spares`` more honest peers per range (what a ban needs: a referee at every other
   range), and the honest clients pin the checkpoint, verify ``--verify`` of their trips and keep bans in a file
   each (as the CLI does);
5. samples both stages' RSS (``VmRSS`` of ``/proc/<pid>/status``) every 2 s, and checks they are the same pids;
6. after the attack, keeps the honest clients going until the attacked stage's RSS is within 10% of its baseline
   (at most 60 s), then prints a table and writes JSON (``--json``, default benchmarks/results/soak.json).

Exit status 1 when an honest generation gave other tokens, more than 1% of them failed, an honest peer was banned,
a stage died or restarted, or an attack or liar class counted a defence that did not hold (a ``BAD`` key); 0
otherwise.

    python benchmarks/soak.py --minutes 3 --json benchmarks/results/soak_3min.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import trio

from sangama_p2p.cli.local_fleet import LocalFleet

HERE = Path(__file__).resolve().parent
SPLIT = ["0:4", "4:8"]
ATTACK = "0:4,4:8"  # the stages attacked by default: the first (token ids in) and the last (hidden states in)
PROMPTS = [[1, 5, 9, 2, 7, 3], [2, 7, 1, 8, 2, 8], [3, 1, 4, 1, 5, 9, 2], [6, 2, 8, 3, 1]]
FRESH_EVERY = 5
MiB = 1 << 20


def rss_of(pid: int) -> int | None:
    """Resident bytes of ``pid`` (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def make_fleet_model(workdir: Path, seed: int = 4) -> Path:
    from sangama_p2p.model.make import make_model, truncate_vocab

    src = make_model(workdir / "made", "qwen3_5_moe", "tiny", seed=seed)
    return truncate_vocab(src, workdir / "sangama-soak-tiny", 16)


def references(model_dir: Path, tokens: int, guesses: int) -> list[list[int]]:
    import torch

    from sangama_p2p.model.chain import LocalChain
    from sangama_p2p.model.checkpoint import open_checkpoint
    from sangama_p2p.model.spec import LayerRange

    torch.set_num_threads(1)
    ranges = [LayerRange(*map(int, r.split(":"))) for r in SPLIT]
    chain = LocalChain.load(open_checkpoint(model_dir), ranges, batch_invariant=True)
    return [chain.generate(p, tokens, guesses=guesses).tokens for p in PROMPTS]


class Honest:
    """The 4 honest clients' generations: (client, phase, start, end, new tokens, outcome) rows."""

    def __init__(self, model_id: str, tokens: int, guesses: int, pin: tuple[str, int] | None = None,
                 verify: float = 0.0, bans_dir: Path | None = None) -> None:
        self.model_id, self.tokens, self.guesses = model_id, tokens, guesses
        self.pin, self.verify, self.bans_dir = pin, verify, bans_dir
        self.banned: dict[str, str] = {}  # peer id -> reason, of every ban an honest client made
        self.unverified = 0  # trips drawn for a check that could not be checked
        self.want: list[list[int]] = []
        self.rows: list[dict] = []
        self.phase = "quiet"
        self.stop = False
        self.links: Counter = Counter()  # link kinds of fresh clients to the stages

    def config(self, i: int):
        from sangama_p2p.client import ClientConfig

        fp, layers = self.pin or (None, None)
        bans = self.bans_dir / f"bans-{i}.json" if self.bans_dir is not None else None
        return ClientConfig(self.model_id, fingerprint=fp, num_layers=layers, verify=self.verify, bans_file=bans,
                            step_timeout=30)

    async def generate(self, client, i: int) -> tuple[list[int] | None, str, int, int]:
        try:
            res = await client.generate(PROMPTS[i], self.tokens, guesses=self.guesses)
        except Exception as exc:  # noqa: BLE001 - every failure of an honest generation is counted and reported
            return None, f"{type(exc).__name__}: {str(exc)[:1000]}", 0, 0
        self.unverified += res.unverified_trips or 0
        return res.tokens, "", res.failovers, res.unverified_trips or 0

    async def loop(self, node, i: int) -> None:
        from sangama_p2p.client import ChainClient

        while not self.stop:
            async with ChainClient(node, self.config(i)) as client:
                for n in range(FRESH_EVERY):
                    if self.stop:
                        break
                    if n == 1:  # what the first generation of this fresh client set up: lanes, or libp2p streams
                        self.links.update(link.fs.link_kind for link in client.pool.links.values())
                    phase, t0 = self.phase, time.monotonic()
                    tokens, error, failovers, unverified = await self.generate(client, i)
                    outcome = "failed" if error else ("ok" if tokens == self.want[i] else "wrong")
                    self.rows.append({"client": i, "phase": phase, "start": t0, "end": time.monotonic(),
                                      "tokens": len(tokens or ()), "outcome": outcome, "error": error,
                                      "failovers": failovers, "unverified_trips": unverified})
                    if outcome != "ok":  # said at once too: a long run's failures are read while it goes on
                        said = f" ({unverified} trips said unverified)" if outcome == "wrong" else ""
                        print(f"  client {i}: generation {outcome} at {phase}{said}: {error or tokens}", flush=True)
                    if error:
                        await trio.sleep(0.5)
                self.banned.update(client.verification.bans.reasons())


def _tps(rows: list[dict], lo: float, hi: float) -> dict:
    inside = [r for r in rows if lo <= r["end"] < hi]
    span = max(hi - lo, 1e-9)
    return {"from_s": round(lo, 1), "to_s": round(hi, 1), "generations": len(inside),
            "ok": sum(r["outcome"] == "ok" for r in inside), "not_ok": sum(r["outcome"] != "ok" for r in inside),
            "tokens_per_s": round(sum(r["tokens"] for r in inside if r["outcome"] == "ok") / span, 1)}


async def soak(args: argparse.Namespace, fleet: LocalFleet, honest: Honest, model_dir: Path, width: int) -> dict:
    from sangama_p2p.net.config import HostConfig
    from sangama_p2p.net.host import open_host
    from sangama_p2p.net.identity import generate_key_pair

    procs = [c.proc for c in fleet.children[1:]]
    pids = [p.pid for p in procs]
    samples: list[tuple[float, str, list[int | None], float]] = []  # (t, phase, rss per stage, load)
    t0 = time.monotonic()

    def sample() -> list[int | None]:
        rss = [rss_of(pid) if p.poll() is None else None for pid, p in zip(pids, procs)]
        samples.append((time.monotonic() - t0, honest.phase, rss, os.getloadavg()[0]))
        return rss

    async def sampler() -> None:
        while True:
            sample()
            await trio.sleep(2)

    async with AsyncExitStack() as stack:
        nodes = []
        for i in range(len(PROMPTS)):
            cfg = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(fleet.bootstrap_addr,),
                             key_path=Path(args.workdir) / f"honest{i}.key", handshake_timeout=5.0)
            nodes.append(await stack.enter_async_context(open_host(cfg, key_pair=generate_key_pair())))
        from sangama_p2p.client import ChainClient

        for i, node in enumerate(nodes):  # the solo tokens: each prompt alone, before anything else runs
            async with ChainClient(node, honest.config(i).replace(verify=0.0)) as client:
                tokens, error, _, _ = await honest.generate(client, i)
                if tokens is None:
                    raise SystemExit(f"the solo generation of prompt {i} failed: {error}")
                honest.want.append(tokens)
        await trio.sleep(2)
        baseline = [statistics.median(x) for x in zip(*[[v or 0 for v in sample()] for _ in range(3)])]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler)
            for i, node in enumerate(nodes):
                nursery.start_soon(honest.loop, node, i)
            await trio.sleep(args.quiet_s)
            attack_at = time.monotonic() - t0
            honest.phase = "attack"
            outs, attackers = {}, []
            for k in args.attacked:  # one attacker process per stage, every class at once against each
                start, end = SPLIT[k].split(":")
                outs[k] = Path(args.workdir) / f"attacks-{k}.json"
                cmd = [sys.executable, str(HERE / "soak_attacks.py"), "--bootstrap", fleet.bootstrap_addr,
                       "--model-id", honest.model_id, "--start", start, "--end", end, "--width", str(width),
                       "--idle-s", str(args.idle_s), "--seconds", str(args.minutes * 60), "--out", str(outs[k]),
                       "--keys", str(Path(args.workdir) / f"attacker-keys-{k}"), "--peer-id", fleet.stage_ids[k]]
                if k + 1 < len(SPLIT):  # a stage before the last: its sessions name the next stage
                    cmd += ["--next-hop", fleet.stage_ids[k + 1]]
                with open(Path(args.workdir) / f"attacks-{k}.log", "wb") as log:
                    attackers.append(await trio.lowlevel.open_process(cmd, stdout=log, stderr=subprocess.STDOUT))
            if args.liars:  # the liars, in a process of their own, for as long as the attack
                cmd = [sys.executable, str(HERE / "soak_liars.py"), "--bootstrap", fleet.bootstrap_addr,
                       "--model", str(model_dir), "--other", str(args.other), "--model-id", honest.model_id,
                       "--beside0", fleet.stage_ids[0], "--beside1", fleet.stage_ids[1],
                       "--seconds", str(args.minutes * 60), "--rekey-s", str(args.rekey_s),
                       "--out", str(Path(args.workdir) / "liars.json"), "--keys", str(Path(args.workdir) / "liar-keys")]
                with open(Path(args.workdir) / "liars.log", "wb") as log:
                    attackers.append(await trio.lowlevel.open_process(cmd, stdout=log, stderr=subprocess.STDOUT))
            last_print = 0.0
            while any(a.poll() is None for a in attackers):
                await trio.sleep(1)
                if time.monotonic() - t0 - last_print >= 60:
                    last_print = time.monotonic() - t0
                    print(_progress(honest, samples, last_print, args.attacked), flush=True)
                if any(p.poll() is not None for p in procs):
                    for a in attackers:
                        a.kill()
                    break
            for a in attackers:
                await a.wait()
            attack_end = time.monotonic() - t0
            honest.phase = "recovery"
            back_after = None
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rss = sample()
                if all(rss[k] is not None and rss[k] <= 1.1 * baseline[k] for k in args.attacked):
                    back_after = round(time.monotonic() - t0 - attack_end, 1)
                    break
                await trio.sleep(2)
            await trio.sleep(max(0.0, 10 - (time.monotonic() - t0 - attack_end)))  # some recovery generations
            honest.stop = True
            with trio.move_on_after(60):
                await _wait_stopped(nursery)
            nursery.cancel_scope.cancel()
    attacks: dict = {"classes": {}, "attack_s": None}
    for k, out in outs.items():  # the classes of each stage's attacker, named "RANGE class"
        got = json.loads(out.read_text()) if out.exists() else {"classes": {}, "missing": True}
        attacks["classes"].update({f"{SPLIT[k]} {cls}": tally for cls, tally in got.get("classes", {}).items()})
        attacks["attack_s"] = attacks["attack_s"] or got.get("attack_s")
        attacks["missing"] = attacks.get("missing") or got.get("missing", False)
    if args.liars:  # the liars' classes, named "liar NAME"
        out = Path(args.workdir) / "liars.json"
        got = json.loads(out.read_text()) if out.exists() else {"classes": {}, "missing": True}
        attacks["classes"].update({f"liar {cls}": tally for cls, tally in got.get("classes", {}).items()})
        attacks["missing"] = attacks.get("missing") or got.get("missing", False)
    honest_ids = {pid: name for pid, name in zip(fleet.stage_ids, fleet.layers)}
    attacks["honest_banned"] = {f"{honest_ids[p]} {p}": why for p, why in honest.banned.items() if p in honest_ids}
    rcs = [a.returncode for a in attackers]
    return _result(args, honest, samples, baseline, attack_at, attack_end, back_after, attacks, pids, procs,
                   next((rc for rc in rcs if rc not in (0, None)), 0), t0)


async def _wait_stopped(nursery: trio.Nursery) -> None:
    """Wait for the honest loops to finish their current generation (the sampler is the one task left)."""
    while len(nursery.child_tasks) > 1:
        await trio.sleep(0.2)


def _progress(honest: Honest, samples: list, t: float, attacked: list[int]) -> str:
    c = Counter(r["outcome"] for r in honest.rows)
    rss = " ".join(f"{SPLIT[k]} {(samples[-1][2][k] or 0) / MiB:.0f}" for k in attacked) if samples else "-"
    return (f"  {t:6.0f} s  honest ok {c['ok']} wrong {c['wrong']} failed {c['failed']}  attacked stages' RSS "
            f"(MiB) {rss}  load {os.getloadavg()[0]:.1f}")


def _rss_stats(values: list[int], baseline: float) -> dict:
    return {"baseline": round(baseline / MiB, 1), "min": round(min(values) / MiB, 1),
            "median": round(statistics.median(values) / MiB, 1), "max": round(max(values) / MiB, 1)}


def _result(args, honest: Honest, samples, baseline, attack_at, attack_end, back_after, attacks, pids, procs,
            attacker_rc, t0) -> dict:
    rows = [{**r, "start": r["start"] - t0, "end": r["end"] - t0} for r in honest.rows]
    span = attack_end - attack_at
    width = max(30.0, span / 10)
    windows, lo = [], attack_at
    while lo < attack_end - 1:
        windows.append(_tps(rows, lo, min(lo + width, attack_end)))
        lo += width
    rss = {}
    for k, name in enumerate(SPLIT):
        during = [s[2][k] for s in samples if s[1] == "attack" and s[2][k] is not None]
        final = next((s[2][k] for s in reversed(samples) if s[2][k] is not None), None)
        rss[name] = {**(_rss_stats(during, baseline[k]) if during else {}),
                     "final": round((final or 0) / MiB, 1),
                     "final_vs_baseline_pct": round(100 * ((final or 0) / max(baseline[k], 1) - 1), 1)}
    for k in args.attacked:
        rss[SPLIT[k]]["back_within_10pct_s_after_attack"] = back_after
    alive = [p.poll() is None for p in procs]
    bad = {f"{cls}: {k}": v for cls, tally in attacks.get("classes", {}).items() for k, v in tally.items()
           if k.startswith("BAD")}
    outcome = Counter(r["outcome"] for r in rows)
    errors = Counter(r["error"] for r in rows if r["error"])
    loads = [s[3] for s in samples]
    reasons = []
    if outcome["wrong"]:
        reasons.append(f"{outcome['wrong']} honest generations gave other tokens")
    if outcome["failed"] > 0.01 * max(len(rows), 1):
        reasons.append(f"{outcome['failed']} of {len(rows)} honest generations failed (over 1%)")
    if attacks.get("honest_banned"):
        reasons.append(f"honest peers were banned: {attacks['honest_banned']}")
    if not all(alive):
        reasons.append("a stage died: " + ", ".join(f"{n} pid {p}" for n, p, a in zip(args.stage_names, pids, alive)
                                                    if not a))
    reasons += [f"defence did not hold: {k} x{v}" for k, v in bad.items()]
    if attacks.get("missing") or attacker_rc not in (0, None):
        reasons.append(f"an attacker did not finish cleanly (exit {attacker_rc}; see attacks-K.log)")
    return {
        "measured_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "minutes": args.minutes,
        "cores": os.cpu_count(), "load_avg": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)},
        "split": SPLIT, "attacked": [SPLIT[k] for k in args.attacked], "pids": dict(zip(SPLIT, pids)),
        "stage_config": {"session_idle_s": args.idle_s, "outbox_bytes": args.outbox_mib * MiB,
                         "batch_invariant": True, "other bounds": "stage defaults"},
        "honest": {"clients": len(PROMPTS), "tokens_per_generation": args.tokens, "guesses": args.guesses,
                   "verify": honest.verify, "unverified_trips": honest.unverified,
                   "bans": len(honest.banned), "honest_banned": attacks.get("honest_banned", {}),
                   "solo_equals_local_chain": honest.want == args.refs, "generations": len(rows), **outcome,
                   "failovers": sum(r["failovers"] for r in rows), "errors": dict(errors),
                   "links_of_fresh_clients": dict(honest.links),
                   "quiet": _tps(rows, 0, attack_at) | {"from_s": 0}, "attack_windows": windows,
                   "recovery": _tps(rows, attack_end, max((r["end"] for r in rows), default=attack_end) + 1e-3)},
        "attack_s": attacks.get("attack_s"), "attacker_process_s": round(span, 1),
        "attacks": attacks.get("classes", {}), "stage_logs": _logs(Path(args.workdir) / "fleet"),
        "rss_mib": rss, "restarts": {n: 0 if a else None for n, a in zip(SPLIT, alive)},
        "ok": not reasons, "reasons": reasons,
    }


def _logs(folder: Path) -> dict:
    """Lines and tracebacks in each stage's stderr (the CLI prints warnings and errors there)."""
    out = {}
    for k, name in enumerate(SPLIT):
        path = folder / f"stage{k}.stderr"
        text = path.read_text(errors="replace") if path.exists() else ""
        out[name] = {"lines": len(text.splitlines()), "tracebacks": text.count("Traceback")}
    return out


def print_report(r: dict) -> None:
    h = r["honest"]
    print(f"\nsoak: {(r['attack_s'] or 0) / 60:.1f} min of attack on stages {', '.join(r['attacked'])} "
          f"({r['measured_at']}, "
          f"{r['cores']} cores, load {r['load_avg']['median']:.1f} median / {r['load_avg']['max']:.1f} max)")
    print(f"honest: {h['generations']} generations by {h['clients']} clients, {h.get('ok', 0)} ok, "
          f"{h.get('wrong', 0)} wrong tokens, {h.get('failed', 0)} failed, {h['failovers']} failovers; "
          f"solo tokens equal the local chain: {'yes' if h['solo_equals_local_chain'] else 'NO'}")
    print(f"honest verification: --verify {h['verify']}, {h['unverified_trips']} trips drawn and not checkable, "
          f"{h['bans']} peers banned, of them honest: {h['honest_banned'] or 'none'}")
    print(f"honest links set up by fresh clients: {h['links_of_fresh_clients']}")
    for e, n in h["errors"].items():
        print(f"  failed x{n}: {e}")
    print("\n| window | generations | ok | tokens/s (honest, all 4) |\n|---|---|---|---|")
    for label, w in [("quiet", h["quiet"]), *[("attack", w) for w in h["attack_windows"]], ("recovery", h["recovery"])]:
        print(f"| {label} {w['from_s']:.0f}-{w['to_s']:.0f} s | {w['generations']} | {w['ok']} | {w['tokens_per_s']} |")
    print("\n| attack class | sent, and how the stage answered |\n|---|---|")
    for cls, tally in r["attacks"].items():
        print(f"| {cls} | " + "; ".join(f"{k}: {v}" for k, v in sorted(tally.items())) + " |")
    print("\n| stage | RSS baseline MiB | min | median | max (during attack) | final | final vs baseline |")
    print("|---|---|---|---|---|---|---|")
    for name, s in r["rss_mib"].items():
        print(f"| {name}{' (attacked)' if name in r['attacked'] else ''} | {s.get('baseline')} | {s.get('min')} | "
              f"{s.get('median')} | {s.get('max')} | {s['final']} | {s['final_vs_baseline_pct']:+.1f}% |")
    back = r["rss_mib"][r["attacked"][0]]["back_within_10pct_s_after_attack"]
    print(f"attacked stages' RSS back within 10% of baseline: "
          f"{'%s s after the attack' % back if back is not None else 'NOT within 60 s'}")
    print(f"stage restarts (same pids, alive): {r['restarts']}; stage stderr: {r['stage_logs']}")
    print("verdict: " + ("PASS" if r["ok"] else "FAIL: " + "; ".join(r["reasons"])))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="length of the attack (default 30)")
    p.add_argument("--quiet-s", type=float, default=20.0, help="honest traffic alone before the attack (default 20)")
    p.add_argument("--tokens", type=int, default=24, help="new tokens per honest generation (default 24)")
    p.add_argument("--guesses", type=int, default=2, help="guesses per honest trip (default 2)")
    p.add_argument("--idle-s", type=float, default=30.0, help="the stages' session_idle_s (default 30)")
    p.add_argument("--outbox-mib", type=int, default=8, help="the stages' outbox_bytes in MiB (default 8)")
    p.add_argument("--attack", default=ATTACK, help=f"the stages attacked, each by its own attacker process "
                   f"(default {ATTACK}: the first stage and the last)")
    p.add_argument("--liars", action=argparse.BooleanOptionalAction, default=True,
                   help="also run benchmarks/soak_liars.py's lying stages (default on)")
    p.add_argument("--spares", type=int, default=2, help="more honest peers per range with liars (default 2)")
    p.add_argument("--verify", type=float, default=1.0, help="the honest clients' --verify with liars (default 1)")
    p.add_argument("--rekey-s", type=float, default=120.0, help="the constant liar's life under one key (default 120)")
    p.add_argument("--json", type=Path, default=HERE / "results" / "soak.json")
    p.add_argument("--workdir", type=Path, default=None, help="model, keys and logs (default: a temp dir)")
    args = p.parse_args()
    args.attacked = [SPLIT.index(r) for r in args.attack.split(",")]  # ValueError: not a stage of SPLIT
    from sangama_p2p.net.logs import quiet_libp2p

    quiet_libp2p()  # py-libp2p logs routine resets and DHT read failures as warnings
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="sangama-soak-"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    print(f"soak: workdir {args.workdir}, load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores", flush=True)
    model_dir = make_fleet_model(args.workdir)
    args.refs = references(model_dir, args.tokens, args.guesses)
    from sangama_p2p.model.checkpoint import open_checkpoint

    width = open_checkpoint(model_dir).spec.hidden_size
    pin, layers = None, list(SPLIT)
    if args.liars:
        from sangama_p2p.model.fingerprint import checkpoint_identity

        args.other = make_fleet_model(args.workdir / "other", seed=5)  # another checkpoint, the same model id
        ident = checkpoint_identity(model_dir)
        pin, layers = (ident.fingerprint, ident.num_layers), SPLIT + SPLIT * args.spares
    toml = args.workdir / "stage.toml"
    toml.write_text(f'[stage]\nmodel = "{model_dir}"\nsession_idle_s = {args.idle_s}\n'
                    f"outbox_bytes = {args.outbox_mib * MiB}\n")
    args.stage_names = layers
    honest = Honest(model_dir.name, args.tokens, args.guesses, pin, args.verify if args.liars else 0.0,
                    args.workdir if args.liars else None)
    join_args = ["--config", str(toml), "--batch-invariant", "--threads", "1"]
    with LocalFleet(model_dir, layers, args.workdir / "fleet", join_args=join_args) as fleet:
        print(f"fleet up: stages {', '.join(SPLIT)} (pids {', '.join(map(str, fleet.pids()[1:]))}); attacking "
              f"{args.attack} for {args.minutes:g} min after {args.quiet_s:g} s of honest traffic", flush=True)
        result = trio.run(soak, args, fleet, honest, model_dir, width)
    print_report(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"results: {args.json}")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
