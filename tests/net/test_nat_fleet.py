"""Issue 13 acceptance: a home fleet. A bootstrap on a public host, three stages each behind its own port-preserving
NAT (MASQUERADE, unsolicited inbound dropped), a client behind a fourth NAT - all through the CLI only.

The first generation right after all three stages print ``ready`` must succeed, with the greedy tokens of
``generate --local``; then every stage-to-stage stream is direct (``status --json``), a second generation with 4
guesses gives the same tokens and no stage frame crosses the relay (the stages' own byte counters, both directions,
which include the client's frames). The first stage announces its NAT's WAN address without a port forward: the
dial-back finds it dead, the warning names it and the record leaves it out, and the stage serves the first
generation right after ``ready``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from .cli_fleet import PROMPT, TOKENS
from .cli_fleet import Proc as _Proc
from .cli_fleet import bootstrap as _bootstrap
from .cli_fleet import cli as _cli
from .cli_fleet import generate as _generate
from .cli_fleet import join as _join
from .cli_fleet import local_tokens as _local_tokens
from .cli_fleet import make_tiny as _make_tiny
from .cli_fleet import status as _status
from .netns import NAT_WAN_IPS, NatLab, netns_unavailable_reason

_REASON = netns_unavailable_reason()
pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

LONG = 800  # the generation during which the middle stage is killed (long enough to outlast the spare's start)


def test_three_natted_stages_and_a_natted_client_generate_right_after_ready_then_go_direct(tmp_path: Path) -> None:
    # qwen3_5_moe/tiny: 8 layers and an MTP head, so the second generation can check 4 guesses per trip
    tiny = _make_tiny(tmp_path / "tiny")
    expected_long = _local_tokens(tiny, LONG)
    expected = expected_long[:TOKENS]  # greedy: the first tokens of a longer generation
    procs: list[_Proc] = []
    with NatLab(sides="abcde") as lab:
        try:
            boot_p, boot = _bootstrap(lab, tmp_path)
            procs.append(boot_p)
            stages = []
            dead = f"/ip4/{NAT_WAN_IPS['a']}/tcp/4101"  # stage a announces its NAT's address, with no forward
            for side, layers in zip("abc", ("0:3", "3:6", "6:8")):
                extra = ["--announce", dead] if side == "a" else []
                stages.append(_join(tiny, boot, layers, tmp_path / f"{side}.key", lab.ns[f"priv{side}"], *extra))
            procs.extend(stages)
            readies = [s.wait_for("ready ", 90)[1] for s in stages]
            reach = [s.wait_for("  reachable ", 5)[0].split()[1] for s in stages]
            assert reach == ["relayed"] * 3, reach  # each is behind its NAT: reachable through its reservation
            ids = [s.wait_for("ready ", 1)[0].split()[1] for s in stages]
            t_ready = max(readies)
            t0 = time.monotonic()
            got, took, _ = _generate(tiny, boot, lab.ns["privd"], 0)  # the first generation right after ready
            assert got == expected
            print(f"\nready -> generate started {t0 - t_ready:.2f} s; first generation ({TOKENS} tokens, client "
                  f"process start included) took {took:.2f} s")
            # every stage-to-stage stream is direct (moved off the relay after its punch), within 10 s
            deadline = time.monotonic() + 10
            while True:
                before = _status(boot, lab.ns["privd"])
                links = {i: [x["link"] for x in before[i]["stage_links"] if x["dialled"]] for i in ids}
                if all(x == ["direct"] for x in list(links.values())[:2]) or time.monotonic() > deadline:
                    break
            assert [links[i] for i in ids[:2]] == [["direct"], ["direct"]], links  # stage a->b, b->c
            # the dead announced address: named in a warning, absent from the record (the stage was used at once)
            assert any(f"announced address {dead}: nobody answers there" in x for x in stages[0].err), stages[0].err
            record_addrs = [a for r in before[ids[0]]["records"] for a in r["addrs"]]
            assert record_addrs and not any(a.startswith(dead) for a in record_addrs), record_addrs
            boot_id = boot.rsplit("/p2p/", 1)[1]
            circuit0 = before[boot_id]["circuit_bytes"]
            got4, took4, res4 = _generate(tiny, boot, lab.ns["privd"], 4)
            assert got4 == expected
            # the client's own view: the stream to every stage of its chain is direct (not relayed) at the end
            assert len(res4["links"]) == 3 and all(x.startswith("direct") for x in res4["links"]), res4["links"]
            after = _status(boot, lab.ns["privd"])
            for i in ids:  # the bytes: no stage frame crossed the relay in this generation, either way
                b, a = before[i]["traffic"], after[i]["traffic"]
                assert a["relayed_in"] == b["relayed_in"] and a["relayed_out"] == b["relayed_out"], (i, b, a)
                assert a["direct_in"] > b["direct_in"] and a["direct_out"] > b["direct_out"], (i, b, a)
            print(f"second generation (4 guesses) {took4:.2f} s, decode {res4['decode_ms'] / max(1, res4['steps']):.1f} "
                  f"ms per trip; stage frames relayed 0 B; the relay carried "
                  f"{after[boot_id]['circuit_bytes'] - circuit0} B of circuit bytes in it (handshakes, identify, "
                  "DCUtR and status of the new client and status processes)")
            # the middle stage is SIGKILLed mid-generation; a spare for its range, behind a fifth NAT, starts with the
            # generation (so the client's first route uses the middle stage: the spare is not ready yet)
            gen = _Proc(_cli("generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot,
                             "--prompt-ids", PROMPT, "--max-new-tokens", str(LONG), "--ignore-eos", "--jsonl",
                             ns=lab.ns["privd"]))
            spare = _join(tiny, boot, "3:6", tmp_path / "e.key", lab.ns["prive"])
            procs.extend([gen, spare])
            spare.wait_for("ready ", 90)
            gen.wait_for('{"token"', 60)  # decoding
            streamed = sum(x.startswith('{"token"') for x in gen.lines)
            assert not any('"done"' in x for x in gen.lines), "the generation ended before the kill: make LONG longer"
            stages[1].proc.kill()  # SIGKILL: no goodbye to anyone
            done, _ = gen.wait_for('{"done"', 120)
            result = json.loads(done)
            assert gen.proc.wait(timeout=10) == 0, gen.err[-20:]
            assert result["tokens"] == expected_long
            assert result["failovers"] >= 1 and ids[1] not in result["route"], result["route"]
            print(f"middle stage killed after {streamed} of {LONG} tokens: tokens identical, failovers "
                  f"{result['failovers']}, route {[r[-6:] for r in result['route']]}")
        finally:
            for p in procs:
                p.stop()


def test_port_randomising_nats_generate_over_the_relay(tmp_path: Path) -> None:
    """``MASQUERADE --random-fully`` (carrier-grade NAT): the punch cannot predict the port, so the chain runs over
    the relay - correct tokens, links reported relayed, the relayed stage bytes counted. Prints the decode time."""
    tiny = _make_tiny(tmp_path / "tiny")
    expected = _local_tokens(tiny, TOKENS)
    procs: list[_Proc] = []
    with NatLab(sides="abc") as lab:
        lab.randomize_ports()
        try:
            boot_p, boot = _bootstrap(lab, tmp_path)
            procs.append(boot_p)
            stages = [_join(tiny, boot, layers, tmp_path / f"{side}.key", lab.ns[f"priv{side}"])
                      for side, layers in (("a", "0:4"), ("b", "4:8"))]
            procs.extend(stages)
            for s in stages:
                s.wait_for("ready ", 90)
            ids = [s.wait_for("ready ", 1)[0].split()[1] for s in stages]
            got, took, result = _generate(tiny, boot, lab.ns["privc"], 0)
            assert got == expected
            status = _status(boot, lab.ns["privc"])
            first = [x["link"] for x in status[ids[0]]["stage_links"] if x["dialled"]]
            assert first and all(x.startswith("relayed via") for x in first), first  # no punch through these NATs
            traffic = status[ids[0]]["traffic"]
            assert traffic["relayed_out"] > 0 and traffic["direct_out"] == 0, traffic
            print(f"\nrandom-fully NATs: {TOKENS} tokens over the relay in {took:.2f} s (client process included), "
                  f"decode {result['decode_ms'] / max(1, result['steps']):.1f} ms per token; stage a sent "
                  f"{traffic['relayed_out']} B of stage frames relayed, 0 direct")
        finally:
            for p in procs:
                p.stop()
