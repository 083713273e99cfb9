"""The attacker of benchmarks/soak.py: bounded hostile traffic of every class that issue 15 fixed, against one stage,
in a process of its own (its event loop and CPU do not stall the honest clients'), until ``--seconds`` pass.

Every class runs at once, each from its own peer id (so one class's per-peer cap never throttles another), paced:

* ``fuzz``: 5 malformed frames a second (tests/hostile.py's seven kinds), one connection each, every fourth on a
  lane; every 25th frame a liveness probe (InfoRequest on a fresh stream);
* ``slowloris``: 64 idle connections on the lane port, each reopened 1 s after the stage cuts it;
* ``replay``: every 3 s, one lane hello sent on two connections at once; the lane that got ready then replays one
  of its records (and, every other round, a record of another lane is written onto it);
* ``quota``: sessions opened until the per-peer quota refuses one, left idle past the stage's idle expiry (which
  frees a session up to ``min(session_idle_s / 4, 10)`` s after ``session_idle_s`` without a step), then stepped
  (the answer must be EXPIRED); again;
* ``partial``: every 30 s, 6 lanes announce 48 MiB records (more than the 256 MiB input budget) and send 16 MiB of
  them, held 5 s;
* ``nan``: 2 sessions a second opened and stepped with NaN / +Inf / -Inf hidden states;
* ``outbox``: every 30 s, a 10 s burst of InfoRequests on a lane whose replies are never read.

What was sent and how the stage answered is counted per class; a key that starts with ``BAD`` is a defence that did
not hold. The counts go to ``--out`` as JSON every 5 s and at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import os
import random
import sys
import time
from collections import Counter
from contextlib import AsyncExitStack
from pathlib import Path

import multiaddr
import trio
from libp2p.peer.id import ID

from sangama_p2p.errors import LaneError, SangamaError
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.discovery import find_serving_peers
from sangama_p2p.net.host import open_host
from sangama_p2p.net.identity import generate_key_pair
from sangama_p2p.net.lane import open_lane
from sangama_p2p.net.logs import quiet_libp2p
from sangama_p2p.net.streams import FramedStream
from sangama_p2p.wire.codec import encode_message_frame
from sangama_p2p.wire.messages import CloseSession, InfoRequest, Step
from sangama_p2p.wire.tensor import Tensor

CLASSES = ("fuzz", "slowloris", "replay", "quota", "partial", "nan", "outbox")
MiB = 1 << 20


def load_hostile():
    """tests/hostile.py, by path (test folders are no packages)."""
    path = Path(__file__).resolve().parent.parent / "tests" / "hostile.py"
    spec = importlib.util.spec_from_file_location("sangama_hostile", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


h = load_hostile()


class Target:
    """The attacked stage as seen from one attacker node."""

    def __init__(self, node, pid: ID, addrs: list, args: argparse.Namespace, tally: Counter) -> None:
        self.node, self.pid, self.addrs, self.args, self.tally = node, pid, addrs, args, tally
        self.me = node.peer_id.to_base58()

    async def stream(self) -> FramedStream:
        return await h.raw_stage_stream(self.node, self.pid, self.addrs)

    async def lane(self):
        """A lane, or None (counted) when the stage or the slow-loris crowd refused one."""
        try:
            return await open_lane(self.node, self.pid, timeout=3.0)
        except LaneError as exc:
            self.tally[f"lane not set up: {str(exc).split(':')[0][:60]}"] += 1
            return None

    @property
    def first(self) -> bool:
        """A first stage: it takes token ids, and (before the last) a session names its next hop."""
        return self.args.start == 0

    def session(self, length: int = 16):
        msg = h.open_session(os.urandom(16), self.me, length, model_id=self.args.model_id, start=self.args.start,
                             end=self.args.end)
        # a stage before the last refuses a session without a next hop (BAD_FRAME: the soak's quota and nan opens
        # never got a session at a first stage): name the next stage, as a client's chain would
        return dataclasses.replace(msg, next_hop=self.args.next_hop) if self.args.next_hop else msg

    def step_input(self, sid: bytes, rows: int, hidden=None) -> Step:
        """A step of ``rows`` positions from 0: token ids at a first stage, ``hidden`` (zeros) at a later one."""
        if self.first and hidden is None:
            return Step(sid, 0, 0, tuple(range(1, rows + 1)), None, (), ())
        zeros = Tensor("fp32", (rows, self.args.width), bytes(4 * rows * self.args.width))
        return Step(sid, 0, 0, tuple(range(1, rows + 1)), zeros if hidden is None else hidden, (), ())


async def fuzz(t: Target, rng: random.Random) -> None:
    i = 0
    while True:
        kind = h.FUZZ_KINDS[i % len(h.FUZZ_KINDS)]
        frame = h.fuzz_frame(rng, kind, width=t.args.width)
        lane = await t.lane() if i % 4 == 3 else None
        try:
            if lane is not None:
                fs = FramedStream(lane)
                await lane.write(frame)
                if kind == "truncated":
                    await lane.sock.send_eof()
            else:
                fs = await t.stream()
                await fs.stream.write(frame)
                if kind == "truncated":
                    await fs.stream.close()
            answer = await h.answer_of(fs, 5)
            await fs.aclose()
        except (SangamaError, OSError, trio.BrokenResourceError) as exc:
            answer = f"send failed {type(exc).__name__}"
        t.tally["frames sent"] += 1
        if h.decodes(frame):  # a mutation that left a well-formed message: any answer is fair
            t.tally[f"still well-formed after the {kind} mutation, answered {answer}"] += 1
        else:
            t.tally[f"answer {answer}"] += 1
            if answer == "silent" or answer.startswith("reply:"):
                t.tally[f"BAD {kind} frame answered {answer}"] += 1
        i += 1
        if i % 25 == 0:
            try:
                fs = await t.stream()
                await fs.send(InfoRequest())
                probe = await h.answer_of(fs, 5)
                await fs.aclose()
            except SangamaError as exc:
                probe = type(exc).__name__
            t.tally["probe answered" if probe == "reply:InfoResponse" else f"BAD probe {probe}"] += 1
        await trio.sleep(0.2)


async def slowloris(t: Target, rng: random.Random) -> None:
    offer = await h.fetch_offer(t.node, t.pid)
    opened = [0]
    t.tally["connections held"] = 64
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: h.hold_idle(offer.port, 64, opened, reopen_after=1.0))
        while True:
            await trio.sleep(1)
            t.tally["connections opened"] = opened[0]


async def replay(t: Target, rng: random.Random) -> None:
    frame = encode_message_frame(InfoRequest())
    n = 0
    while True:
        await trio.sleep(3)
        n += 1
        offer = await h.fetch_offer(t.node, t.pid)
        if not hasattr(offer, "token"):
            t.tally[f"offer refused {offer.code.name}"] += 1
            continue
        try:
            ready = [lane for lane in await h.replay_hello(offer, t.pid) if lane is not None]
        except OSError as exc:
            t.tally[f"connect failed {type(exc).__name__}"] += 1
            continue
        t.tally["hellos replayed"] += 1
        t.tally[f"ready on {len(ready)} of 2 connections"] += 1
        if len(ready) > 1:
            t.tally["BAD two lanes from one hello"] += 1
        for lane in ready[:1]:
            fs = FramedStream(lane)
            if n % 2:  # the same record twice on its own lane: executed once, then the lane ends
                record = lane.seal(frame)
                await lane.write_raw(record + record)
                first, second = await h.answer_of(fs, 3), await h.answer_of(fs, 3)
                t.tally[f"record replayed on its lane: {first}, then {second}"] += 1
                if second.startswith("reply:"):
                    t.tally["BAD a replayed record was executed"] += 1
            else:  # a record sealed for another lane written onto this one
                other = await t.lane()
                if other is not None:
                    await lane.write_raw(other.seal(frame))
                    answer = await h.answer_of(fs, 3)
                    t.tally[f"record of another lane: {answer}"] += 1
                    if answer.startswith("reply:"):
                        t.tally["BAD a record crossed lanes"] += 1
                    await other.close()
        for lane in ready:
            await lane.close()


async def quota(t: Target, rng: random.Random) -> None:
    while True:
        fs = await t.stream()
        opened = []
        while True:
            msg = t.session()
            await fs.send(msg)
            answer = await h.answer_of(fs, 5)
            if answer != "reply:SessionOpened":
                break
            opened.append(msg.session_id)
            if len(opened) > 256:
                t.tally["BAD no per-peer quota"] += 1
                break
        t.tally["sessions opened"] += len(opened)
        t.tally[f"rounds: {len(opened)} opened, then {answer}"] += 1
        # left idle past the stage's expiry: it checks every min(idle_s / 4, 10) s, so a session goes up to that much
        # after idle_s without a step (+5 s for a loaded machine)
        await trio.sleep(t.args.idle_s + min(t.args.idle_s / 4, 10) + 5)
        if opened:
            await fs.send(t.step_input(opened[0], 2))
            answer = await h.answer_of(fs, 5)
            t.tally[f"idle session stepped: {answer}"] += 1
            if answer.startswith("reply:"):
                t.tally["BAD an idle session did not expire"] += 1
        await fs.aclose()


async def partial(t: Target, rng: random.Random) -> None:
    chunk = bytes(MiB)
    while True:
        lanes = [lane for lane in [await t.lane() for _ in range(6)] if lane is not None]
        took: list[int] = []

        async def one(lane) -> None:
            took.append(await h.partial_record(lane, 48 * MiB, 16 * MiB, chunk))

        async with trio.open_nursery() as nursery:
            for lane in lanes:
                nursery.start_soon(one, lane)
        t.tally["rounds"] += 1
        t.tally["lanes flooded"] += len(lanes)
        t.tally["records held (16 of 48 MiB sent)"] += sum(n > 0 for n in took)
        t.tally["lanes closed by the stage at their prefix (over the input budget)"] += sum(n < 0 for n in took)
        t.tally["MiB sent"] += sum(max(n, 0) for n in took) // MiB
        await trio.sleep(5)
        for lane in lanes:
            await lane.close()
        await trio.sleep(25)


async def nan(t: Target, rng: random.Random) -> None:
    fs = None
    values = (math.nan, math.inf, -math.inf)
    i = 0
    while True:
        await trio.sleep(0.5)
        try:
            fs = fs or await t.stream()
            msg = t.session(64)
            await fs.send(msg)
            opened = await h.answer_of(fs, 5)
            if opened != "reply:SessionOpened":
                t.tally[f"open answered {opened}"] += 1
                await fs.aclose()
                fs = None
                continue
            rows = rng.randint(1, 8)
            hidden = h.non_finite_hidden(rows, t.args.width, values[i % 3], at=rng.randrange(rows * t.args.width))
            await fs.send(t.step_input(msg.session_id, rows, hidden))
            answer = await h.answer_of(fs, 5)
            await fs.send(CloseSession(msg.session_id))
        except SangamaError as exc:
            answer = f"failed {type(exc).__name__}"
            fs = None
        i += 1
        t.tally["steps sent"] += 1
        t.tally[f"answer {answer}"] += 1
        # a later stage refuses the non-finite values; a first stage takes token ids only, so hidden states there
        # are a malformed step for that session
        if answer != ("error:BAD_FRAME" if t.first else "error:NON_FINITE"):
            t.tally[f"BAD non-finite step answered {answer}"] += 1


async def outbox(t: Target, rng: random.Random) -> None:
    while True:
        lane = await t.lane()
        if lane is not None:
            sent, closed = await h.flood_unread(lane, 10)
            t.tally["bursts"] += 1
            t.tally["requests sent, replies never read"] += sent
            t.tally["burst ended by the stage closing the lane" if closed else
                    "burst ended at 10 s (the stage stopped reading: back-pressure)"] += 1
            await lane.reset()
        await trio.sleep(20)


async def main(args: argparse.Namespace) -> None:
    tallies = {name: Counter() for name in CLASSES}
    started = [time.monotonic()]  # reset once the attack starts (after the nodes are up and the stage found)

    def dump(final: bool) -> None:
        data = {"attack_s": round(time.monotonic() - started[0], 1), "final": final,
                "classes": {k: dict(v) for k, v in tallies.items()}}
        tmp = Path(str(args.out) + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(args.out)

    keys = Path(args.keys)
    keys.mkdir(parents=True, exist_ok=True)
    async with AsyncExitStack() as stack:
        nodes = {}
        for name in CLASSES:
            cfg = HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(args.bootstrap,),
                             key_path=keys / f"attacker-{name}.key", handshake_timeout=5.0)
            nodes[name] = await stack.enter_async_context(open_host(cfg, key_pair=generate_key_pair()))
        records: list = []
        for _ in range(30):  # a lookup on a loaded machine can miss a record: look again, for up to a minute
            records = [r for r in await find_serving_peers(nodes["fuzz"], args.model_id)
                       if (r.start, r.end) == (args.start, args.end) and args.peer_id in (None, r.peer_id)]
            if records:
                break
            await trio.sleep(2)
        if not records:
            raise SystemExit(f"no peer serves {args.start}:{args.end} of {args.model_id}")
        pid, addrs = ID.from_base58(records[0].peer_id), [multiaddr.Multiaddr(a) for a in records[0].addrs]
        rng = random.Random(args.seed)
        started[0] = time.monotonic()
        with trio.move_on_after(args.seconds):
            async with trio.open_nursery() as attacks:
                for name in CLASSES:
                    t = Target(nodes[name], pid, addrs, args, tallies[name])
                    await t.node.connect(pid, addrs)
                    attacks.start_soon(_guarded, name, globals()[name], t, random.Random(rng.random()))

                async def dumper() -> None:
                    while True:
                        await trio.sleep(5)
                        dump(False)

                attacks.start_soon(dumper)
    dump(True)


async def _guarded(name: str, attack, t: Target, rng: random.Random) -> None:
    """Run one class until cancelled; an error of ours (not the stage's answer) is counted and the class restarts."""
    while True:
        try:
            await attack(t, rng)
        except (SangamaError, OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            t.tally[f"attacker error {type(exc).__name__}"] += 1
            await trio.sleep(1)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--model-id", required=True)
    p.add_argument("--start", type=int, required=True)
    p.add_argument("--end", type=int, required=True)
    p.add_argument("--width", type=int, required=True, help="the model's hidden size")
    p.add_argument("--idle-s", type=float, required=True, help="the stage's session_idle_s")
    p.add_argument("--seconds", type=float, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--keys", type=Path, required=True)
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--peer-id", default=None, help="the stage to attack (default: any peer of the range)")
    p.add_argument("--next-hop", default=None, help="the next stage's peer id (for a stage before the last)")
    quiet_libp2p()  # py-libp2p logs routine resets and DHT read failures as warnings
    trio.run(main, p.parse_args())
