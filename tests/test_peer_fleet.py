"""A bootstrap node and three stage peers as separate ``sangama-peer`` processes on loopback.

Greedy tokens over the network equal ``generate --local`` for the same model and split: without guesses, with
2, 4, 6 and auto guesses, and for 8 concurrent requests batched by the stages. Every process stops cleanly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from sangama_p2p import Peer, PeerConfig
from sangama_p2p.cli.local_fleet import LocalFleet
from sangama_p2p.cli.generate_cmds import prompt_variants
from sangama_p2p.client.config import ClientConfig
from sangama_p2p.model.chain import LocalChain
from sangama_p2p.model.chat import load_chat_template, render_chat
from sangama_p2p.model.checkpoint import open_checkpoint
from sangama_p2p.model.make import make_model
from sangama_p2p.model.spec import parse_stages
from sangama_p2p.net.config import HostConfig
from sangama_p2p.net.identity import generate_key_pair

SPLIT = "0:3,3:6,6:8"
PROMPT = [7, 300, 41, 9, 512, 3]
NEW = 12


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory):
    work = tmp_path_factory.mktemp("fleet")
    model = make_model(work / "fleet-tiny", "qwen3_5_moe", "tiny")
    f = LocalFleet(model, SPLIT.split(","), work / "procs")
    with f:
        yield model, f
    for child in f.children:  # every process is gone, and the stages stopped through their own shutdown path
        assert child.proc.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.kill(child.proc.pid, 0)
    for child in f.children[1:]:
        assert child.proc.returncode == 0, child.tail()
        assert "stopping" in child.seen


def cli(*args: str, timeout: float = 120) -> dict:
    out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", *args], capture_output=True, text=True,
                         timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    return {"json": json.loads(out.stdout) if "--json" in args else None, "stderr": out.stderr,
            "stdout": out.stdout}


def net_args(model: Path, f: LocalFleet, *extra: str) -> list[str]:
    ids = ",".join(map(str, PROMPT))
    return ["generate", "--model", str(model), "--bootstrap", f.bootstrap_addr, "--prompt-ids", ids,
            "--max-new-tokens", str(NEW), "--ignore-eos", *extra]


def local_chain(model: Path) -> LocalChain:
    ckpt = open_checkpoint(model)
    return LocalChain.load(ckpt, parse_stages(SPLIT, ckpt.spec.num_layers))


def test_cli_generate_equals_local_without_and_with_auto_guesses(fleet) -> None:
    model, f = fleet
    ids = ",".join(map(str, PROMPT))
    local = cli("generate", "--local", str(model), "--stages", SPLIT, "--prompt-ids", ids, "--max-new-tokens",
                str(NEW), "--ignore-eos", "--json")["json"]["tokens"]
    assert len(local) == NEW
    plain = cli(*net_args(model, f, "--json", "--guesses", "0"))["json"]
    assert plain["tokens"] == local
    assert len(plain["route"]) == 3 and plain["route"] == f.stage_ids
    out = cli(*net_args(model, f, "--json", "--guesses", "auto", "--timings"))
    auto = out["json"]
    assert auto["tokens"] == local
    assert auto["guesses_proposed"] > 0
    assert "Where the time goes" in out["stderr"] and "network (4 hops" in out["stderr"]
    assert len(auto["where_the_time_goes"]["stages"]) == 3


@pytest.mark.slow
def test_cli_batch_of_8_equals_each_solo_run(fleet) -> None:
    model, f = fleet
    out = cli(*net_args(model, f, "--json", "--batch", "8"))
    chain = local_chain(model)
    vocab = chain.spec.vocab_size
    prompts = prompt_variants(PROMPT, 8, vocab)
    requests = out["json"]["requests"]
    assert len(requests) == 8
    for req, prompt in zip(requests, prompts):
        assert req["prompt_ids"] == prompt
        assert req["tokens"] == chain.generate(prompt, NEW, stop_at_eos=False).tokens
    stages = requests[0]["where_the_time_goes"]["stages"]
    assert len(stages) == 3
    assert max(s["mean_batch"] for r in requests for s in r["where_the_time_goes"]["stages"]) > 1  # batched


def test_fixed_guesses_2_4_6_over_the_process_fleet(fleet) -> None:
    model, f = fleet
    chain = local_chain(model)
    expected = chain.generate(PROMPT, NEW, stop_at_eos=False).tokens
    config = PeerConfig(host=HostConfig(listen_addrs=("/ip4/127.0.0.1/tcp/0",), bootstrap_addrs=(f.bootstrap_addr,),
                                        dht_server=False), client=ClientConfig(model_id=model.name),
                        tokenizer_path=model)

    async def main() -> dict[int, tuple[list[int], int]]:
        out = {}
        async with Peer(config, key_pair=generate_key_pair()) as peer:
            for g in (2, 4, 6):
                r = await peer.generate(PROMPT, NEW, guesses=g, stop_at_eos=False)
                out[g] = (list(r.tokens), r.result.guesses_proposed)
        return out

    for g, (tokens, proposed) in trio.run(main).items():
        assert tokens == expected, g
        assert proposed >= g  # the guesses were really sent and checked


def test_chat_streams_each_answer(fleet) -> None:
    model, f = fleet
    out = subprocess.run([sys.executable, "-m", "sangama_p2p.cli.main", "chat", "--model", str(model), "--bootstrap",
                          f.bootstrap_addr, "--max-new-tokens", "6", "--guesses", "0"], input="hello\n",
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    ckpt = open_checkpoint(model)
    # the tiny model has no chat template: the conversation is plain "role: content" lines (and chat says so)
    prompt = render_chat(load_chat_template(model), ckpt.tokenizer, [{"role": "user", "content": "hello"}])
    assert prompt.text == "user: hello\nassistant:" and "has no chat template" in out.stderr
    tokens = local_chain(model).generate(list(prompt.ids), 6).tokens
    answer = tokens[:-1] if tokens[-1] in prompt.stop_ids else tokens
    assert out.stdout == ckpt.tokenizer.decode(answer) + "\n"


@pytest.mark.slow
def test_stages_measure_their_successors_and_the_client_plans_with_it(fleet) -> None:
    """Issue 24 item 1: each stage pings the stages that can follow it and publishes the round trips in its signed
    record (``status --json``); the client's hops between stages are then measured, not estimated (``--json`` hops,
    ``--timings``)."""
    import time

    model, f = fleet
    ids = f.stage_ids
    deadline = time.monotonic() + 60
    while True:
        peers = {p["peer_id"]: p for p in cli("status", "--bootstrap", f.bootstrap_addr, "--model", model.name,
                                              "--json", "--timeout", "10")["json"]["peers"]}
        links = {i: dict(peers[i]["records"][0]["links"]) if i in peers and peers[i]["records"] else {} for i in ids}
        if (ids[1] in links[ids[0]] and ids[2] in links[ids[1]]) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(links[ids[0]]) == {ids[1]} and set(links[ids[1]]) == {ids[2]} and links[ids[2]] == {}, links
    assert all(0 < rtt < 1.0 for x in links.values() for rtt in x.values()), links  # loopback: well under a second
    out = cli(*net_args(model, f, "--json", "--timings"))
    hops = out["json"]["hops"]
    assert [(h["from"], h["to"]) for h in hops] == [("", ids[0]), (ids[0], ids[1]), (ids[1], ids[2]), (ids[2], "")]
    assert all(h["measured"] for h in hops), hops
    assert "measured" in out["stderr"] and "hops (one-way, as planned)" in out["stderr"]


def test_join_auto_adds_a_spare_and_stops_on_sigint(fleet, tmp_path: Path) -> None:
    model, f = fleet
    proc = subprocess.Popen([sys.executable, "-m", "sangama_p2p.cli.main", "join", "--model", str(model), "--layers",
                             "auto", "--bootstrap", f.bootstrap_addr, "--listen", "/ip4/127.0.0.1/tcp/0", "--key",
                             str(tmp_path / "spare.key")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().split()
        # every layer served: a spare over one of the served ranges - the one serving the fewest steps/s (speeds
        # within 2x count as equal, then the lowest start: 0:3; the last stage, which also computes the logits,
        # can announce less than half the others' speed, and then it is 6:8)
        assert ready[0] == "ready" and ready[2] == model.name and ready[3] in ("0:3", "3:6", "6:8"), ready
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
        assert "stopping" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
