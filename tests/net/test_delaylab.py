"""The delay lab (``delaylab.py``): namespaces at a configured distance through a userspace router over TUN devices.

Pings between near and far hosts take at least the configured round trip and keep its order; a host's rate limit
caps a TCP transfer and a burst beyond its queue is dropped at the tail; and a real Sangama fleet across the lab
(bootstrap, two stages 40 ms apart, a client) gives ``generate --local``'s tokens at a decode time per token no
shorter than the chain's configured trip. Exact timings: ``benchmarks/delaylab.py``.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from .delaylab import DelayLab, _pair_rtt, delaylab_unavailable_reason

_REASON = delaylab_unavailable_reason()


def test_every_pair_needs_a_round_trip_and_a_host_pair_wins_over_its_regions() -> None:
    hosts = {"a": "eu", "b": "eu", "c": "us"}
    with pytest.raises(ValueError, match=r"no round trip for a \(eu\) - b \(eu\)"):
        DelayLab(hosts, rtt_ms={("eu", "us"): 80})
    with pytest.raises(ValueError, match="rate_mbit names hosts"):
        DelayLab(hosts, rtt_ms={("eu", "eu"): 2, ("eu", "us"): 80}, rate_mbit={"d": 1})
    with pytest.raises(ValueError, match="two different round trips"):
        DelayLab(hosts, rtt_ms={("eu", "eu"): 2, ("eu", "us"): 80, ("us", "eu"): 40})
    rtt = {("eu", "eu"): 2, ("us", "eu"): 80, ("c", "b"): 30}
    assert _pair_rtt(hosts, rtt, "a", "c") == 80  # region pairs are unordered
    assert _pair_rtt(hosts, rtt, "b", "c") == 30  # so are host pairs, and they win
    lab = DelayLab(hosts, rtt_ms=rtt)
    assert lab.rtt_ms("a", "b") == 2 and lab.rtt_ms("a", "a") == 0
    assert lab.ip == {"a": "198.18.100.1", "b": "198.18.100.2", "c": "198.18.100.3"}


@pytest.mark.netns
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_pings_take_the_configured_round_trip_near_and_far() -> None:
    with DelayLab({"a": "eu", "b": "eu", "c": "us"}, rtt_ms={("eu", "eu"): 4, ("eu", "us"): 40}) as lab:
        near, far = lab.ping("a", "b", 20), lab.ping("a", "c", 20)
        assert None not in near and None not in far, (near, far)
        assert min(near) >= 4 and min(far) >= 40, (near, far)  # never sooner than configured
        assert statistics.median(near) < 4 + 5 and statistics.median(far) < 40 + 10, (near, far)  # nor much later
        assert max(near) < min(far)
        stats = lab.stats()
        assert stats["packets"] >= 80 and stats["queued"] == 0, stats  # 40 pings there and back, none left behind
        print(f"\nnear (4 ms): median {statistics.median(near):.2f} ms; far (40 ms): median "
              f"{statistics.median(far):.2f} ms; router busy {stats['busy_us_per_packet']:.0f} µs per packet")


@pytest.mark.netns
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_a_rate_limit_caps_what_a_host_sends_and_only_that() -> None:
    with DelayLab({"a": "x", "b": "x"}, rtt_ms={("x", "x"): 2}, rate_mbit={"a": 8}) as lab:
        capped = lab.send("a", "b", 1_500_000)  # 1.5 s at 8 Mbit/s
        free = lab.send("b", "a", 1_500_000)
    assert 5 < capped["mbit_s"] <= 8.2, capped
    assert free["mbit_s"] > 3 * capped["mbit_s"], (capped, free)  # b's sending rate is not limited


@pytest.mark.netns
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_a_burst_beyond_the_queue_is_dropped_at_the_tail() -> None:
    with DelayLab({"a": "x", "b": "x"}, rtt_ms={("x", "x"): 0}, rate_mbit={"a": 1}, queue_kb=16) as lab:
        counter = lab.probe("b", "udp-count", "5000", "1.0")
        assert counter.stdout is not None and counter.stdout.readline().startswith('{"event": "ready"')
        lab.probe("a", "udp-burst", lab.ip["b"], "5000", "100", "1000").communicate(timeout=30)
        got = json.loads(counter.communicate(timeout=60)[0].strip().splitlines()[-1])["got"]
        stats = lab.stats()
    # 16 KiB queued behind a 1 Mbit/s link holds 15 datagrams of 1,028 B (IP): the rest of the burst is dropped
    assert 12 <= got <= 25, got
    assert got + stats.get("dropped_queue", 0) == 100, (got, stats)


# -- a Sangama fleet across the lab ------------------------------------------------------------------------------------

def _fleet_cli(*args: str) -> list[str]:
    return [sys.executable, "-c", "from sangama_p2p.cli.main import entry; entry()", *args]


@contextmanager
def lab_fleet(lab: DelayLab, tmp_path: Path, tiny: Path,
              stages: Sequence[tuple[str, str]]) -> Iterator[tuple[str, dict[str, str]]]:
    """A bootstrap node in host ``boot`` of ``lab`` and a ``join --no-lanes --threads 1`` per (host, layers) of
    ``stages``, CLI processes, each ready: yields the bootstrap's address and each stage host's peer id; stops them."""
    from .test_nat_fleet import _Proc

    procs: list[_Proc] = []

    def start(host: str, *args: str) -> _Proc:
        proc = _Proc(["ip", "netns", "exec", lab.ns[host], *_fleet_cli(*args)])
        procs.append(proc)
        return proc

    try:
        boot_p = start("boot", "bootstrap", "--listen", "/ip4/0.0.0.0/tcp/4001", "--key", str(tmp_path / "b.key"))
        boot_p.wait_for("  --bootstrap ", 60)
        boot = next(x.split()[1] for x in boot_p.lines if x.startswith("  --bootstrap ") and lab.ip["boot"] in x)
        joined = {host: start(host, "join", "--model", str(tiny), "--layers", layers, "--bootstrap", boot, "--listen",
                              "/ip4/0.0.0.0/tcp/4101", "--key", str(tmp_path / f"{host}.key"), "--no-lanes",
                              "--threads", "1")
                  for host, layers in stages}
        yield boot, {host: p.wait_for("ready ", 120)[0].split()[1] for host, p in joined.items()}
    finally:
        for proc in procs:
            proc.stop()


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_a_fleet_across_the_lab_gives_local_tokens_at_the_chains_distance(tmp_path: Path) -> None:
    from .test_nat_fleet import PROMPT, TOKENS, _local_tokens, _make_tiny

    tiny = _make_tiny(tmp_path / "tiny")
    expected = _local_tokens(tiny, TOKENS)
    hosts = {"boot": "eu", "s0": "eu", "client": "eu", "s1": "us"}  # stage 1 is 40 ms from everyone else
    with DelayLab(hosts, rtt_ms={("eu", "eu"): 2, ("eu", "us"): 40}) as lab, \
            lab_fleet(lab, tmp_path, tiny, (("s0", "0:4"), ("s1", "4:8"))) as (boot, _):
        t0 = time.monotonic()
        gen = subprocess.run(["ip", "netns", "exec", lab.ns["client"], *_fleet_cli(
            "generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot, "--prompt-ids",
            PROMPT, "--max-new-tokens", str(TOKENS), "--ignore-eos", "--guesses", "0", "--json")],
            capture_output=True, text=True, timeout=180)
        took = time.monotonic() - t0
        assert gen.returncode == 0, gen.stderr[-3000:]
        result = json.loads(gen.stdout.strip().splitlines()[-1])
    assert result["tokens"] == expected
    # a trip: client -> s0 (1 ms) -> s1 (20 ms) -> client (20 ms), one way each
    trip_ms = (lab.rtt_ms("client", "s0") + lab.rtt_ms("s0", "s1") + lab.rtt_ms("s1", "client")) / 2
    per_token = result["decode_ms"] / max(1, result["steps"])
    assert per_token >= trip_ms, (per_token, trip_ms, result)
    print(f"\n{TOKENS} tokens across the lab in {took:.2f} s (client process included); decode {per_token:.1f} ms per "
          f"token against a configured trip of {trip_ms:.0f} ms")


@pytest.mark.netns
@pytest.mark.slow
@pytest.mark.skipif(_REASON is not None, reason=_REASON or "")
def test_the_ring_and_the_trips_through_the_client_give_local_tokens_across_the_lab(tmp_path: Path) -> None:
    """Issue 29: stages and the client each in a region of their own, 20 ms apart. With the ring (the default),
    without it and with two windows in flight, with and without guesses, the tokens are ``generate --local``'s,
    and no trip through the client beats the wire it must cross (client -> s0 -> s1 -> client).
    Speed: ``benchmarks/distance.py --ring off on --client-apart``."""
    from .test_nat_fleet import PROMPT, TOKENS, _local_tokens, _make_tiny

    tiny = _make_tiny(tmp_path / "tiny")
    expected = _local_tokens(tiny, TOKENS)
    hosts = {"boot": "c", "client": "c", "s0": "a", "s1": "b"}
    rtt = {("a", "a"): 2, ("b", "b"): 2, ("c", "c"): 2, ("a", "b"): 20, ("a", "c"): 20, ("b", "c"): 20}
    results = {}
    flags = {"on": ["--ring"], "off": ["--no-ring"], "w2": ["--windows", "2"]}
    stages = (("s0", "0:4"), ("s1", "4:8"))
    with DelayLab(hosts, rtt_ms=rtt) as lab, lab_fleet(lab, tmp_path, tiny, stages) as (boot, _):
        for ring, guesses in (("on", "0"), ("on", "2"), ("off", "0"), ("off", "2"), ("w2", "2")):
            gen = subprocess.run(["ip", "netns", "exec", lab.ns["client"], *_fleet_cli(
                "generate", "--model", tiny.name, "--tokenizer", str(tiny), "--bootstrap", boot,
                "--prompt-ids", PROMPT, "--max-new-tokens", str(TOKENS), "--ignore-eos", "--guesses", guesses,
                "--json", *flags[ring])], capture_output=True, text=True, timeout=180)
            assert gen.returncode == 0, gen.stderr[-3000:]
            results[ring, guesses] = json.loads(gen.stdout.strip().splitlines()[-1])
    for (ring, guesses), result in results.items():
        assert result["tokens"] == expected, (ring, guesses)
        per_trip = result["decode_ms"] / max(1, result["steps"])
        # through the client a trip crosses 3 links of 10 ms one way; with the ring the client's clock is no floor
        # (the stages go on while the client is busy with an answer, so the next ones can come in together)
        assert ring != "off" or per_trip >= 30.0, (ring, guesses, per_trip)
        print(f"\nring {ring}, {guesses} guesses: {per_trip:.1f} ms per trip")

